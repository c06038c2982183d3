"""The official LingBot-World example folder, taken as it is.

The upstream repository ships each example as a folder (examples/00/ ...) and its command takes such a
folder as `--action_path`:

    image.jpg        the start picture
    prompt.txt       the prompt
    poses.npy        [F, 4, 4] camera-to-world, OpenCV convention, one per video frame (961 in the examples)
    intrinsics.npy   [F, 4] (fx, fy, cx, cy) in 832x480 pixels
    action.npy, wasd_action.npy, ijkl_action.npy
                     [F, 4] per-frame key flags of other model versions; the v2 fast path does not read them

`read_example_folder` takes the folder from disk (the offline command's --action-path);
`example_from_files` takes the same files dropped together in the app, where Gradio stores each upload
in a folder of its own. Both only locate and read the small text parts: the NPY files are loaded, with
every check, by `camera.load_trajectory`, and the image by `image.load_image`.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

IMAGE_NAMES = ("image.jpg", "image.jpeg", "image.png")
PROMPT_NAME = "prompt.txt"
POSES_NAME = "poses.npy"
INTRINSICS_NAME = "intrinsics.npy"
UNUSED_NAMES = ("action.npy", "wasd_action.npy", "ijkl_action.npy")  # read by other versions, not by v2 fast
MAX_PROMPT_BYTES = 64 * 1024  # far above any prompt the text limit accepts; a bound on what is read


class ExampleFolderError(ValueError):
    """An example folder (or a set of dropped files) that does not have the official layout."""


@dataclass(frozen=True)
class ExampleFolder:
    poses: Path
    intrinsics: Path
    image: Path | None  # None: the folder has no picture; the caller must give one
    prompt: str | None  # None: no prompt.txt; the caller must give one


def read_example_folder(path: str | os.PathLike) -> ExampleFolder:
    """Locate the official files in a folder; poses.npy and intrinsics.npy are required."""
    folder = Path(path)
    if not folder.is_dir():
        raise ExampleFolderError(f"{folder} is not a folder; --action-path takes an example folder holding "
                                 f"{POSES_NAME}, {INTRINSICS_NAME}, an image and {PROMPT_NAME}")
    present = {name: folder / name for name in (*IMAGE_NAMES, PROMPT_NAME, POSES_NAME, INTRINSICS_NAME)
               if (folder / name).exists()}
    return _example(present, where=str(folder))


def example_from_files(paths: Iterable[str | os.PathLike]) -> ExampleFolder:
    """The same layout from files dropped together: each is known by its name, wherever it was stored."""
    present: dict[str, Path] = {}
    for raw in paths:
        path = Path(raw)
        name = path.name.lower()
        if name.startswith(".") or name in UNUSED_NAMES:
            continue
        if name not in (*IMAGE_NAMES, PROMPT_NAME, POSES_NAME, INTRINSICS_NAME):
            raise ExampleFolderError(f"{path.name} is not a file of an example folder; drop {POSES_NAME}, "
                                     f"{INTRINSICS_NAME}, image.jpg and {PROMPT_NAME} (other files: "
                                     f"{', '.join(UNUSED_NAMES)} are accepted and not used)")
        if name in present:
            raise ExampleFolderError(f"{path.name} was given twice; drop one example folder's files at a time")
        present[name] = path
    return _example(present, where="the dropped files")


def _example(present: dict[str, Path], where: str) -> ExampleFolder:
    missing = [name for name in (POSES_NAME, INTRINSICS_NAME) if name not in present]
    if missing:
        raise ExampleFolderError(f"{where} lack {' and '.join(missing)}; an example folder holds {POSES_NAME} "
                                 f"[F,4,4] and {INTRINSICS_NAME} [F,4]")
    images = [present[name] for name in IMAGE_NAMES if name in present]
    if len(images) > 1:
        raise ExampleFolderError(f"{where} hold {len(images)} images ({', '.join(p.name for p in images)}); "
                                 "keep one")
    prompt = _read_prompt(present[PROMPT_NAME]) if PROMPT_NAME in present else None
    return ExampleFolder(poses=present[POSES_NAME], intrinsics=present[INTRINSICS_NAME],
                         image=images[0] if images else None, prompt=prompt)


def _read_prompt(path: Path) -> str:
    """prompt.txt as UTF-8 text (a byte-order mark is dropped); bounded, and refused if it is not text."""
    try:
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
        fd = os.open(path, flags)
    except OSError as exc:
        raise ExampleFolderError(f"{path.name}: cannot be opened ({exc.strerror})") from exc
    with os.fdopen(fd, "rb") as fp:
        if not stat.S_ISREG(os.fstat(fp.fileno()).st_mode):
            raise ExampleFolderError(f"{path.name}: is not a regular file")
        data = fp.read(MAX_PROMPT_BYTES + 1)
    if len(data) > MAX_PROMPT_BYTES:
        raise ExampleFolderError(f"{path.name}: is larger than {MAX_PROMPT_BYTES} bytes; a prompt is a short text")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ExampleFolderError(f"{path.name}: is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
