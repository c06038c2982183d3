"""Start-up that talks: each stage (load, precision probe, memory probe, compile, ready) printed with its time.

A loading model can take from a second to minutes depending on the CPU, the precision and the checkpoint;
a silent terminal looks hung. The app and the offline command create one `StartupLog` and hand it to the
code that runs each stage; a library caller that passes none prints nothing.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from typing import Callable, Iterator, TextIO


def process_age_s() -> float:
    """Seconds since this process started (Linux: from /proc), so the log counts the imports too; 0 elsewhere."""
    try:
        ticks = int(open("/proc/self/stat").read().rpartition(")")[2].split()[19])  # field 22: start time
        uptime = float(open("/proc/uptime").read().split()[0])
        return max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


class StartupLog:
    """Stamps are seconds since the process started (importing torch and Gradio is part of start-up)."""

    def __init__(self, out: TextIO | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        self.out = out if out is not None else sys.stderr
        self.clock = clock
        self.started = clock() - process_age_s()

    def note(self, text: str) -> None:
        """One line stamped with the seconds since start-up began."""
        print(f"[{self.clock() - self.started:6.1f} s] {text}", file=self.out, flush=True)

    @contextmanager
    def stage(self, name: str) -> Iterator[list[str]]:
        """Time a stage; what the block appends to the yielded list is printed after the stage's name."""
        details: list[str] = []
        began = self.clock()
        yield details
        suffix = f": {'; '.join(details)}" if details else ""
        self.note(f"{name} took {self.clock() - began:.1f} s{suffix}")


def maybe_stage(log: StartupLog | None, name: str):
    """`log.stage(name)`, or a silent stand-in when there is no log."""
    if log is not None:
        return log.stage(name)
    return _silent()


@contextmanager
def _silent() -> Iterator[list[str]]:
    yield []
