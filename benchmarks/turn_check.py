"""Turn check: J, then L, held alone for 4 blocks from the start picture of held-out worlds 1000001-1000003
(the logic of tests/test_world_metrics.py's shipped-model turn test, on three worlds).

    python benchmarks/turn_check.py [--model embedded] [--dtype fp32]

Prints how many blocks' generated horizontal motion has the true sign, and the median |generated| / |true|
of that motion (eval_world's records and estimator, summed over each block's consecutive frame pairs).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from eval_world import (HELD_OUT_SEEDS, MIN_TRUE_MOTION_PX, Records, Script, _following, _start_picture,  # noqa: E402
                        ground_truth, held_keys, key_path, load_model, make_world, roll_out)
from bench_render import cpu_kind  # noqa: E402
from lingbot_core.process.precision import DTYPE_CHOICES  # noqa: E402

BLOCKS = 4
WORLDS = HELD_OUT_SEEDS[1:4]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="embedded", help="embedded, or a diffusers-layout folder")
    parser.add_argument("--dtype", default="fp32", choices=DTYPE_CHOICES)
    args = parser.parse_args(argv)
    pipe = load_model(args.model, args.dtype)
    config = pipe.config
    records = Records()
    for seed in WORLDS:
        world = make_world(seed)
        image = _start_picture(world, config)
        for key in "jl":
            script = Script(key, ("",) + (key,) * BLOCKS, BLOCKS + 1)
            path = key_path(held_keys(script.keys_per_block, config.transformer.num_frames_per_block), config)
            truth = ground_truth(world, path, config, slice(0, config.pixel_frames_for_blocks(BLOCKS + 1)))
            records.add_motion(config, "model", script, roll_out(pipe, image, script, set()).frames, truth)
    agree, measured, skipped, ratios = _following(records.following("model"))
    print(f"CPU: {cpu_kind()}; model {args.model}, {args.dtype}; worlds {WORLDS.start}..{WORLDS.stop - 1} (held out)")
    print(f"turn check: {agree}/{measured} blocks with the true sign ({skipped} with true motion under "
          f"{MIN_TRUE_MOTION_PX} px left out), median |g|/|t| {statistics.median(ratios['shift_x']):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
