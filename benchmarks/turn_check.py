"""Turn check: J, then L, held alone for 4 blocks from the start picture of held-out worlds 1000001-1000003
(the logic of tests/test_world_metrics.py's shipped-model turn test, on three worlds).

    python benchmarks/turn_check.py [--model embedded] [--dtype fp32]

Prints how many blocks' generated horizontal motion has the true sign, and the median |generated| / |true|
of that motion (the evaluation's estimator, summed over each block's consecutive frame pairs).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from eval_world import (HELD_OUT_SEEDS, Script, _start_picture, block_frames, ground_truth, held_keys,  # noqa: E402
                        key_path, load_model, make_world, motion_for_key, roll_out, video_motion)
from bench_render import cpu_kind  # noqa: E402
from lingbot_core.precision import DTYPE_CHOICES  # noqa: E402

BLOCKS = 4
WORLDS = HELD_OUT_SEEDS[1:4]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="embedded", help="embedded, or a diffusers-layout folder")
    parser.add_argument("--dtype", default="fp32", choices=DTYPE_CHOICES)
    args = parser.parse_args(argv)
    pipe = load_model(args.model, args.dtype)
    config = pipe.config
    agree, ratios = 0, []
    for seed in WORLDS:
        world = make_world(seed)
        image = _start_picture(world, config)
        for key in "jl":
            script = Script(key, ("",) + (key,) * BLOCKS, BLOCKS + 1)
            path = key_path(held_keys(script.keys_per_block, config.transformer.num_frames_per_block), config)
            truth = ground_truth(world, path, config, config.pixel_frames_for_blocks(BLOCKS + 1))
            generated = motion_for_key(video_motion(roll_out(pipe, image, script, set()).frames), key)
            true = motion_for_key(video_motion(truth), key)
            for block in range(1, BLOCKS + 1):
                part = block_frames(config, block)
                pairs = slice(part.start - 1, part.stop - 1)
                g, t = float(generated[pairs].sum()), float(true[pairs].sum())
                agree += (g > 0) == (t > 0)
                ratios.append(abs(g) / max(abs(t), 1e-6))
    print(f"CPU: {cpu_kind()}; model {args.model}, {args.dtype}; worlds {WORLDS.start}..{WORLDS.stop - 1} (held out)")
    print(f"turn check: {agree}/{len(ratios)} blocks with the true sign, median |g|/|t| {statistics.median(ratios):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
