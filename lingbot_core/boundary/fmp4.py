"""H.264 in fragmented MP4 (fMP4), streamed both ways as vLLM-Omni's realtime video protocol sends it.

The stream: one H.264 track muxed by FFmpeg's mp4 muxer with `frag_every_frame+empty_moov+default_base_moof`,
so payload 0 begins with ftyp+moov and every frame is one moof+mdat; timestamps on a 90 kHz clock, frame i at
i * 90000 / fps, continuous across chunks. Concatenating all payloads (the trailer last) gives one valid file.

Writer. With `frag_every_frame` the muxer writes a frame's fragment only when the *next* packet arrives (the
fragment's last duration is taken from the next dts), so a chunk's last frame would reach the client one chunk
late. A zero-size packet does not help (the muxer drops it before its fragment check). The muxer's documented
flush is `av_write_frame(ctx, NULL)` (what `frag_custom` is driven by): it writes the pending fragment at once.
PyAV does not expose it, so `_MuxerFlush` calls it through ctypes on PyAV's own libavformat, after checking
that the pointer it found really is that library's AVFormatContext. Each packet carries its duration (the
gap to the next frame's pts, known in advance), so the flushed fragment's last sample needs no next packet.

Reader. PyAV's demuxer reads a file-like object to its end and cannot resume when the bytes run out, so a
realtime client cannot use it on a growing stream. The reader instead parses the few boxes it needs itself:
top-level boxes one at a time, moov (trak/mdia/mdhd, minf/stbl/stsd/avc1/avcC) for the timescale and the
decoder's extradata, moof (tfhd/tfdt/trun) for the samples' offsets, sizes and times, and the mdat after it
for their bytes; each sample (AVCC, length-prefixed NAL units, as the avcC record declares) goes straight to
an H.264 decoder. Only the current top-level box is buffered, so memory stays flat on an unbounded stream.

PyAV is imported where a stream is written or read, as in `video.py`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import io
import os
import struct
from fractions import Fraction

import numpy as np

CLOCK_HZ = 90_000
MOVFLAGS = "+frag_every_frame+empty_moov+default_base_moof"
DEFAULT_CODEC_OPTIONS = {"preset": "ultrafast", "threads": "0", "tune": "zerolatency"}
CRF = "18"
MAX_BOX_SIZE = 64 << 20  # a top-level box the reader buffers whole
MAX_RUN_SAMPLES = 1 << 16  # bounds a trun whose samples all take the defaults (no bytes per sample)


class Fmp4Error(ValueError):
    """The fMP4 stream is malformed or unsupported."""


class _Sink:
    """Write-only byte sink, drained after each call. It has no seek/tell, so PyAV opens it non-seekable and
    the muxer never seeks back into bytes already handed out (fragmented output needs no seeking)."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def write(self, data: bytes) -> int:
        self._parts.append(bytes(data))
        return len(data)

    def drain(self) -> bytes:
        data = b"".join(self._parts)
        self._parts.clear()
        return data

    @property
    def buffered(self) -> int:
        return sum(len(part) for part in self._parts)


class _MuxerFlush:
    """`av_write_frame(ctx, NULL)` on a PyAV output container: the mp4 muxer writes its pending fragment."""

    def __init__(self, container) -> None:
        import av

        lib = self._libavformat(av)
        lib.avformat_get_class.restype = ctypes.c_void_p
        lib.av_write_frame.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.av_write_frame.restype = ctypes.c_int
        # Container.ptr is the first C field of PyAV's Cython class, after PyObject_HEAD and the vtable pointer.
        ctx = ctypes.c_void_p.from_address(id(container) + 3 * ctypes.sizeof(ctypes.c_void_p)).value
        # An AVFormatContext starts with its AVClass, the very one avformat_get_class() returns: this checks
        # both the pointer and that ctypes loaded the same libavformat copy that PyAV uses.
        if not ctx or ctx < 1 << 16 or ctx % ctypes.alignment(ctypes.c_void_p) \
                or ctypes.c_void_p.from_address(ctx).value != lib.avformat_get_class():
            raise RuntimeError(f"cannot reach PyAV {av.__version__}'s AVFormatContext to flush fMP4 fragments")
        self._lib, self._ctx = lib, ctx

    @staticmethod
    def _libavformat(av) -> ctypes.CDLL:
        # Wheels bundle FFmpeg next to the package (av.libs on Linux, av/.dylibs on macOS); a build against the
        # system's FFmpeg links the system library. Loading an already loaded path returns the same copy.
        root = os.path.dirname(av.__file__)
        for pattern in ("../av.libs/libavformat*", ".dylibs/libavformat*", "../av.libs/avformat*.dll"):
            found = sorted(glob.glob(os.path.join(root, pattern)))
            if found:
                return ctypes.CDLL(found[0])
        name = ctypes.util.find_library("avformat")
        if name is None:
            raise RuntimeError("libavformat not found")
        return ctypes.CDLL(name)

    def __call__(self) -> None:
        ret = self._lib.av_write_frame(self._ctx, None)
        if ret < 0:
            raise RuntimeError(f"fMP4 fragment flush failed (av_write_frame: {ret})")


