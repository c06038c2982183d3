"""Building the local engine from a command line's choices: the model source, the device and the precision.

Shared by the page (app.py) and the headless protocol server (lingbot_core/serve.py), so both load the
same model the same way.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from lingbot_core.config import TEST_PRESETS
from lingbot_core.blocks.pipeline import load_pipeline
from lingbot_core.process.precision import AUTO
from lingbot_core.process.startup import StartupLog
from lingbot_core.serving.contract import EngineConfig
from lingbot_core.serving.engine import Engine



def default_device() -> str:
    """cuda when there is a GPU the engine's worker thread can keep; ZeroGPU lends one per call only."""
    if os.environ.get("SPACES_ZERO_GPU"):
        print("ZeroGPU hardware: the live engine needs a GPU held for the whole session, so it runs on the CPU; "
              "choose dedicated GPU hardware for the real model", file=sys.stderr)
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def create_engine(model: str | None = None, *, device: str | None = None, dtype: str = AUTO,
                  engine_config: EngineConfig = EngineConfig(), compile: bool | None = None,
                  preset: str | None = None, log: StartupLog | None = None) -> Engine:
    """Load the model (embedded by default, never downloaded unless a Hub id is chosen) and start an engine.

    model: "embedded", a local diffusers-format folder or a Hub repo id; default $LINGBOT_MODEL or embedded.
    dtype: "auto" (lingbot_core/process/precision.py decides and says why), "bf16" or "fp32".
    preset: tests only ("tiny", or $LINGBOT_TEST_PRESET): the embedded model at a test size. A test preset
    runs in fp32 under "auto": it checks the machinery, and fp32 is fast on every CPU (bf16 is emulated,
    ~20x slower, on CPUs without AMX or AVX512-BF16), so the tests take the same time everywhere.
    compile: None compiles where it pays (CUDA; on a CPU a model measured to pay, none yet; see load_pipeline),
    True/False force it.
    log: prints each start-up stage with its time.
    """
    source = model or os.environ.get("LINGBOT_MODEL") or "embedded"
    preset = preset or os.environ.get("LINGBOT_TEST_PRESET") or None
    overrides = {}
    if preset is not None:
        if preset not in TEST_PRESETS or source != "embedded":
            raise ValueError(f"test preset {preset!r}: the presets are {sorted(TEST_PRESETS)}, "
                             "for the embedded model only")
        overrides["preset_hint"] = TEST_PRESETS[preset]()
        dtype = "fp32" if dtype == AUTO else dtype
    if device is None:  # decided here, not at import: nothing touches CUDA before the app starts
        device = os.environ.get("LINGBOT_DEVICE") or default_device()
    # A Hub id is only ever used by choosing it, so choosing it allows the download.
    allow_download = source != "embedded" and not Path(source).expanduser().exists()
    # Loaded on the engine's model thread, so the thread that serves the page never runs a kernel.
    return Engine(lambda: load_pipeline(source, dtype=dtype, device=device, compile=compile,
                                        allow_download=allow_download, log=log, **overrides), engine_config,
                  log=log)
