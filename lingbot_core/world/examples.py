"""Start pictures of procedural worlds: render them, name them by their world seed, recognise them again.

    python -m lingbot_core.world.examples --out examples/ [--seeds 1000003 1000011 ...] [--supersample 2]

A world's start picture is what the session's first camera sees: the start pose (the identity) with
the key-input intrinsics, rendered exactly as the training clips render their first frame (same
size, same supersampling). The file of world `seed` is named `world_<seed>.png`, so a picture carries
its seed wherever it is copied (the app's examples, Gradio's cache); `StartPictures.recognise` reads
the seed back from the name and renders the world again to confirm the pixels are that world's, so
a renamed photograph is never mistaken for one.

The app's examples are held-out worlds only (`EXAMPLE_SEEDS`), so the embedded model never saw them
in training and a ground-truth comparison against them is fair.
"""

from __future__ import annotations

import argparse
import re
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Callable

import numpy as np
from PIL import Image

from lingbot_core.config import PRESETS, ModelConfig
from lingbot_core.model import camera
from lingbot_core.world.render import SUPERSAMPLE, render, to_uint8
from lingbot_core.world.scene import HELD_OUT_SEEDS, TRAIN_SEEDS, make_world

# Held-out worlds with different looks (sky, ground, object kinds), chosen by eye from the first few dozen.
EXAMPLE_SEEDS = (1_000_003, 1_000_008, 1_000_013, 1_000_018)
# A picture is that world's render when it differs from a fresh render by less than this mean, in uint8
# levels: a lossless PNG of the same render differs by float rounding on another CPU at most (a level on
# a few pixels); a different world, a resampled or re-encoded picture differs by tens of levels.
MATCH_MEAN_LEVELS = 1.0
_NAME = re.compile(r"world_(\d{1,12})\.png")


def example_name(seed: int) -> str:
    return f"world_{int(seed)}.png"


def start_picture(seed: int, config: ModelConfig, supersample: int = SUPERSAMPLE) -> np.ndarray:
    """World `seed` from the start pose, [height, width, 3] uint8 at the preset's size."""
    return to_uint8(render(make_world(seed), *_start_camera(config), config.width, config.height, supersample))[0]


def _start_camera(config: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """The start pose [1, 4, 4] (the identity) and the key-input intrinsics [4] in pixels of the frame."""
    return (camera.CameraState.initial().pose[None],
            np.array(camera.intrinsics_for(config.camera, config.width, config.height)))


# (seed, poses [F, 4, 4], intrinsics [4], width, height) -> frames [F, H, W, 3] uint8
RenderFrames = Callable[[int, np.ndarray, np.ndarray, int, int], np.ndarray]


class StartPictures:
    """Start pictures of one preset's worlds, rendered by `render_frames` (default: here, at SUPERSAMPLE) and
    the last few kept, so that a picture the app just made is recognised without rendering it again."""

    def __init__(self, config: ModelConfig, render_frames: RenderFrames | None = None, keep: int = 16) -> None:
        self.config, self.keep = config, keep
        self._render = render_frames or (lambda seed, poses, k, w, h: to_uint8(render(make_world(seed), poses, k, w, h,
                                                                                        SUPERSAMPLE)))
        self._pictures: OrderedDict[int, np.ndarray] = OrderedDict()
        self._known: dict[int, np.ndarray] = {}  # never forgotten (the repository's examples)
        self._lock = threading.Lock()

    def know(self, path: str | Path) -> None:
        """A committed picture file is its named world's start picture (the repository's examples; a test checks
        each against a render): recognised from now on without rendering it, so Start with Ground truth does not
        wait for the render process. A file that is not a world picture at this size is ignored."""
        seed = seed_from_name(path)
        if seed is None:
            return
        try:
            with Image.open(path) as image:
                if image.size == (self.config.width, self.config.height):
                    with self._lock:
                        self._known[seed] = np.asarray(image.convert("RGB"))
        except (OSError, ValueError):
            return

    def picture(self, seed: int) -> np.ndarray:
        with self._lock:
            if seed in self._known:
                return self._known[seed]
            if seed in self._pictures:
                self._pictures.move_to_end(seed)
                return self._pictures[seed]
        picture = self._render(seed, *_start_camera(self.config), self.config.width, self.config.height)[0]
        with self._lock:
            self._pictures[seed] = picture
            while len(self._pictures) > self.keep:
                self._pictures.popitem(last=False)
        return picture

    def write(self, seed: int, folder: Path) -> Path:
        """World `seed`'s start picture as `folder/world_<seed>.png`."""
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / example_name(seed)
        Image.fromarray(self.picture(seed)).save(path)
        return path

    def recognise(self, path: str | Path | None) -> int | None:
        """The world seed of a start picture file, or None when it is not a world render at this size.

        Costs one rendered frame for a file named like a world (none when kept); nothing otherwise.
        """
        seed = seed_from_name(path)
        if seed is None:
            return None
        try:
            with Image.open(path) as image:
                if image.size != (self.config.width, self.config.height):
                    return None
                picture = np.asarray(image.convert("RGB"))
        except (OSError, ValueError):
            return None
        return seed if matches(picture, self.picture(seed)) else None


def seed_from_name(path: str | Path | None) -> int | None:
    """The world seed a file name `world_<seed>.png` carries, if it is a train or held-out seed."""
    if not path:
        return None
    match = _NAME.fullmatch(Path(str(path)).name)
    if match is None:
        return None
    seed = int(match.group(1))
    return seed if seed in HELD_OUT_SEEDS or seed in TRAIN_SEEDS else None


def matches(picture: np.ndarray, rendered: np.ndarray) -> bool:
    """Whether a loaded picture [H, W, 3] uint8 is the render `rendered` (same size, mean difference small)."""
    if picture.shape != rendered.shape:
        return False
    return float(np.abs(picture.astype(np.int16) - rendered.astype(np.int16)).mean()) < MATCH_MEAN_LEVELS


def write_examples(out: Path, seeds, config: ModelConfig, supersample: int = SUPERSAMPLE) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for seed in seeds:
        if seed not in HELD_OUT_SEEDS:
            raise ValueError(f"world seed {seed} is not held out (examples must be from "
                             f"[{HELD_OUT_SEEDS.start}, {HELD_OUT_SEEDS.stop}))")
        path = out / example_name(seed)
        Image.fromarray(start_picture(seed, config, supersample)).save(path, optimize=True)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="examples")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(EXAMPLE_SEEDS),
                        help="held-out world seeds (default: the app's examples)")
    parser.add_argument("--preset", default="embedded", choices=sorted(PRESETS))
    parser.add_argument("--supersample", type=int, default=SUPERSAMPLE)
    args = parser.parse_args(argv)
    for path in write_examples(Path(args.out), args.seeds, PRESETS[args.preset], args.supersample):
        print(path)


if __name__ == "__main__":
    main()