class Fmp4Writer:
    """Frames to fMP4 payloads: `add` returns every byte the muxer wrote for those frames, each frame's
    moof+mdat complete; payload 0 also carries ftyp+moov; `close` returns the trailer (the muxer's mfra).

    Realtime holds while the encoder returns a packet per frame, as it does with the default options
    (zerolatency: no lookahead, no B-frames). Caller options replace the defaults wholesale (crf stays 18
    unless they set it); options that add encoder delay make frames come out in later calls, or at `close`.
    Our sink is drained every call; the muxer itself keeps one small index entry per fragment for the mfra it
    writes on close (FFmpeg's, as in vLLM-Omni), so the trailer grows about 19 bytes per frame.
    """

    def __init__(self, width: int, height: int, fps: float,
                 codec_options: dict[str, str] | None = None) -> None:
        import av

        self._av = av
        self.width, self.height = int(width), int(height)
        self._sink = _Sink()
        # flush_packets: AVIO's 32 KiB buffer reaches the sink after each write, not holding a fragment's end.
        self._container = av.open(self._sink, mode="w", format="mp4",
                                  options={"movflags": MOVFLAGS, "flush_packets": "1"})
        self._stream = self._container.add_stream("h264", rate=Fraction(fps).limit_denominator(10000))
        self._stream.width, self._stream.height = self.width, self.height
        self._stream.pix_fmt = "yuv420p"
        self._time_base = Fraction(1, CLOCK_HZ)
        self._stream.time_base = self._stream.codec_context.time_base = self._time_base
        self._stream.codec_context.max_b_frames = 0
        options = DEFAULT_CODEC_OPTIONS if codec_options is None else codec_options
        self._stream.options = {"crf": CRF, **{str(k): str(v) for k, v in options.items()}}
        self._ticks_per_frame = Fraction(CLOCK_HZ) / Fraction(fps).limit_denominator(10000)
        self._flush: _MuxerFlush | None = None  # made once the header is written (the first packet)
        self._frames_in = 0  # frames given to the encoder
        self._frames_out = 0  # packets muxed, i.e. frames whose fragment has been returned
        self._closed = False

    def _pts(self, index: int) -> int:
        return round(index * self._ticks_per_frame)

    @property
    def frames_written(self) -> int:
        """Frames whose moof+mdat are in the bytes returned so far."""
        return self._frames_out

    @property
    def buffered_bytes(self) -> int:
        """Bytes held in the sink between calls (0: every call drains it)."""
        return self._sink.buffered

    def _mux(self, packets) -> None:
        for packet in packets:
            # No B-frames: packets leave in frame order, so this one is frame `_frames_out`; its duration is
            # the gap to the next frame, which a flushed fragment's last sample needs.
            packet.duration = self._pts(self._frames_out + 1) - self._pts(self._frames_out)
            self._container.mux(packet)
            self._frames_out += 1

    def add(self, frames: np.ndarray) -> bytes:
        """[N, H, W, 3] uint8 rgb24 frames -> the bytes the muxer wrote for them."""
        if self._closed:
            raise RuntimeError("Fmp4Writer is closed")
        frames = np.asarray(frames)
        if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[1:] != (self.height, self.width, 3):
            raise ValueError(f"frames must be uint8 [N, {self.height}, {self.width}, 3], got "
                             f"{frames.dtype} {list(frames.shape)}")
        before = self._frames_out
        for frame in frames:
            video_frame = self._av.VideoFrame.from_ndarray(frame, format="rgb24")
            video_frame.pts, video_frame.time_base = self._pts(self._frames_in), self._time_base
            self._frames_in += 1
            self._mux(self._stream.encode(video_frame))
        if self._frames_out > before:
            if self._flush is None:
                self._flush = _MuxerFlush(self._container)
            self._flush()  # the last frame's fragment now, not when the next chunk's first packet comes
        return self._sink.drain()

    def close(self) -> bytes:
        """Flush the encoder, write the muxer's trailer, and return those bytes."""
        if self._closed:
            return b""
        self._closed = True
        self._mux(self._stream.encode(None))
        self._container.close()
        return self._sink.drain()


