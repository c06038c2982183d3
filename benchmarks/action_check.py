"""Action check: does each key read as its motion, on held-out worlds and on the app's two photo examples?

    python benchmarks/action_check.py [--model embedded] [--dtype fp32] [--blocks 4] [--keys wsadijkl]

Every key is held alone for `--blocks` blocks after a keyless block 0 (as the app starts), from:
- the start pictures of held-out worlds 1000001-1000003 (the model never trained on them), compared with the
  renderer's truth along the same camera path, block by block;
- the app's photo examples (`app.PHOTO_EXAMPLES`: `examples/forest.png`, `examples/village.png`) with its prompts: real-looking pictures the
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

from eval_world import (HELD_OUT_SEEDS, MOTION_KINDS, ROOT, Script, _following, _start_picture,  # noqa: E402
                        block_pairs, ground_truth, held_keys, key_path, load_model, make_world, roll_out)
from bench_render import cpu_kind  # noqa: E402
from lingbot_core.process.precision import DTYPE_CHOICES  # noqa: E402
from lingbot_core.world.metrics import KEY_MOTION, motion_for_key, video_motion  # noqa: E402

sys.path.insert(0, str(ROOT))
from app import EXAMPLES, PHOTO_EXAMPLES  # noqa: E402  (the photos and prompts the page offers)

WORLDS = HELD_OUT_SEEDS[1:4]
READS_AS = 0.5


def held(key: str, blocks: int) -> Script:
    """`key` held alone for `blocks` blocks after a keyless block 0, every block compared."""
    return Script(key, ("",) + (key,) * blocks, blocks + 1)


def block_motion(config, frames: torch.Tensor, key: str, blocks: int) -> list[float]:
    """The key's motion summed over each held block's frame pairs (eval_world's `block_pairs`)."""
    motion = motion_for_key(video_motion(frames), key)
    return [float(motion[block_pairs(config, block)].sum()) for block in range(1, blocks + 1)]


def judge(generated: list[float], reference: list[float]) -> tuple[int, int, float]:
    """(blocks with the reference's sign, blocks measured, median |generated| / |reference|), by eval_world's
    `_following`: blocks whose reference moves under MIN_TRUE_MOTION_PX (a pitch at its limit) are not
    measured."""
    agree, measured, _, ratios = _following([("", g, r) for g, r in zip(generated, reference)])
    return agree, measured, statistics.median(ratios[""]) if ratios[""] else float("nan")


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
        script = held(key, args.blocks)
        path = key_path(held_keys(script.keys_per_block, config.transformer.num_frames_per_block), config)
        generated, truths = [], []
        for seed, world in worlds:
            truths.append(block_motion(config, ground_truth(world, path, config, frames_needed), key, args.blocks))
            generated.append(block_motion(config, roll_out(pipe, starts[seed], script, set()).frames, key,
                                          args.blocks))
        text, passed = cell(*judge(sum(generated, []), sum(truths, [])))
        passes["held-out worlds"] += passed
        cells = [text]
        # Per block, the median of the worlds' true motion: what the key gives a world of this size.
        reference = [statistics.median(t[b] for t in truths) for b in range(args.blocks)]
        for name, prompt in PHOTO_EXAMPLES:
            frames = roll_out(pipe, EXAMPLES / name, script, set(), prompt).frames
            text, passed = cell(*judge(block_motion(config, frames, key, args.blocks), reference))
            passes[name] += passed
            cells.append(text)
        rows.append((key, MOTION_KINDS[KEY_MOTION[key][0]], cells))
        print(f"  {key}: {time.perf_counter() - began:.0f} s", file=sys.stderr, flush=True)
    print(f"CPU: {cpu_kind()}; model {args.model}, {args.dtype}; each key held {args.blocks} blocks after a "
          f"keyless block 0; cells: blocks with the right sign / measured, median motion against the truth "
          f"(worlds {WORLDS.start}..{WORLDS.stop - 1}) or the worlds' median truth (photos); ok at >= {READS_AS}")
    print(f"| key | motion | held-out worlds | {' | '.join(name for name, _ in PHOTO_EXAMPLES)} |")
    print("|---|---|---|" + "---|" * len(PHOTO_EXAMPLES))
    for key, kind, cells in rows:
        print(f"| {key.upper()} | {kind} | {' | '.join(cells)} |")
    names = ("held-out worlds", *(name for name, _ in PHOTO_EXAMPLES))
    summary = ", ".join(f"{name} {passes[name]}/{len(args.keys)}" for name in names)
    print(f"keys that read as their motion: {summary}; {time.perf_counter() - began:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
