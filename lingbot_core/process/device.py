"""The device a command runs its model on when none is named."""

from __future__ import annotations

import os
import sys


def default_device() -> str:
    """cuda when there is a GPU the engine's worker thread can keep; ZeroGPU lends one per call only."""
    import torch

    if os.environ.get("SPACES_ZERO_GPU"):
        print("ZeroGPU hardware: the live engine needs a GPU held for the whole session, so it runs on the CPU; "
              "choose dedicated GPU hardware for the real model", file=sys.stderr)
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"
