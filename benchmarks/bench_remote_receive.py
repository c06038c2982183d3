"""What the remote backend costs this process per block: raw 832x480 chunks from an in-process upstream-like
server (tests/fake_upstream.py, no pacing) through SglangEngine into Blocks, on localhost.

    python benchmarks/bench_remote_receive.py [--blocks 30] [--width 832] [--height 480]

Prints the median and p90 time between consecutive Blocks reaching the consumer and the throughput, after
the first 3 blocks. The fake server generates its pixels too (seeded random, on the same cores), so these are
upper bounds on the backend's own cost; a real server's chunk takes ~670 ms (4xH200) to 3 s (1xH200).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import dataclasses  # noqa: E402

import numpy as np  # noqa: E402

from fake_upstream import FakeUpstream  # noqa: E402
from lingbot_core.config import LINGBOT_WORLD_V2_14B  # noqa: E402
from lingbot_core.protocols.sglang.backend import SglangEngine  # noqa: E402
from lingbot_core.boundary.requests import parse_start  # noqa: E402
from lingbot_core.serving.contract import Block  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=30)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--height", type=int, default=480)
    args = parser.parse_args()
    config = dataclasses.replace(LINGBOT_WORLD_V2_14B, width=args.width, height=args.height)
    server = FakeUpstream(width=args.width, height=args.height, interval_s=0.0)
    engine = SglangEngine([server.url], config)
    image = np.zeros((args.height, args.width, 3), dtype=np.uint8)
    try:
        sid = engine.admit(parse_start(image, "a benchmark", 0, config)).session_id
        arrivals, nbytes = [], 0
        while len(arrivals) < args.blocks:
            message = engine.next_message(sid, timeout=60)
            if isinstance(message, Block):
                arrivals.append(time.perf_counter())
                nbytes += message.pixels.nbytes
        gaps = np.diff(arrivals[3:]) * 1000.0
        chunk_mb = args.width * args.height * 3 * 12 / 1e6
        print(f"{args.width}x{args.height} raw, {len(gaps)} block gaps after 3: median {statistics.median(gaps):.1f} ms, "
              f"p90 {np.percentile(gaps, 90):.1f} ms, {chunk_mb / (statistics.median(gaps) / 1000):.0f} MB/s "
              f"({chunk_mb:.1f} MB a 12-frame chunk)")
    finally:
        engine.shutdown()
        server.stop()


if __name__ == "__main__":
    main()
