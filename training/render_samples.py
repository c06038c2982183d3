"""Render sample clips of held-out worlds with keys held, to look at: PNG contact sheets and MP4s.

    python -m training.render_samples [--out out/world_samples] [--seeds 1000000 1000001 1000002]
                                      [--blocks 4] [--supersample 2] [--width W --height H]

Each clip starts at the session's start pose with an empty block 0 (in the app keys act from the
next block on), then holds one key set per block: W, J, L and a mixed walk. Frames are the pixel
frames the decoder would produce (12N - 3 for N blocks), at the embedded preset's resolution and
intrinsics unless given. For every (seed, clip) it writes `<seed>_<clip>.mp4` and a contact sheet
`<seed>_<clip>.png` of every fourth frame (each latent frame's pose) at 2x, nearest-neighbour.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from lingbot_core.config import PRESETS
from lingbot_core.boundary.video import H264Writer
from lingbot_core.world import HELD_OUT_SEEDS, held_keys, key_path, make_world, render, to_uint8

CLIPS = {
    "w": ["w"],
    "j": ["j"],
    "l": ["l"],
    "mixed": ["w", "wl", "w", "j", "a", "wd", "i", "k"],
}


def contact_sheet(frames: np.ndarray, columns: int, scale: int) -> Image.Image:
    """[T, H, W, 3] uint8 -> one image, `columns` frames a row, each enlarged `scale` times."""
    count, height, width, _ = frames.shape
    rows = -(-count // columns)
    sheet = np.full((rows * (height + 2), columns * (width + 2), 3), 255, dtype=np.uint8)
    for index, frame in enumerate(frames):
        r, c = divmod(index, columns)
        sheet[r * (height + 2):r * (height + 2) + height, c * (width + 2):c * (width + 2) + width] = frame
    image = Image.fromarray(sheet)
    return image.resize((image.width * scale, image.height * scale), Image.NEAREST)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="out/world_samples")
    parser.add_argument("--seeds", type=int, nargs="+", default=[HELD_OUT_SEEDS.start + i for i in range(3)])
    parser.add_argument("--blocks", type=int, default=4, help="blocks after the empty block 0")
    parser.add_argument("--clips", nargs="+", choices=sorted(CLIPS), default=sorted(CLIPS))
    parser.add_argument("--supersample", type=int, default=2)
    parser.add_argument("--width", type=int)
    parser.add_argument("--height", type=int)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    config = PRESETS["embedded"]
    if args.width or args.height:
        config = dataclasses.replace(config, width=args.width or config.width, height=args.height or config.height)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    frames_per_block = config.transformer.num_frames_per_block
    for seed in args.seeds:
        world = make_world(seed)
        for name in args.clips:
            keys = [""] + [CLIPS[name][b % len(CLIPS[name])] for b in range(args.blocks)]
            path = key_path(held_keys(keys, frames_per_block), config)
            started = time.perf_counter()
            rgb = render(world, path.pixel_poses, path.intrinsics, config.width, config.height, args.supersample)
            seconds = time.perf_counter() - started
            frames = to_uint8(rgb)
            writer = H264Writer(out / f"{seed}_{name}.mp4", width=frames.shape[2], height=frames.shape[1],
                                fps=config.fps)
            try:
                writer.write(frames)
            finally:
                writer.close()
            contact_sheet(frames[::config.vae_temporal_factor], columns=5, scale=2).save(out / f"{seed}_{name}.png")
            print(f"seed {seed} {name:>5}: {len(frames)} frames {config.width}x{config.height} in {seconds:.1f} s "
                  f"({len(frames) / seconds:.1f} FPS) -> {out}/{seed}_{name}.mp4, .png", flush=True)


if __name__ == "__main__":
    main()
