"""Per-block latency of the embedded preset on this machine, eager vs compiled.

    python benchmarks/bench_block.py [--blocks 12] [--warmup 6] [--dtype bf16] [--no-compile] [--threads N]

Prints the median ms per block split into condition encode, the four denoising forwards, the t=0
commit forward and the streaming decode, and the generated frames per second against 16 FPS playback.
Warm-up blocks are excluded: they include the window filling up (and, compiled, the first compiles).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lingbot_core.pipeline import load_pipeline  # noqa: E402
from lingbot_core.rollout import BlockControl  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def measure(compile: bool, args) -> dict[str, float]:
    started = time.perf_counter()
    pipe = load_pipeline(args.model, dtype=DTYPES[args.dtype], compile=compile)
    load_s = time.perf_counter() - started
    frames_per_block = pipe.config.transformer.num_frames_per_block
    controls = [BlockControl(actions=(frozenset("w"),) * frames_per_block)] * (args.warmup + args.blocks)
    rows, first_block_ms = [], None
    started = time.perf_counter()
    for output in pipe.rollout(Path(__file__).resolve().parents[1] / "examples" / "forest.png",
                               "a forest path in spring", 0, controls):
        now = time.perf_counter()
        block_ms = 1000 * (now - started)
        started = now
        if first_block_ms is None:
            first_block_ms = block_ms
        if output.block_index >= args.warmup:
            rows.append(dict(output.stage_ms, total=block_ms))
    result = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
    result["first_block"] = first_block_ms
    result["load_s"] = load_s
    result["fps"] = pipe.config.pixel_frames_per_block / (result["total"] / 1000)
    result["frames_per_block"] = pipe.config.pixel_frames_per_block
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=6)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--no-compile", action="store_true", help="eager only")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.model}, {args.dtype}, "
          f"median of {args.blocks} blocks after {args.warmup} warm-up blocks")
    modes = [False] if args.no_compile else [False, True]
    print(f"{'mode':9} {'condition':>9} {'denoise x4':>10} {'commit':>7} {'decode':>7} {'block ms':>9} "
          f"{'FPS':>6} {'first ms':>9}")
    for compile in modes:
        r = measure(compile, args)
        print(f"{'compiled' if compile else 'eager':9} {r['condition']:9.1f} {r['denoise']:10.1f} {r['commit']:7.1f} "
              f"{r['decode']:7.1f} {r['total']:9.1f} {r['fps']:6.1f} {r['first_block']:9.0f}")
    print(f"target: >= 16 FPS, i.e. one {r['frames_per_block']}-frame block in <= "
          f"{1000 * r['frames_per_block'] / 16:.0f} ms")


if __name__ == "__main__":
    main()
