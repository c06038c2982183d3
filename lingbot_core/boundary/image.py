"""The start image: checked from its header, decoded within bounds, fitted to the model's frame.

An upload is hostile until proven otherwise: a 260-byte PNG can declare 60000x1 pixels, and a 17 KB
1-bit PNG 12000x12000. So a file is judged by its header first (format, size, mode, aspect ratio,
bytes its decoded pixels would take) and refused before a single pixel is decoded; what passes is
decoded once and cut straight to the frame with `resize(box=...)`, so no intermediate larger than the
source's own pixels is ever allocated. `fit_image` is the expensive step: callers that serve many
users (the engine) run it on their request threads, never on the model thread.
"""

from __future__ import annotations

import base64
import binascii

import hashlib
import io
import warnings
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

# Limits on what is decoded at all. Pixels and bytes bound the one decode; the aspect ratio bounds the
# part of the picture thrown away by the centre crop (a 60000x1 strip is noise, not a scene).
MAX_IMAGE_PIXELS = 40_000_000
MAX_IMAGE_BYTES = 50 * 1024 * 1024  # the file itself
MAX_DECODED_BYTES = 4 * MAX_IMAGE_PIXELS  # 40 MP of RGBA; wider pixel modes must be smaller
MAX_ASPECT_RATIO = 8.0  # longer side / shorter side
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
# Modes PIL can turn into RGB without surprises; 32-bit integer or float pixels are not photographs.
MODES = ("1", "L", "LA", "La", "P", "PA", "RGB", "RGBA", "RGBa", "RGBX", "CMYK", "YCbCr", "I;16", "I;16B",
         "I;16L", "LAB", "HSV")


class ImageError(ValueError):
    """The start image cannot be used; the message says why."""


def check_header(width: int, height: int, mode: str, format_name: str | None = None) -> None:
    """Refuse, from the header alone, an image whose decode or fitting would cost too much."""
    if format_name is not None and format_name not in FORMATS:
        raise ImageError(f"a {format_name} image is not accepted; use PNG, JPEG, WebP, GIF, BMP or TIFF")
    if width < 1 or height < 1:
        raise ImageError(f"image is {width}x{height}; it has no pixels")
    if width * height > MAX_IMAGE_PIXELS:
        raise ImageError(f"image is {width}x{height}; at most {MAX_IMAGE_PIXELS} pixels are accepted "
                         f"({MAX_IMAGE_PIXELS / 1e6:g} megapixels)")
    ratio = max(width, height) / min(width, height)
    if ratio > MAX_ASPECT_RATIO:
        raise ImageError(f"image is {width}x{height}, an aspect ratio of {ratio:.0f}:1; "
                         f"at most {MAX_ASPECT_RATIO:g}:1 is accepted")
    if mode not in MODES:
        raise ImageError(f"image pixel mode {mode!r} is not accepted; use an RGB, RGBA, grey or palette image")
    bands = Image.getmodebands(mode)
    bytes_per_band = 2 if mode.startswith("I;16") else 1
    if width * height * bands * bytes_per_band > MAX_DECODED_BYTES:
        raise ImageError(f"image is {width}x{height} in mode {mode}, {width * height * bands * bytes_per_band / 2**20:.0f}"
                         f" MiB decoded; at most {MAX_DECODED_BYTES // 2**20} MiB is accepted")


def data_url_bytes(url: str, what: str) -> bytes:
    """The bytes of a picture sent as a base64 `data:image/...` URL (a protocol's start message); ImageError says
    what is wrong. An http(s) URL is refused: a server that fetched what strangers name would fetch for them."""
    if not url.startswith("data:"):
        raise ImageError(f"{what} is an http(s) URL; this server fetches no URLs: send the image bytes or a "
                         "data:image/...;base64 URL")
    header, _, body = url.partition(",")
    if not header.endswith(";base64"):
        raise ImageError(f"a {what} data URL must be base64 (data:image/...;base64,...)")
    if len(body) > 4 * MAX_IMAGE_BYTES // 3 + 4:
        raise ImageError(f"{what} holds more than {MAX_IMAGE_BYTES // 2**20} MiB")
    try:
        return base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"{what}'s data URL is not valid base64") from None


