"""Building the local engine from a command line's choices: the model source, the device and the precision.

Shared by the page (app.py) and the headless protocol server (lingbot_core/serve.py), so both load the
same model the same way.
"""

from __future__ import annotations

import os
from pathlib import Path


from lingbot_core.blocks.model_source import EMBEDDED_SOURCE, choose_source
from lingbot_core.blocks.pipeline import load_pipeline
from lingbot_core.process.device import default_device
from lingbot_core.process.precision import AUTO
from lingbot_core.process.startup import StartupLog
from lingbot_core.serving.contract import EngineConfig
from lingbot_core.serving.engine import Engine



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
    source, preset_hint = choose_source(model, preset)
    overrides = {}
    if preset_hint is not None:
        overrides["preset_hint"] = preset_hint
        dtype = "fp32" if dtype == AUTO else dtype
    if device is None:  # decided here, not at import: nothing touches CUDA before the app starts
        device = os.environ.get("LINGBOT_DEVICE") or default_device()
    # A Hub id is only ever used by choosing it, so choosing it allows the download.
    allow_download = source != EMBEDDED_SOURCE and not Path(source).expanduser().exists()
    # Loaded on the engine's model thread, so the thread that serves the page never runs a kernel.
    return Engine(lambda: load_pipeline(source, dtype=dtype, device=device, compile=compile,
                                        allow_download=allow_download, log=log, **overrides), engine_config,
                  log=log)