def _box_header(data, pos: int, end: int) -> tuple[str, int, int] | None:
    """(type, payload start, box end) of the box at `pos`, or None while its header is incomplete."""
    if end - pos < 8:
        return None
    size, raw = struct.unpack_from(">I4s", data, pos)
    header = 8
    if size == 1:  # 64-bit size follows the type
        if end - pos < 16:
            return None
        size, header = struct.unpack_from(">Q", data, pos + 8)[0], 16
    kind = raw.decode("latin-1")
    if size == 0:
        raise Fmp4Error(f"box {kind!r} at {pos} runs to the end of the file, which a stream cannot have")
    if size < header:
        raise Fmp4Error(f"box {kind!r} at {pos} has size {size}, smaller than its header")
    if size > MAX_BOX_SIZE:
        raise Fmp4Error(f"box {kind!r} at {pos} has size {size}, over the {MAX_BOX_SIZE}-byte limit")
    return kind, pos + header, pos + size


def _children(data: bytes, start: int, end: int) -> dict[str, list[tuple[int, int]]]:
    """The boxes inside data[start:end], by type: [(payload start, payload end)]."""
    found: dict[str, list[tuple[int, int]]] = {}
    while start < end:
        box = _box_header(data, start, end)
        if box is None or box[2] > end:
            raise Fmp4Error(f"box at {start} overruns its parent (ends at {end})")
        found.setdefault(box[0], []).append((box[1], box[2]))
        start = box[2]
    return found


def _child(data: bytes, parent: tuple[int, int], path: str) -> tuple[int, int]:
    """The first box along a slash-separated path of types below `parent` (payload bounds)."""
    for kind in path.split("/"):
        boxes = _children(data, *parent).get(kind)
        if not boxes:
            raise Fmp4Error(f"missing {kind!r} box")
        parent = boxes[0]
    return parent


def _unpack(fmt: str, data: bytes, pos: int, end: int) -> tuple:
    if pos + struct.calcsize(fmt) > end:
        raise Fmp4Error("box too short for its fields")
    return struct.unpack_from(fmt, data, pos)


class _Track:
    """What the moov says about the video track: its id, timescale and the avcC record (decoder extradata)."""

    def __init__(self, moov: bytes) -> None:
        whole = (0, len(moov))
        for trak in _children(moov, *whole).get("trak", []):
            mdia = _child(moov, trak, "mdia")
            handler = _unpack(">8x4s", moov, *_child(moov, mdia, "hdlr"))[0]
            if handler == b"vide":
                break
        else:
            raise Fmp4Error("moov has no video track")
        tkhd = _child(moov, trak, "tkhd")
        self.track_id = _unpack(">20xI" if moov[tkhd[0]] == 1 else ">12xI", moov, *tkhd)[0]
        mdhd = _child(moov, mdia, "mdhd")
        self.timescale = _unpack(">20xI" if moov[mdhd[0]] == 1 else ">12xI", moov, *mdhd)[0]
        if not self.timescale:
            raise Fmp4Error("mdhd timescale is 0")
        stsd_start, stsd_end = _child(moov, mdia, "minf/stbl/stsd")
        entries = _children(moov, stsd_start + 8, stsd_end)  # skip version/flags and the entry count
        if "avc1" not in entries:
            raise Fmp4Error(f"video track is not H.264 (avc1); sample entries: {sorted(entries)}")
        avc1_start, avc1_end = entries["avc1"][0]
        # A visual sample entry has 78 bytes of fields before its child boxes.
        avcc_start, avcc_end = _child(moov, (avc1_start + 78, avc1_end), "avcC")
        self.avcc = bytes(moov[avcc_start:avcc_end])
        # trex (in mvex) holds the defaults a fragment's tfhd/trun may leave out.
        self.default_duration, self.default_size = 0, 0
        for mvex in _children(moov, *whole).get("mvex", []):
            for trex in _children(moov, *mvex).get("trex", []):
                track_id, _, duration, size = _unpack(">4xIIII", moov, *trex)
                if track_id == self.track_id:
                    self.default_duration, self.default_size = duration, size


