"""fMP4 streaming both ways, as vLLM-Omni's realtime video protocol sends it.

The writer's payloads are checked against PyAV's own demuxer and decoder (decode_fmp4): every chunk's
frames complete in its own payload (none held back for the next), pts continuous on the 90 kHz clock,
the picture close to the input. The reader is checked against the same oracle, bit for bit, whether the
stream arrives a payload at a time or in random small pieces.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest

from lingbot_core.boundary.fmp4 import (
    CLOCK_HZ, MAX_BOX_SIZE, Fmp4Error, Fmp4Reader, Fmp4Writer, decode_fmp4, decode_fmp4_pts)

FPS = 16
CHUNKS = (9, 12, 12)  # the protocol's first chunk, then whole blocks
SIZES = [(160, 96), (832, 480)]


def moving_gradient(count: int, width: int, height: int, start: int = 0) -> np.ndarray:
    """Smooth colour waves drifting a little each frame: what a good H.264 encode keeps well above 35 dB."""
    t = np.arange(start, start + count, dtype=np.float64)[:, None, None]
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    u, v = x / width, y / height
    red = 128 + 90 * np.sin(2 * np.pi * (u + t / 40))
    green = 128 + 90 * np.cos(2 * np.pi * (v - t / 50))
    blue = 128 + 90 * np.sin(2 * np.pi * (u + v + t / 60))
    return np.stack([red, green, blue], axis=-1).round().astype(np.uint8)


def top_level_boxes(data: bytes) -> list[str]:
    """The types of the top-level boxes; asserts they tile the payload exactly (no partial box)."""
    kinds, pos = [], 0
    while pos < len(data):
        size, kind = struct.unpack_from(">I4s", data, pos)
        assert size >= 8, f"bad box size {size} at {pos}"
        kinds.append(kind.decode("latin-1"))
        pos += size
    assert pos == len(data), "a payload ends inside a box"
    return kinds


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float(10 * np.log10(255.0 ** 2 / mse))


def write_stream(width: int, height: int, chunks=CHUNKS, codec_options=None):
    """(input frames, payloads: one per chunk then the trailer) for one stream."""
    writer = Fmp4Writer(width, height, FPS, codec_options)
    frames = moving_gradient(sum(chunks), width, height)
    payloads, start = [], 0
    for count in chunks:
        payloads.append(writer.add(frames[start:start + count]))
        start += count
        if codec_options is None:  # zerolatency: every frame leaves in its own call
            assert writer.frames_written == start
    payloads.append(writer.close())
    return frames, payloads


@pytest.fixture(scope="module", params=SIZES, ids=lambda size: f"{size[0]}x{size[1]}")
def stream(request):
    width, height = request.param
    frames, payloads = write_stream(width, height)
    return width, height, frames, payloads


# --- writer ---------------------------------------------------------------------------------------------------

def test_each_payload_carries_exactly_its_chunks_fragments(stream):
    _, _, _, payloads = stream
    first = top_level_boxes(payloads[0])
    assert first[:2] == ["ftyp", "moov"]
    for count, payload in zip(CHUNKS, payloads):
        kinds = top_level_boxes(payload)
        assert kinds.count("moof") == count and kinds.count("mdat") == count
        assert kinds[-2:] == ["moof", "mdat"]  # the chunk's last frame is complete, not held for the next
    trailer = top_level_boxes(payloads[-1])
    assert "moof" not in trailer  # nothing of any frame was left for close


def test_the_joined_payloads_decode_to_the_input(stream):
    width, height, frames, payloads = stream
    data = b"".join(payloads)
    decoded = decode_fmp4(data)
    assert decoded.shape == (len(frames), height, width, 3)
    assert decode_fmp4_pts(data) == [i * CLOCK_HZ // FPS for i in range(len(frames))]
    assert psnr(decoded, frames) > 35


def test_codec_options_replace_the_defaults_wholesale():
    _, default = write_stream(160, 96)
    frames, coarse = write_stream(160, 96, codec_options={"preset": "veryfast", "crf": "30"})
    assert len(b"".join(coarse)) < len(b"".join(default))
    # veryfast without tune=zerolatency has lookahead: frames still all arrive, some only at close.
    assert len(decode_fmp4(b"".join(coarse))) == len(frames)


def test_the_writer_checks_the_frames_it_is_given():
    writer = Fmp4Writer(160, 96, FPS)
    with pytest.raises(ValueError, match="uint8"):
        writer.add(np.zeros((2, 96, 160, 3), np.float32))
    with pytest.raises(ValueError, match="96, 160, 3"):
        writer.add(np.zeros((2, 96, 128, 3), np.uint8))
    writer.close()


# --- reader ---------------------------------------------------------------------------------------------------

def test_the_reader_returns_each_chunk_as_its_payload_arrives(stream):
    _, _, frames, payloads = stream
    expected = decode_fmp4(b"".join(payloads))
    reader, got, pts = Fmp4Reader(), [], []
    for count, payload in zip(CHUNKS + (0,), payloads):
        chunk = reader.feed(payload)
        assert len(chunk) == count
        got += chunk
        pts += reader.last_pts
    assert reader.close() == []
    assert len(got) == len(frames)
    assert all(np.array_equal(a, b) for a, b in zip(got, expected))
    assert pts == [i * CLOCK_HZ // FPS for i in range(len(frames))]


def test_the_reader_gives_the_same_frames_from_random_small_pieces(stream):
    _, _, frames, payloads = stream
    data = b"".join(payloads)
    expected = decode_fmp4(data)
    rng = np.random.default_rng(7)
    reader, got, pos = Fmp4Reader(), [], 0
    while pos < len(data):
        step = int(rng.integers(1, 5001))
        got += reader.feed(data[pos:pos + step])
        pos += step
    got += reader.close()
    assert len(got) == len(frames)
    assert all(np.array_equal(a, b) for a, b in zip(got, expected))


def test_memory_stays_flat_over_a_long_stream():
    width, height, chunk = 160, 96, 12
    writer, reader = Fmp4Writer(width, height, FPS), Fmp4Reader()
    rng = np.random.default_rng(3)
    for start in range(0, 300, chunk):
        payload = writer.add(moving_gradient(chunk, width, height, start))
        assert writer.buffered_bytes == 0  # the sink keeps nothing once a payload is handed out
        cut = len(payload) - int(rng.integers(1, 200))  # the payload's last box arrives in two parts
        head = reader.feed(payload[:cut])
        assert 0 < reader.buffered_bytes < 1 << 20  # only the box in flight is held
        assert len(head) + len(reader.feed(payload[cut:])) == chunk
        assert reader.buffered_bytes == 0
    assert writer.frames_written == 300
    writer.close()
    assert reader.close() == []


# --- malformed input ------------------------------------------------------------------------------------------

def test_random_bytes_are_refused():
    data = np.random.default_rng(11).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    with pytest.raises(Fmp4Error, match="box"):
        Fmp4Reader().feed(data)


@pytest.mark.parametrize("header, message", [
    (struct.pack(">I4s", 0x7FFFFFFF, b"ftyp"), "limit"),
    (struct.pack(">I4sQ", 1, b"ftyp", MAX_BOX_SIZE + 1), "limit"),
    (struct.pack(">I4s", 4, b"ftyp"), "smaller than its header"),
    (struct.pack(">I4s", 0, b"ftyp"), "end of the file"),
    (struct.pack(">I4s", 16, b"moov"), "start with an 'ftyp'"),
])
def test_absurd_or_misplaced_boxes_are_refused(header, message):
    with pytest.raises(Fmp4Error, match=message):
        Fmp4Reader().feed(header)


def test_an_absurd_box_mid_stream_is_refused_before_it_is_buffered():
    _, payloads = write_stream(160, 96, chunks=(3,))
    reader = Fmp4Reader()
    assert len(reader.feed(payloads[0])) == 3
    with pytest.raises(Fmp4Error, match="limit"):
        reader.feed(struct.pack(">I4s", 0xFFFFFFF0, b"moof"))


def test_a_corrupt_moov_is_refused():
    _, payloads = write_stream(160, 96, chunks=(3,))
    data = bytearray(payloads[0])
    moov = data.find(b"moov") - 4
    child = moov + 8  # the first box inside the moov (mvhd): make it overrun its parent
    data[child:child + 4] = struct.pack(">I", 1 << 20)
    with pytest.raises(Fmp4Error, match="overruns"):
        Fmp4Reader().feed(bytes(data))


def test_a_truncated_stream_gives_its_complete_frames_only():
    frames, payloads = write_stream(160, 96)
    data = b"".join(payloads[:-1])
    expected = decode_fmp4(data)
    reader = Fmp4Reader()
    got = reader.feed(data[:-10])  # the last frame's mdat lacks its last bytes
    got += reader.close()
    assert len(got) == len(frames) - 1
    assert all(np.array_equal(a, b) for a, b in zip(got, expected))


def test_corrupted_streams_raise_fmp4error_or_decode():
    """Bytes flipped in the headers (moov, moof) or anywhere: the reader raises Fmp4Error or returns frames,
    never another exception (a trun of 10^9 default samples once ran out of memory; a huge tfdt overflowed)."""
    _, payloads = write_stream(64, 48, chunks=(3, 4))
    data = b"".join(payloads)
    rng = np.random.default_rng(5)
    refused = 0
    for _ in range(300):
        corrupt = bytearray(data)
        for _ in range(int(rng.integers(1, 4))):
            index = int(rng.integers(0, 1500 if rng.random() < 0.8 else len(corrupt)))
            corrupt[index] = int(rng.integers(0, 256))
        reader = Fmp4Reader()
        try:
            frames = reader.feed(bytes(corrupt)) + reader.close()
        except Fmp4Error:
            refused += 1
        else:
            assert all(frame.dtype == np.uint8 and frame.ndim == 3 for frame in frames)
    assert refused > 0
