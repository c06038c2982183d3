"""Frames to H.264 with PyAV: whole MP4 files, self-contained segments for streaming playback, and a
stream's recording (its segments on disk, joined into one MP4 for the download, with their replay).

PyAV is imported where a video is read or written, not with this module: the engine imports
`frames_to_uint8` from here, and a machine that only serves or benchmarks blocks (a GPU box with no
PyAV, benchmarks/bench_gpu.py) should not need a video codec to start."""

from __future__ import annotations

import dataclasses
import io
import threading
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import torch


def frames_to_uint8(frames: torch.Tensor) -> np.ndarray:
    """[1, 3, T, H, W] in [-1, 1] -> [T, H, W, 3] uint8."""
    pixels = ((frames[0].float().clamp(-1, 1) + 1.0) * 127.5).round().to(torch.uint8)
    return pixels.permute(1, 2, 3, 0).contiguous().cpu().numpy()


class H264Writer:
    """Appends uint8 frames to one H.264 stream in an MP4 (or any container PyAV can mux)."""

    def __init__(self, target: str | Path | io.BytesIO, width: int, height: int, fps: int,
                 container_format: str = "mp4", crf: int = 20) -> None:
        import av

        self._av = av
        self._container = av.open(target, mode="w", format=container_format)
        self._stream = self._container.add_stream("libx264", rate=fps)
        self._stream.width, self._stream.height = width, height
        self._stream.pix_fmt = "yuv420p"
        self._stream.time_base = Fraction(1, fps)
        # zerolatency: no lookahead or B-frames, so each frame can be shown as soon as it is encoded.
        self._stream.options = {"crf": str(crf), "preset": "veryfast", "tune": "zerolatency"}
        self._pts = 0

    def write(self, frames: np.ndarray) -> None:
        for frame in frames:
            video_frame = self._av.VideoFrame.from_ndarray(frame, format="rgb24")
            video_frame.pts = self._pts
            self._pts += 1
            for packet in self._stream.encode(video_frame):
                self._container.mux(packet)

    def close(self) -> None:
        for packet in self._stream.encode():
            self._container.mux(packet)
        self._container.close()


def mp4_segment(frames: np.ndarray, fps: int) -> bytes:
    """One self-contained MP4 clip of these frames (what a streaming player appends)."""
    buffer = io.BytesIO()
    writer = H264Writer(buffer, width=frames.shape[2], height=frames.shape[1], fps=fps)
    writer.write(frames)
    writer.close()
    return buffer.getvalue()


def count_frames(path: str | Path) -> tuple[int, float]:
    """(decoded frame count, average rate) of a video file; what tests check against 12N - 3."""
    import av

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        count = sum(1 for _ in container.decode(stream))
        return count, float(stream.average_rate or 0)


def concat_mp4(segments: list[Path], out_path: Path) -> None:
    """Remux H.264 MP4 segments (same codec settings, no B-frames) into one file, end to end in time."""
    import av

    with av.open(str(out_path), mode="w") as output:
        out_stream, offset = None, 0
        for segment in segments:
            with av.open(str(segment)) as source:
                stream = source.streams.video[0]
                if out_stream is None:
                    out_stream = output.add_stream_from_template(stream)
                end = offset
                for packet in source.demux(stream):
                    if packet.dts is None:  # the demuxer's end-of-stream marker
                        continue
                    packet.pts += offset
                    packet.dts += offset
                    end = max(end, packet.pts + packet.duration)
                    packet.stream = out_stream
                    output.mux(packet)
                offset = end


class Recording:
    """A stream's segments on disk, one folder per world, and the replay of exactly the blocks they show.

    The replay is built from what the stream received (a world's header, then each block's entry), never
    read from the session, so the download's video and replay always hold the same blocks. The stream
    adds blocks on its own thread while a download may export: one lock makes a segment and its replay
    entry join together, and an export takes both at one moment.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.world = 0
        self.segments: list[Path] = []
        self.replay: Any = None  # the current world's replay (serving.session.Replay), if it has one
        self._lock = threading.Lock()

    @property
    def world_dir(self) -> Path:
        return self.root / f"world-{self.world}"

    def new_world(self, replay: Any = None) -> None:
        """Start the next world's folder; `replay`: its replay header (copied; blocks are added by `add`)."""
        with self._lock:
            self.world += 1
            self.world_dir.mkdir(parents=True, exist_ok=True)
            self.segments = []
            self.replay = dataclasses.replace(replay, blocks=[]) if replay is not None else None

    def add(self, frames: np.ndarray, fps: int, replay_entry: dict[str, Any] | None = None) -> Path:
        """Encode [T, H, W, 3] uint8 frames as the next segment; the file appears whole or not at all."""
        if self.world == 0:
            self.new_world()
        path = self.world_dir / f"block-{len(self.segments):06d}.mp4"
        partial = path.with_suffix(".part")
        partial.write_bytes(mp4_segment(frames, fps))
        partial.replace(path)
        with self._lock:
            self.segments.append(path)
            if self.replay is not None and replay_entry is not None:
                self.replay.blocks.append(replay_entry)
        return path

    def export(self, out_path: Path, replay_path: Path | None = None) -> int:
        """Join this world's segments into one MP4 without re-encoding, and write its replay (when it has
        one) holding the same blocks; returns the block count (0: none yet, nothing written)."""
        with self._lock:
            segments = list(self.segments)
            replay = dataclasses.replace(self.replay, blocks=list(self.replay.blocks)) \
                if self.replay is not None else None
        if segments:
            concat_mp4(segments, out_path)
            if replay_path is not None and replay is not None:
                replay_path.write_text(replay.to_json())
        return len(segments)