def load_image(source: str | Path | bytes | Image.Image | np.ndarray) -> Image.Image:
    """Open an image from a path, bytes, a PIL image or an HxWx3/4 uint8 array, as RGB; ImageError if unusable.

    Files and bytes are checked from the header before decoding (`check_header`).
    """
    if isinstance(source, Image.Image):
        check_header(source.width, source.height, source.mode)
        return source.convert("RGB")  # a copy even when RGB: the caller's image stays the caller's
    if isinstance(source, np.ndarray):
        if source.ndim != 3 or source.shape[2] not in (3, 4) or source.dtype != np.uint8:
            raise ImageError(f"an image array must be HxWx3 uint8, got shape {source.shape} dtype {source.dtype}")
        check_header(source.shape[1], source.shape[0], "RGB" if source.shape[2] == 3 else "RGBA")
        return Image.fromarray(source).convert("RGB")
    if isinstance(source, (str, Path)):
        path = Path(source)
        if not path.is_file():
            raise ImageError(f"no image file at {path}")
        size = path.stat().st_size
    elif isinstance(source, bytes):
        path, size = None, len(source)
    else:
        raise ImageError(f"cannot read an image from {type(source).__name__}")
    if size > MAX_IMAGE_BYTES:
        raise ImageError(f"the image file is {size / 2**20:.1f} MiB; at most {MAX_IMAGE_BYTES // 2**20} MiB is accepted")
    try:
        # Image.open reads the header only; pixels are decoded by load(), after the checks. PIL's own bomb
        # warning is silenced: our limits are lower, and an oversized header is refused just below.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(path if path is not None else io.BytesIO(source))
        with image:  # leaving it closes the file only; the decoded pixels stay (Pillow's __exit__)
            check_header(image.width, image.height, image.mode, image.format)
            image.load()
            return _rgb(image)
    except ImageError:
        raise
    except UnidentifiedImageError:
        raise ImageError("not a readable image: its format is not recognised (use PNG, JPEG, WebP, GIF, BMP "
                         "or TIFF)") from None
    except Image.DecompressionBombError:
        raise ImageError(f"not a readable image: it declares more than {MAX_IMAGE_PIXELS} pixels") from None
    except (OSError, SyntaxError, ValueError, EOFError, MemoryError):
        raise ImageError("not a readable image: the file is truncated or corrupt") from None


def fit_image(image: Image.Image, height: int, width: int) -> Image.Image:
    """The centre of `image` at the frame's aspect ratio, resampled (bicubic) to exactly width x height.

    The crop box is taken in source coordinates and handed to resize, so the only allocation is the
    output frame (PIL's separable resampling adds one pass of width x box height).
    """
    check_header(image.width, image.height, image.mode)
    if image.size == (width, height):
        return image.convert("RGB")
    scale = max(width / image.width, height / image.height)  # cover the frame, then crop the overflow
    box_w, box_h = width / scale, height / scale
    left, top = (image.width - box_w) / 2, (image.height - box_h) / 2
    return _rgb(image).resize((width, height), Image.Resampling.BICUBIC, box=(left, top, left + box_w, top + box_h))


def _rgb(image: Image.Image) -> Image.Image:
    """`image` as RGB, without the full-size copy PIL's convert makes of an image that already is."""
    return image if image.mode == "RGB" else image.convert("RGB")


def image_to_tensor(image: Image.Image, height: int, width: int) -> torch.Tensor:
    """[1, 3, height, width] float32 in [-1, 1]: scale to cover the frame, then centre-crop."""
    fitted = np.asarray(fit_image(image, height, width), dtype=np.float32)
    return torch.from_numpy(fitted).permute(2, 0, 1).unsqueeze(0) / 127.5 - 1.0


def image_digest(image: Image.Image) -> str:
    """sha256 of the RGB pixels and size: names the start image in a replay without storing it."""
    digest = hashlib.sha256(f"{image.width}x{image.height}".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()
