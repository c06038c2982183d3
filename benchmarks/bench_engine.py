"""Long-rollout and multi-session figures of the serving engine (prints them; not a test).

    python benchmarks/bench_engine.py [--blocks 2000] [--sessions 4] [--concurrent-blocks 25]
                                      [--model embedded] [--dtype auto] [--threads N]

1. One session for --blocks blocks through the engine's worker thread, a consumer taking every block:
   median block latency around block 10, around block 100, around the last block and in each tenth of
   the run (flat if nothing grows with the rollout; blocks before the condition encoder's fixed point
   also pay for encoding, so the condition stage is printed beside each), peak RSS at block 100 vs at
   the end, and KV pool pages in use once the window has filled (constant). The consumer keeps only each block's timings, not its
   frames, so the process's RSS is the engine's alone.
2. --sessions sessions at once, each consumed by its own thread for --concurrent-blocks blocks: aggregate
   generated FPS vs the single session, and the spread of per-session median block times (round-robin
   fairness: one worker, so each session gets about 1/N of the single-session rate).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lingbot_core.blocks.pipeline import load_pipeline  # noqa: E402
from lingbot_core.process.precision import AUTO, DTYPE_CHOICES  # noqa: E402
from lingbot_core.boundary.requests import parse_start  # noqa: E402
from lingbot_core.serving.contract import Block, EngineConfig
from lingbot_core.serving.engine import Engine, NewWorld  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
IMAGE = ROOT / "examples" / "forest.png"
KEYS = (["w"], ["w", "l"], ["w"], ["j"], ["i"], ["k"], ["a"], [])  # varied held keys, one change per block


def _proc_status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def peak_rss_bytes() -> int:
    """VmHWM: the process's peak resident set so far."""
    return _proc_status_bytes("VmHWM")


def rss_bytes() -> int:
    return _proc_status_bytes("VmRSS")


@dataclass(frozen=True)
class Timing:
    """What the benchmark keeps of a block: its figures, not its frames (which would grow the RSS)."""

    block_index: int
    block_ms: float
    condition_ms: float


def _consume(engine: Engine, session_id: str, blocks: int, on_block) -> list[Timing]:
    """Take `blocks` blocks, posting one held-key change per block; returns each block's timings."""
    timings = []
    for index in range(blocks):
        engine.post_event(session_id, {"event_id": index, "keys": KEYS[index % len(KEYS)]})
        message = engine.next_message(session_id, timeout=3600)
        while isinstance(message, NewWorld):  # the world's header comes first: the figures are in the blocks
            message = engine.next_message(session_id, timeout=3600)
        if not isinstance(message, Block):
            raise RuntimeError(f"session {session_id}: {message}")
        timings.append(Timing(message.block_index, message.block_ms, message.stage_ms.get("condition", 0.0)))
        on_block(index, message)
        del message  # its pixels go here, as they would once a viewer has shown them
    return timings


def _around(timings: list[Timing], center: int, field: str, half: int = 5) -> float:
    """Median of `field` over the blocks within `half` of block index `center` (clamped to the run)."""
    lo = max(0, min(center - half, len(timings) - 1))
    hi = max(lo + 1, min(center + half + 1, len(timings)))
    return statistics.median(getattr(t, field) for t in timings[lo:hi])


