"""Frames per second of the world renderer at candidate training resolutions, on this machine's CPU.

    python benchmarks/bench_render.py [--sizes 96x160 128x224] [--supersample 1 2] [--threads 1 2]
                                      [--runs 5] [--blocks 2] [--seed 1000000]

Each run renders one clip of a mixed key walk (W, W+L, J, ...; N blocks give 12N - 3 frames) through
the embedded preset's intrinsics convention, scaled to the size. Prints the median FPS over the runs
(the first, warm-up run excluded) with the range, per size, supersampling and thread count, the
CPU kind first (model name and whether it has AVX2 / AVX-512 BF16 / AMX) and the load average last.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lingbot_core.config import PRESETS  # noqa: E402
from lingbot_core.world import HELD_OUT_SEEDS, held_keys, key_path, make_world, render  # noqa: E402

WALK = ["w", "wl", "w", "j", "wd", "l"]


def cpu_kind() -> str:
    name, flags = platform.processor() or "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and name in ("unknown CPU", "x86_64", ""):
                name = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    features = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{name}; {', '.join(features) or 'no AVX2'}; torch {torch.__version__}, {torch.get_num_threads()} threads available"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["96x160", "128x224"], help="HEIGHTxWIDTH")
    parser.add_argument("--supersample", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--seed", type=int, default=HELD_OUT_SEEDS.start)
    args = parser.parse_args()

    print(f"CPU: {cpu_kind()}")
    base = PRESETS["embedded"]
    world = make_world(args.seed)
    fpb = base.transformer.num_frames_per_block
    keys = held_keys([""] + [WALK[b % len(WALK)] for b in range(args.blocks - 1)], fpb)
    print(f"{'size':>8} {'ss':>3} {'threads':>7} {'frames':>6} {'median FPS':>10} {'range':>13}")
    for size in args.sizes:
        height, width = (int(v) for v in size.lower().split("x"))
        config = dataclasses.replace(base, height=height, width=width)
        path = key_path(keys, config)
        for supersample in args.supersample:
            for threads in args.threads:
                torch.set_num_threads(threads)
                rates = []
                for run in range(args.runs + 1):
                    started = time.perf_counter()
                    render(world, path.pixel_poses, path.intrinsics, width, height, supersample)
                    if run:  # run 0 warms up allocators and caches
                        rates.append(len(path.pixel_poses) / (time.perf_counter() - started))
                print(f"{size:>8} {supersample:>3} {threads:>7} {len(path.pixel_poses):>6} "
                      f"{statistics.median(rates):>10.1f} {min(rates):>6.1f}-{max(rates):<6.1f}", flush=True)
    # The machine may be shared: with other busy processes, two threads per process fall far behind
    # one (libgomp's team waits for its slowest thread); read the figures with the load beside them.
    print(f"load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
