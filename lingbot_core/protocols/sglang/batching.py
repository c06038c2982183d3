"""One chunk's frames <-> the protocol's frame batches.

Server side, `build_frame_batches` cuts a chunk's uint8 frames [N, H, W, 3] into batches of at most 16 raw
rgb24 frames, or at most 6 webp/jpeg images (downscaled to `preview_max_width` when that is narrower).
Client side, `ChunkAssembler` takes the batches in arrival order, checks they belong together (one chunk,
batch indexes 0..n-1, one frame size) and gives back the chunk's frames [N, H, W, 3] uint8 after its final
batch. Raw frames come back bit-exact; images come back as decoded (lossy for jpeg and lossy webp).
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
from PIL import Image

from lingbot_core.protocols.sglang.protocol import (IMAGE_CONTENT_TYPES, RAW_CHANNELS, RAW_CONTENT_TYPE, SERVER_ERROR, FrameBatch,
                       ProtocolError)

RAW_FRAMES_PER_BATCH = 16
IMAGE_FRAMES_PER_BATCH = 6
DEFAULT_QUALITY = {"webp": 90, "jpeg": 95}
_PIL_FORMAT = {"webp": "WEBP", "jpeg": "JPEG"}


def preview_size(width: int, height: int, max_width: int | None) -> tuple[int, int]:
    """The delivered size of an image frame: the source size, or narrowed to max_width keeping the aspect."""
    if max_width is None or width <= max_width:
        return width, height
    return max_width, max(1, round(height * max_width / width))


def _check_frames(frames: np.ndarray) -> None:
    if not isinstance(frames, np.ndarray) or frames.dtype != np.uint8 or frames.ndim != 4 \
            or frames.shape[-1] != RAW_CHANNELS:
        shape = getattr(frames, "shape", None)
        dtype = getattr(frames, "dtype", type(frames).__name__)
        raise ValueError(f"frames must be a uint8 array [N, H, W, 3], got {dtype} {shape}")
    if frames.shape[1] < 1 or frames.shape[2] < 1:
        raise ValueError(f"frames must have a positive height and width, got {frames.shape}")


def _encode_image(frame: np.ndarray, output_format: str, size: tuple[int, int], quality: int) -> bytes:
    image = Image.fromarray(frame, "RGB")
    if image.size != size:
        image = image.resize(size, Image.Resampling.BICUBIC)
    buffer = io.BytesIO()
    options = {"method": 0} if output_format == "webp" else {"subsampling": 0}  # speed; full chroma for jpeg
    image.save(buffer, format=_PIL_FORMAT[output_format], quality=quality, **options)
    return buffer.getvalue()


def build_frame_batches(frames: np.ndarray, *, request_id: str, chunk_index: int, event_id: int | None,
                        output_format: str = "raw", preview_max_width: int | None = None,
                        quality: int | None = None) -> list[FrameBatch]:
    """A chunk's frames as frame batches, in sending order (a chunk of no frames is one empty batch)."""
    _check_frames(frames)
    count, height, width, _ = frames.shape
    if output_format == "raw":
        per_batch = RAW_FRAMES_PER_BATCH
    elif output_format in IMAGE_CONTENT_TYPES:
        per_batch = IMAGE_FRAMES_PER_BATCH
    else:
        raise ValueError(f"output_format must be raw, webp or jpeg; got {output_format!r}")
    starts = list(range(0, count, per_batch)) or [0]
    batches = []
    for index, start in enumerate(starts):
        part = frames[start:start + per_batch]
        common = dict(request_id=request_id, chunk_index=chunk_index, num_frames=len(part),
                      frame_batch_index=index, num_frame_batches=len(starts),
                      is_final_frame_batch=index == len(starts) - 1, event_id=event_id)
        if output_format == "raw":
            payload = np.ascontiguousarray(part).tobytes()
            batches.append(FrameBatch(
                **common, content_type=RAW_CONTENT_TYPE, total_size=len(payload), payload=payload, format="rgb24",
                encoding="raw", width=width, height=height, channels=RAW_CHANNELS,
                bytes_per_frame=width * height * RAW_CHANNELS, raw_size=len(payload)))
            continue
        size = preview_size(width, height, preview_max_width)
        level = DEFAULT_QUALITY[output_format] if quality is None else quality
        images = [_encode_image(frame, output_format, size, level) for frame in part]
        payload = b"".join(images)
        batches.append(FrameBatch(
            **common, content_type=IMAGE_CONTENT_TYPES[output_format], total_size=len(payload), payload=payload,
            format=output_format, encoding=output_format, width=size[0], height=size[1], source_width=width,
            source_height=height, preview_width=size[0], preview_height=size[1],
            payload_lengths=tuple(len(image) for image in images)))
    return batches