def _samples(moof: bytes, moof_pos: int, track: _Track) -> list[tuple[int, int, int, int]]:
    """[(stream position, size, decode time, presentation time)] of the track's samples in this moof."""
    samples = []
    for traf in _children(moof, 0, len(moof)).get("traf", []):
        tfhd_start, tfhd_end = _child(moof, traf, "tfhd")
        flags, track_id = _unpack(">II", moof, tfhd_start, tfhd_end)
        if track_id != track.track_id:
            continue
        flags &= 0xFFFFFF
        pos = tfhd_start + 8
        base = moof_pos  # default-base-is-moof, or no base given: the first byte of the moof
        if flags & 0x1:
            base = _unpack(">Q", moof, pos, tfhd_end)[0]
            pos += 8
        pos += 4 if flags & 0x2 else 0  # sample description index
        duration, size = track.default_duration, track.default_size
        if flags & 0x8:
            duration = _unpack(">I", moof, pos, tfhd_end)[0]
            pos += 4
        if flags & 0x10:
            size = _unpack(">I", moof, pos, tfhd_end)[0]
        children = _children(moof, *traf)
        if "tfdt" not in children:
            raise Fmp4Error("traf has no tfdt (decode time)")
        tfdt_start, tfdt_end = children["tfdt"][0]
        time = _unpack(">4xQ" if moof[tfdt_start] == 1 else ">4xI", moof, tfdt_start, tfdt_end)[0]
        cursor = base
        for trun_start, trun_end in children.get("trun", []):
            version_flags, count = _unpack(">II", moof, trun_start, trun_end)
            flags, pos = version_flags & 0xFFFFFF, trun_start + 8
            if flags & 0x1:
                cursor = base + _unpack(">i", moof, pos, trun_end)[0]
                pos += 4
            pos += 4 if flags & 0x4 else 0  # first sample flags
            fields = [(0x100, "duration"), (0x200, "size"), (0x400, "flags"), (0x800, "cts")]
            present = [name for bit, name in fields if flags & bit]
            if pos + 4 * len(present) * count > trun_end or count > MAX_RUN_SAMPLES:
                raise Fmp4Error(f"trun declares {count} samples but is too short for them, or over "
                                f"{MAX_RUN_SAMPLES}")
            for _ in range(count):
                values = dict(zip(present, struct.unpack_from(f">{len(present)}I", moof, pos)))
                pos += 4 * len(present)
                sample_size = values.get("size", size)
                cts = values.get("cts", 0)
                if cts >= 1 << 31:  # signed in a version 1 trun (and never this large in version 0)
                    cts -= 1 << 32
                samples.append((cursor, sample_size, time, time + cts))
                cursor += sample_size
                time += values.get("duration", duration)
    return samples