def long_rollout(loader, args) -> tuple[float, object]:
    """Returns the generated FPS over the first --concurrent-blocks blocks (to compare like with like) and
    the pipeline, which the engine loads on its model thread (the only thread that runs kernels)."""
    engine = Engine(loader, EngineConfig(max_sessions=1, idle_ttl_s=3600))
    pipe = engine.pipeline
    print(f"{pipe.config.name} on {pipe.device}, {pipe.dtype}, {torch.get_num_threads()} threads")
    t = pipe.config.transformer
    fill = -(-(t.sliding_window_num_frames - t.num_frames_per_block) // t.num_frames_per_block)  # blocks to fill
    checkpoint = min(100, args.blocks // 2)
    pages, arrivals, rss_at_checkpoint = [], [], [0]

    def on_block(index, message):
        arrivals.append(time.perf_counter())
        pages.append(engine.stats()["pages_in_use"])
        if index + 1 == checkpoint:
            rss_at_checkpoint[0] = peak_rss_bytes()
        if (index + 1) % max(1, args.blocks // 20) == 0:
            print(f"  block {index + 1}/{args.blocks}: {message.block_ms:.0f} ms, {pages[-1]} pages in use, "
                  f"RSS {rss_bytes() / 2**20:.0f} MiB (peak {peak_rss_bytes() / 2**20:.0f} MiB)",
                  file=sys.stderr, flush=True)

    try:
        started = time.perf_counter()  # admission included, as in the concurrent run
        system_cpu = resource.getrusage(resource.RUSAGE_SELF).ru_stime
        session_id = engine.admit(parse_start(IMAGE, "a forest path in spring", 0, engine.pipeline.config)).session_id
        timings = _consume(engine, session_id, args.blocks, on_block)
        elapsed = time.perf_counter() - started
        system_cpu = resource.getrusage(resource.RUSAGE_SELF).ru_stime - system_cpu
        stats = engine.stats()
    finally:
        engine.shutdown()
    n = len(timings)
    after_fill = pages[fill:] or pages[-1:]
    frames = pipe.config.pixel_frames_per_block
    early = min(args.concurrent_blocks, n)
    early_fps = early * frames / (arrivals[early - 1] - started)
    # After the fixed point the condition stage only builds the mask: well under a millisecond here.
    fixed_at = next((t.block_index for t in timings if t.condition_ms < 5.0), None)
    print(f"one session, {n} blocks ({elapsed:.0f} s, {n * frames / elapsed:.2f} FPS generated; "
          f"{early_fps:.2f} FPS over the first {early} blocks):")
    for label, center in (("block 10", 10), (f"block {checkpoint}", checkpoint), (f"block {n}", n - 6)):
        print(f"  median block latency around {label}: {_around(timings, center, 'block_ms'):.0f} ms "
              f"(condition encode {_around(timings, center, 'condition_ms'):.0f} ms of it)")
    tenths = [timings[n * i // 10:n * (i + 1) // 10] for i in range(10)]
    print("  median block latency in each tenth of the run (ms): "
          + ", ".join(f"{statistics.median(t.block_ms for t in part):.0f}" for part in tenths if part))
    # Kernel time: page faults and the futex waits of OpenMP threads that stopped spinning (see engine.py).
    print(f"  system CPU time: {1000 * system_cpu / n:.0f} ms a block")
    print(f"  condition stage under 5 ms (the encoder's fixed point) from block: "
          f"{'never' if fixed_at is None else fixed_at}")
    print(f"  peak RSS at block {checkpoint}: {rss_at_checkpoint[0] / 2**20:.0f} MiB; "
          f"at the end: {peak_rss_bytes() / 2**20:.0f} MiB")
    print(f"  KV pool pages in use after the window filled (block {fill}+): min {min(after_fill)}, "
          f"max {max(after_fill)} of {stats['pages_total']} (one page = one latent frame of K/V)")
    print(f"  accounted bytes at the end: {stats['accounted_bytes'] / 2**20:.1f} MiB (with any block in flight); "
          f"admission charge {stats['session_bytes'] / 2**20:.1f} MiB per session + "
          f"{stats['block_reserve'] / 2**20:.1f} MiB for the running block")
    return early_fps, pipe


def concurrent(pipe, args, single_fps: float) -> None:
    engine = Engine(pipe, EngineConfig(max_sessions=args.sessions, idle_ttl_s=3600))
    try:
        started = time.perf_counter()
        ids = [engine.admit(parse_start(IMAGE, f"a forest path, world {i}", i, engine.pipeline.config)).session_id
               for i in range(args.sessions)]
        results: dict[str, list[Timing]] = {}
        finished: dict[str, float] = {}
        errors: list[BaseException] = []

        def consumer(session_id):
            try:
                results[session_id] = _consume(engine, session_id, args.concurrent_blocks, lambda *_: None)
                finished[session_id] = time.perf_counter() - started
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=consumer, args=(sid,)) for sid in ids]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.perf_counter() - started
    finally:
        engine.shutdown()
    if errors:
        raise errors[0]
    blocks = sum(len(m) for m in results.values())
    fps = blocks * pipe.config.pixel_frames_per_block / elapsed
    medians = [statistics.median(m.block_ms for m in results[sid]) for sid in ids]
    print(f"{args.sessions} sessions at once, {args.concurrent_blocks} blocks each ({elapsed:.0f} s):")
    print(f"  aggregate {fps:.2f} FPS generated vs {single_fps:.2f} for one session over as many blocks "
          f"({fps / single_fps:.2f}x); per session {fps / args.sessions:.2f} FPS")
    print(f"  per-session median block time: min {min(medians):.0f} ms, max {max(medians):.0f} ms "
          f"(spread {100 * (max(medians) - min(medians)) / statistics.median(medians):.1f}%); "
          f"time to its last block: min {min(finished.values()):.1f} s, max {max(finished.values()):.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--blocks", type=int, default=2000)
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--concurrent-blocks", type=int, default=25)
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default=AUTO)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = parser.parse_args()
    if args.blocks < 2 or args.concurrent_blocks < 1 or args.sessions < 1:
        parser.error("--blocks must be >= 2, --concurrent-blocks and --sessions >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    single_fps, pipe = long_rollout(lambda: load_pipeline(args.model, dtype=args.dtype, device=args.device),
                                    args)
    concurrent(pipe, args, single_fps)


if __name__ == "__main__":
    main()
