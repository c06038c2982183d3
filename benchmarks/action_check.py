"""Action check: does each key read as its motion, on held-out worlds and on the app's two photo examples?

    python benchmarks/action_check.py [--model embedded] [--dtype fp32] [--blocks 4] [--keys wsadijkl]

Every key is held alone for `--blocks` blocks after a keyless block 0 (as the app starts), from:
- the start pictures of held-out worlds 1000001-1000003 (the model never trained on them), compared with the
  renderer's truth along the same camera path, block by block;
- `examples/forest.png` and `examples/village.png` with the app's prompts for them: real-looking pictures the
  model has never seen anything like (it trained on the procedural world only). They have no truth, so each
  block's motion is compared with the truth's median motion for the same key and block over the held-out
  worlds: the motion the key gives a world of this size. A photo's depth differs from the procedural world's
  (a near tree expands faster than an open field), so that reference says "about this much", not "exactly".

Motion is eval_world's: the key's component (walk: expansion of the halves; step: lateral shift of the lower
half; turn: x; pitch: y) summed over the block's consecutive frame pairs. A picture passes a key when the
generated motion has the key's sign in every measured block and its median ratio to the truth (worlds) or
the reference (photos) is at least READS_AS: at half the motion a hold visibly moves the view the right
way; below it the picture mostly stands still. Prints one table (one row per key) and the CPU kind. It sets
no target of its own; eval_world.py is the evaluation, this is what a person pressing keys on the examples
sees.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from eval_world import (HELD_OUT_SEEDS, MIN_TRUE_MOTION_PX, PROMPT, ROOT, _start_picture,  # noqa: E402
                        block_frames, ground_truth, held_keys, key_path, load_model, make_world)
from bench_render import cpu_kind  # noqa: E402
from lingbot_core.boundary.requests import BlockControl  # noqa: E402
from lingbot_core.process.precision import DTYPE_CHOICES  # noqa: E402
from lingbot_core.world.metrics import KEY_MOTION, motion_for_key, video_motion  # noqa: E402

WORLDS = HELD_OUT_SEEDS[1:4]
# The app's photo examples and their prompts (app.py PHOTO_EXAMPLES).
PHOTOS = (("forest", ROOT / "examples" / "forest.png", "a forest path in spring, sunlight"),
          ("village", ROOT / "examples" / "village.png", "a quiet village street at dusk"))
READS_AS = 0.5
KIND_NAMES = {"shift_x": "turn", "shift_y": "pitch", "expansion": "walk", "lateral": "step"}


def keys_per_block(key: str, blocks: int) -> tuple[str, ...]:
    return ("",) + (key,) * blocks


def roll_out(pipe, image, prompt: str, keys: tuple[str, ...]) -> torch.Tensor:
    """The decoded frames [T, 3, H, W] in [0, 1] of a rollout holding `keys` (one entry a block)."""
    fpb = pipe.config.transformer.num_frames_per_block
    actions = held_keys(keys, fpb)
    controls = [BlockControl(actions=actions[b * fpb:(b + 1) * fpb]) for b in range(len(keys))]
    frames = [((out.frames[0].float().permute(1, 0, 2, 3) + 1.0) / 2.0).clamp(0, 1)
              for out in pipe.rollout(image, prompt, 0, controls)]
    return torch.cat(frames)


def block_motion(config, frames: torch.Tensor, key: str, blocks: int) -> list[float]:
    """The key's motion summed over each held block's frame pairs (from the previous block's last frame on)."""
    motion = motion_for_key(video_motion(frames), key)  # pair t-1 -> t at index t-1
    sums = []
    for block in range(1, blocks + 1):
        part = block_frames(config, block)
        sums.append(float(motion[part.start - 1:part.stop - 1].sum()))
    return sums


def judge(generated: list[float], reference: list[float]) -> tuple[int, int, float]:
    """(blocks with the reference's sign, blocks measured, median |generated| / |reference|); blocks whose
    reference moves under MIN_TRUE_MOTION_PX (a pitch at its limit) are not measured."""
    agree, ratios = 0, []
    for g, r in zip(generated, reference):
        if abs(r) < MIN_TRUE_MOTION_PX:
            continue
        agree += int(g != 0 and math.copysign(1.0, g) == math.copysign(1.0, r))
        ratios.append(abs(g) / abs(r))
    return agree, len(ratios), statistics.median(ratios) if ratios else float("nan")


def cell(agree: int, measured: int, ratio: float) -> tuple[str, bool]:
    passed = measured > 0 and agree == measured and ratio >= READS_AS
    shown = math.floor(ratio * 100) / 100 if math.isfinite(ratio) else ratio  # 0.499 must not print as 0.50
    return f"{agree}/{measured} x{shown:.2f} {'ok' if passed else 'WEAK' if agree == measured else 'NO'}", passed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="embedded", help="embedded, or a diffusers-layout folder")
    parser.add_argument("--dtype", default="fp32", choices=DTYPE_CHOICES)
    parser.add_argument("--blocks", type=int, default=4, help="blocks each key is held (after a keyless block 0)")
    parser.add_argument("--keys", default="wsadijkl", help="the keys to hold, each alone")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.keys) - set(KEY_MOTION))
    if unknown or args.blocks < 1:
        parser.error(f"--keys takes {''.join(KEY_MOTION)} (got {''.join(unknown)}); --blocks at least 1")
    began = time.perf_counter()
    pipe = load_model(args.model, args.dtype)
    config = pipe.config
    frames_needed = slice(0, config.pixel_frames_for_blocks(args.blocks + 1))
    worlds = [(seed, make_world(seed)) for seed in WORLDS]
    starts = {seed: _start_picture(world, config) for seed, world in worlds}
    rows = []
    passes = defaultdict(int)
    for key in args.keys:
        keys = keys_per_block(key, args.blocks)
        path = key_path(held_keys(keys, config.transformer.num_frames_per_block), config)
        per_world, truths = [], []
        for seed, world in worlds:
            truth = block_motion(config, ground_truth(world, path, config, frames_needed), key, args.blocks)
            generated = block_motion(config, roll_out(pipe, starts[seed], PROMPT, keys), key, args.blocks)
            per_world.append((generated, truth))
            truths.append(truth)
        agree = sum(judge(g, t)[0] for g, t in per_world)
        measured = sum(judge(g, t)[1] for g, t in per_world)
        ratios = [abs(g) / abs(t) for gs, ts in per_world for g, t in zip(gs, ts) if abs(t) >= MIN_TRUE_MOTION_PX]
        text, passed = cell(agree, measured, statistics.median(ratios) if ratios else float("nan"))
        passes["held-out worlds"] += passed
        cells = [text]
        # Per block, the median of the worlds' true motion: what the key gives a world of this size.
        reference = [statistics.median(t[b] for t in truths) for b in range(args.blocks)]
        for name, image, prompt in PHOTOS:
            text, passed = cell(*judge(block_motion(config, roll_out(pipe, image, prompt, keys), key, args.blocks),
                                       reference))
            passes[name] += passed
            cells.append(text)
        rows.append((key, KIND_NAMES[KEY_MOTION[key][0]], cells))
        print(f"  {key}: {time.perf_counter() - began:.0f} s", file=sys.stderr, flush=True)
    print(f"CPU: {cpu_kind()}; model {args.model}, {args.dtype}; each key held {args.blocks} blocks after a "
          f"keyless block 0; cells: blocks with the right sign / measured, median motion against the truth "
          f"(worlds {WORLDS.start}..{WORLDS.stop - 1}) or the worlds' median truth (photos); ok at >= {READS_AS}")
    print(f"| key | motion | held-out worlds | {' | '.join(name for name, _, _ in PHOTOS)} |")
    print("|---|---|---|" + "---|" * len(PHOTOS))
    for key, kind, cells in rows:
        print(f"| {key.upper()} | {kind} | {' | '.join(cells)} |")
    summary = ", ".join(f"{name} {passes[name]}/{len(args.keys)}" for name in ("held-out worlds", *(p[0] for p in PHOTOS)))
    print(f"keys that read as their motion: {summary}; {time.perf_counter() - began:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
