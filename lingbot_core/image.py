"""The start image: decode, check, resize and centre-crop to the model's frame, scale to [-1, 1]."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

# Images above this are refused before decoding: a decompression bomb must not take the server down.
MAX_IMAGE_PIXELS = 40_000_000
MAX_IMAGE_BYTES = 50 * 1024 * 1024


class ImageError(ValueError):
    """The start image cannot be used; the message says why."""


def load_image(source: str | Path | bytes | Image.Image | np.ndarray) -> Image.Image:
    """Open an image from a path, bytes, a PIL image or an HxWx3 uint8 array, as RGB."""
    if isinstance(source, Image.Image):
        image = source
    elif isinstance(source, np.ndarray):
        if source.ndim != 3 or source.shape[2] not in (3, 4) or source.dtype != np.uint8:
            raise ImageError(f"an image array must be HxWx3 uint8, got shape {source.shape} dtype {source.dtype}")
        image = Image.fromarray(source)
    else:
        if isinstance(source, (str, Path)):
            path = Path(source)
            if not path.is_file():
                raise ImageError(f"no image file at {path}")
            if path.stat().st_size > MAX_IMAGE_BYTES:
                raise ImageError(f"{path.name} is larger than {MAX_IMAGE_BYTES // 2**20} MiB")
            data = path.read_bytes()
        elif isinstance(source, bytes):
            data = source
        else:
            raise ImageError(f"cannot read an image from {type(source).__name__}")
        try:
            image = Image.open(io.BytesIO(data))
            if image.width * image.height > MAX_IMAGE_PIXELS:
                raise ImageError(f"image is {image.width}x{image.height}; at most {MAX_IMAGE_PIXELS} pixels are accepted")
            image.load()
        except ImageError:
            raise
        except (UnidentifiedImageError, OSError, Image.DecompressionBombError, SyntaxError) as exc:
            raise ImageError(f"not a readable image ({exc})") from None
    if image.width * image.height > MAX_IMAGE_PIXELS:
        raise ImageError(f"image is {image.width}x{image.height}; at most {MAX_IMAGE_PIXELS} pixels are accepted")
    return image.convert("RGB")


def image_to_tensor(image: Image.Image, height: int, width: int) -> torch.Tensor:
    """[1, 3, height, width] float32 in [-1, 1]: scale to cover the frame, then centre-crop."""
    scale = max(width / image.width, height / image.height)
    resized = image.resize((max(width, round(image.width * scale)), max(height, round(image.height * scale))),
                           Image.Resampling.BICUBIC)
    left, top = (resized.width - width) // 2, (resized.height - height) // 2
    cropped = np.asarray(resized.crop((left, top, left + width, top + height)), dtype=np.float32)
    return torch.from_numpy(cropped).permute(2, 0, 1).unsqueeze(0) / 127.5 - 1.0


def image_digest(image: Image.Image) -> str:
    """sha256 of the RGB pixels and size: names the start image in a replay without storing it."""
    digest = hashlib.sha256(f"{image.width}x{image.height}".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()
