"""What the start-image checks cost: refusing image bombs, and fitting the largest image accepted.

    python3 benchmarks/bench_image_checks.py [--repeats 5]

Each case runs in a fresh process (so its peak RSS is its own) and prints the median wall time of
`fit_image(load_image(path), 128, 224)` (the work a request thread does before the model thread sees
an image) and the process's peak RSS above what it held before the first call. Cases: the two bombs
of issue 10 (a 60000x1 PNG and a 12000x12000 1-bit PNG, both refused from the header), the largest
accepted shapes (40 megapixels at 1:1 and at 8:1), and the examples' 448x256 picture.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CASES = {  # name -> (mode, width, height); None: examples/forest.png
    "60000x1 RGB PNG (bomb)": ("RGB", 60000, 1),
    "12000x12000 1-bit PNG (bomb)": ("1", 12000, 12000),
    "6324x6324 RGB PNG (40 MP, accepted)": ("RGB", 6324, 6324),
    "17888x2236 RGB PNG (40 MP at 8:1, accepted)": ("RGB", 17888, 2236),
    "examples/forest.png (448x256)": None,
}

CHILD = """
import json, resource, statistics, sys, time
sys.path.insert(0, sys.argv[1])
from lingbot_core.boundary.image import ImageError, fit_image, load_image
path, repeats = sys.argv[2], int(sys.argv[3])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
times, outcome = [], None
for _ in range(repeats):
    started = time.perf_counter()
    try:
        fit_image(load_image(path), 128, 224)
        outcome = "fitted"
    except ImageError as exc:
        outcome = "refused: " + str(exc)
    times.append(time.perf_counter() - started)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"ms": 1000 * statistics.median(times), "rss_mib": (peak - before) / 1024, "outcome": outcome}))
"""


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from PIL import Image

    print(f"{cpu_name()}, {os.cpu_count()} logical CPUs; median of {args.repeats} calls, fresh process per case")
    with tempfile.TemporaryDirectory() as tmp:
        for name, spec in CASES.items():
            if spec is None:
                path = ROOT / "examples" / "forest.png"
            else:
                mode, width, height = spec
                path = Path(tmp) / "case.png"
                Image.new(mode, (width, height), 1 if mode == "1" else (90, 140, 60)).save(path)
            result = subprocess.run([sys.executable, "-c", CHILD, str(ROOT), str(path), str(args.repeats)],
                                    capture_output=True, text=True, check=True)
            figures = json.loads(result.stdout)
            print(f"{name:45s} {path.stat().st_size:>10d} bytes  {figures['ms']:8.1f} ms  "
                  f"peak RSS +{figures['rss_mib']:6.1f} MiB  {figures['outcome'][:70]}")


if __name__ == "__main__":
    main()
