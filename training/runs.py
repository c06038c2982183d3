"""What every training run shares: an atomic checkpoint write, a log trimmed back to it on resume, and the
learning-rate schedule."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch


def save_atomically(state: dict, path: Path) -> None:
    """Write whole, then rename: an interrupted save leaves the previous file whole."""
    partial = path.with_name(path.name + ".tmp")
    torch.save(state, partial)
    os.replace(partial, path)


def trim_log(path: Path, last_step: int) -> None:
    """Drop log lines past the checkpoint (a run stopped after logging them, before saving), so a resumed
    run's log has each step once."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= last_step]
    partial = path.with_name(path.name + ".tmp")
    partial.write_text("".join(line + "\n" for line in kept))
    os.replace(partial, path)


def decayed_rate(lr: float, step: int, steps: int, decay_from: int, final: float) -> float:
    """Constant, then a linear fall from step `decay_from` to lr * `final` at the run's last step (`steps`);
    decay_from < 0: constant. A long run at a high rate learns fast but its weights jitter; the fall settles
    them. The fall follows `steps`, so a resume with more steps stretches what is left of it."""
    if decay_from < 0 or step < decay_from or steps <= decay_from:
        return lr
    done = min(1.0, (step - decay_from) / (steps - decay_from))
    return lr * (1.0 - (1.0 - final) * done)
