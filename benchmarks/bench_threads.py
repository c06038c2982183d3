"""Why the engine runs every kernel on one thread: a rollout's cost by which threads have run kernels.

    python benchmarks/bench_threads.py [--blocks 26] [--rounds 2] [--model embedded] [--dtype auto]

Each case runs in a fresh process (libgomp's thread teams live as long as the thread that made them):
- main:          load and roll out on the main thread (one OpenMP team);
- second thread: load on the main thread, roll out on another (the main thread's team stays parked, so
                 there are more team threads than cores on a 2-core machine and libgomp stops spinning);
- one thread:    load on a thread that exits, roll out on another (one team again; what the engine does).
Prints, per case and round, the median block time and the system CPU time per block after the first
--warmup blocks (the window filling and the condition encoder's fixed point are left out).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lingbot_core.blocks.pipeline import load_pipeline  # noqa: E402
from lingbot_core.process.precision import AUTO, DTYPE_CHOICES  # noqa: E402
from lingbot_core.boundary.requests import BlockControl  # noqa: E402

CASES = {"main": ("main", "main"), "second thread": ("main", "thread"), "one thread": ("thread", "thread")}


def _on(where: str, work):
    if where == "main":
        return work()
    box = {}
    thread = threading.Thread(target=lambda: box.update(value=work()))
    thread.start()
    thread.join()
    return box["value"]


def run_case(case: str, args) -> None:
    load_on, run_on = CASES[case]
    pipe = _on(load_on, lambda: load_pipeline(args.model, dtype=args.dtype))
    controls = [BlockControl(actions=(frozenset("w"),) * pipe.config.transformer.num_frames_per_block)] * args.blocks

    def rollout():
        block_ms, system_ms = [], []
        before, started = resource.getrusage(resource.RUSAGE_SELF).ru_stime, time.perf_counter()
        for _ in pipe.rollout(ROOT / "examples" / "forest.png", "a forest path in spring", 0, controls):
            now, system = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_stime
            block_ms.append(1000 * (now - started))
            system_ms.append(1000 * (system - before))
            started, before = now, system
        return block_ms[args.warmup:], system_ms[args.warmup:]

    block_ms, system_ms = _on(run_on, rollout)
    print(f"{case:14} {statistics.median(block_ms):9.0f} {statistics.median(system_ms):12.1f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default=AUTO)
    parser.add_argument("--blocks", type=int, default=26)
    parser.add_argument("--warmup", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--case", choices=sorted(CASES), help=argparse.SUPPRESS)  # one case, in this process
    args = parser.parse_args()
    if args.blocks <= args.warmup:
        parser.error("--blocks must exceed --warmup")
    if args.case:
        run_case(args.case, args)
        return
    print(f"{args.model}, {args.dtype}, {torch.get_num_threads()} threads, median of blocks "
          f"{args.warmup}-{args.blocks - 1}, {args.rounds} round(s)")
    print(f"{'case':14} {'block ms':>9} {'system ms':>12}")
    passed = [f"--{name}={getattr(args, name)}" for name in ("model", "dtype", "blocks", "warmup")]
    for _ in range(args.rounds):
        for case in CASES:  # alternated, so a change in the shared host's speed hits every case alike
            subprocess.run([sys.executable, __file__, "--case", case, *passed], check=True)


if __name__ == "__main__":
    main()