def decode_batch_frames(batch: FrameBatch) -> np.ndarray:
    """One batch's frames as uint8 [n, H, W, 3] (H, W: the delivered size)."""
    if batch.content_type == RAW_CONTENT_TYPE:
        return np.frombuffer(batch.payload, np.uint8).reshape(batch.num_frames, batch.height, batch.width,
                                                              RAW_CHANNELS).copy()
    frames = np.empty((batch.num_frames, batch.height, batch.width, RAW_CHANNELS), np.uint8)
    offset = 0
    for i, length in enumerate(batch.payload_lengths or ()):
        try:
            with Image.open(io.BytesIO(batch.payload[offset:offset + length])) as image:
                rgb = np.asarray(image.convert("RGB"))
        except Exception as exc:  # PIL reports a broken image through many exception types
            raise ProtocolError(SERVER_ERROR, f"chunk {batch.chunk_index} image {i} does not decode "
                                              f"({type(exc).__name__})") from None
        if rgb.shape != frames.shape[1:]:
            raise ProtocolError(SERVER_ERROR, f"chunk {batch.chunk_index} image {i} is {rgb.shape[1]}x"
                                              f"{rgb.shape[0]}, the header says {batch.width}x{batch.height}")
        frames[i] = rgb
        offset += length
    return frames


@dataclass(frozen=True)
class AssembledChunk:
    chunk_index: int
    request_id: str
    event_id: int | None  # the last event applied to this chunk
    content_type: str
    frames: np.ndarray  # uint8 [N, H, W, 3]
    num_batches: int


class ChunkAssembler:
    """Client side: frame batches in arrival order -> whole chunks. Anything out of order is a ProtocolError
    (the protocol's batches arrive in order on one connection, so a gap means a broken server)."""

    def __init__(self) -> None:
        self._batches: list[FrameBatch] = []
        self.last_chunk_index: int | None = None

    @property
    def in_progress(self) -> int | None:
        """The chunk index whose batches have started but not finished, if any."""
        return self._batches[0].chunk_index if self._batches else None

    def add(self, batch: FrameBatch) -> AssembledChunk | None:
        expected_index = len(self._batches)
        if self._batches:
            first = self._batches[0]
            if batch.chunk_index != first.chunk_index:
                raise ProtocolError(SERVER_ERROR, f"chunk {batch.chunk_index} began before chunk "
                                                  f"{first.chunk_index}'s final batch")
            if (batch.num_frame_batches, batch.content_type, batch.width, batch.height) != \
                    (first.num_frame_batches, first.content_type, first.width, first.height):
                raise ProtocolError(SERVER_ERROR, f"chunk {batch.chunk_index} batch {batch.frame_batch_index} "
                                                  "changes the batch count, content type or frame size")
        elif self.last_chunk_index is not None and batch.chunk_index <= self.last_chunk_index:
            raise ProtocolError(SERVER_ERROR, f"chunk {batch.chunk_index} arrived after chunk "
                                              f"{self.last_chunk_index}")
        if batch.frame_batch_index != expected_index:
            raise ProtocolError(SERVER_ERROR, f"chunk {batch.chunk_index}: batch {batch.frame_batch_index} "
                                              f"arrived where batch {expected_index} was due")
        self._batches.append(batch)
        if not batch.is_final_frame_batch:
            return None
        batches, self._batches = self._batches, []
        self.last_chunk_index = batch.chunk_index
        frames = np.concatenate([decode_batch_frames(b) for b in batches])
        return AssembledChunk(batch.chunk_index, batch.request_id, batch.event_id, batch.content_type, frames,
                              len(batches))
