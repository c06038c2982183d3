"""What every training run folder shares: an atomic checkpoint write and a log trimmed back to it on resume."""

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