class Fmp4Reader:
    """Incremental fMP4 decoder: `feed` bytes in any pieces, get each frame once its moof+mdat has arrived.

    Frames are rgb24 uint8 [H, W, 3]; `last_pts` holds the 90 kHz pts of the frames the last call returned.
    Malformed input raises Fmp4Error (the reader cannot resynchronise after it: start a new one); `close`
    drops an incomplete last box (a truncated stream) and returns the frames the decoder still held.
    """

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._offset = 0  # stream position of _buffer[0]
        self._track: _Track | None = None
        self._decoder = None  # an H.264 decoder, opened from the moov's avcC
        self._timescale = Fraction(1)  # track ticks -> 90 kHz ticks
        self._moof: tuple[int, bytes] | None = None  # (stream position, bytes) of a moof awaiting its mdat
        self._started = False
        self.last_pts: list[int] = []

    @property
    def buffered_bytes(self) -> int:
        """Bytes held for an incomplete box or a moof awaiting its mdat."""
        return len(self._buffer) + (len(self._moof[1]) if self._moof else 0)

    def feed(self, data: bytes) -> list[np.ndarray]:
        self._buffer += data
        frames: list[tuple[np.ndarray, int | None]] = []
        while (box := _box_header(self._buffer, 0, len(self._buffer))) is not None:
            kind, payload, end = box
            if not self._started and kind != "ftyp":
                raise Fmp4Error(f"stream must start with an 'ftyp' box, not {kind!r}")
            self._started = True
            if len(self._buffer) < end:
                break
            frames += self._box(kind, bytes(self._buffer[payload:end]), self._offset, payload)
            del self._buffer[:end]
            self._offset += end
        return self._done(frames)

    def close(self) -> list[np.ndarray]:
        """The frames the decoder still holds; an incomplete last box (a truncated stream) is dropped."""
        self._buffer.clear()
        self._moof = None
        frames = self._decode(None) if self._decoder is not None else []
        return self._done(frames)

    def _done(self, frames: list[tuple[np.ndarray, int | None]]) -> list[np.ndarray]:
        self.last_pts = [pts for _, pts in frames]
        return [frame for frame, _ in frames]

    def _box(self, kind: str, payload: bytes, position: int,
             header: int) -> list[tuple[np.ndarray, int | None]]:
        if kind == "moov":
            self._open(_Track(payload))
        elif kind == "moof":
            if self._track is None:
                raise Fmp4Error("moof before moov")
            if self._moof is not None:
                raise Fmp4Error("moof without its mdat")
            self._moof = (position, payload)
        elif kind == "mdat" and self._moof is not None:
            moof_position, moof = self._moof
            self._moof = None
            frames = []
            for start, size, dts, pts in _samples(moof, moof_position, self._track):
                start -= position + header  # into this mdat's payload
                if start < 0 or start + size > len(payload):
                    raise Fmp4Error("a sample lies outside the mdat after its moof")
                frames += self._decode(payload[start:start + size], dts, pts)
            return frames
        return []  # ftyp, mfra, free, ...: nothing to decode

    def _open(self, track: _Track) -> None:
        import av

        if self._decoder is not None:
            raise Fmp4Error("a second moov in one stream")
        self._track = track
        self._decoder = av.CodecContext.create("h264", "r")
        self._decoder.extradata = track.avcc
        self._decoder.thread_type = "SLICE"  # frame threads would hold frames back
        self._timescale = Fraction(CLOCK_HZ, track.timescale)

    def _decode(self, sample: bytes | None, dts: int = 0, pts: int = 0) -> list[tuple[np.ndarray, int | None]]:
        import av

        packet = None  # None: drain the decoder
        if sample is not None:
            if max(abs(dts), abs(pts)) >= 1 << 62:  # FFmpeg timestamps are int64
                raise Fmp4Error(f"sample time {dts}/{pts} is out of range")
            packet = av.Packet(sample)
            packet.dts, packet.pts = dts, pts
        try:
            decoded = self._decoder.decode(packet)
        except av.FFmpegError as error:
            raise Fmp4Error(f"H.264 sample does not decode: {error}") from error
        return [(frame.to_ndarray(format="rgb24"),
                 None if frame.pts is None else round(frame.pts * self._timescale)) for frame in decoded]


def decode_fmp4(data: bytes) -> np.ndarray:
    """A whole fMP4 stream -> [T, H, W, 3] uint8, through PyAV's own demuxer (independent of Fmp4Reader)."""
    import av

    with av.open(io.BytesIO(data), format="mp4") as container:
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    return np.stack(frames)


def decode_fmp4_pts(data: bytes) -> list[int]:
    """The 90 kHz pts of a whole fMP4 stream's frames, in decode order, through PyAV's demuxer."""
    import av

    with av.open(io.BytesIO(data), format="mp4") as container:
        stream = container.streams.video[0]
        return [round(packet.pts * stream.time_base * CLOCK_HZ)
                for packet in container.demux(stream) if packet.pts is not None]
