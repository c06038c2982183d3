"""Shared fixtures for the pipeline-level tests: one tiny fp64 pipeline whose window slides early, a start image.

The pipeline holds weights only (every world's state lives in a RolloutState), so one instance per
session is safe to share; tests must not change its weights.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

# Each test process keeps its own Gradio cache: an app that closes deletes every file it cached, and under
# pytest-xdist another worker's app may be serving files from the same folder at that moment.
# (The workers inherit the controller's environment, so a folder this file made there is replaced, not kept.)
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "main")
if "GRADIO_TEMP_DIR" not in os.environ or os.environ.get("LINGBOT_TEST_GRADIO_OWNER") not in (None, _WORKER):
    os.environ["GRADIO_TEMP_DIR"] = tempfile.mkdtemp(prefix=f"gradio-{_WORKER}-")
    os.environ["LINGBOT_TEST_GRADIO_OWNER"] = _WORKER
    atexit.register(shutil.rmtree, os.environ["GRADIO_TEMP_DIR"], True)

import numpy as np
import pytest
import torch

from lingbot_core.config import tiny_config
from lingbot_core.blocks.loading import build_seeded_parts
from lingbot_core.blocks.pipeline import Pipeline

# Sink = one block and room for one block of recent history, so frames leave the window from block 2's
# commit on. rope_max_seq_len=8: block 2 (frames 6..8) crosses the RoPE table and later blocks lie beyond it.
WINDOW_CONFIG = tiny_config(rope_max_seq_len=8, sink_size=3, sliding_window_num_frames=9)


@pytest.fixture(scope="module")
def single_thread():
    """One intra-op thread: on a shared 2-core machine this is several times faster than two, and stable."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_pipeline() -> Pipeline:
    """WINDOW_CONFIG with seeded weights, everything in float64 (exactness is asserted against it)."""
    parts = build_seeded_parts(WINDOW_CONFIG, seed=0, dtype=torch.float64)
    return Pipeline.from_parts(parts)


@pytest.fixture(scope="module")
def server(request, tmp_path_factory):
    """app.py served on the tiny model for one test module, set up by the module's APP_SERVER: a dict of
    EngineConfig ("engine"), StreamConfig ("stream") and build_demo keywords ("build"). Yields (url, engine,
    DemoApp). Imported here, not at the top: only the app tests pay for Gradio."""
    from app_driver import running_app

    setup = request.module.APP_SERVER
    with running_app(setup["engine"], setup["stream"], tmp_path_factory.mktemp(request.module.__name__),
                     **setup.get("build", {})) as served:
        yield served


@pytest.fixture(scope="session")
def start_image() -> np.ndarray:
    """A 40x70 RGB image (not the model's 32x64, so resize and crop run): gradients plus seeded noise."""
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:40, 0:70]
    base = np.stack([xx * 3.5, yy * 6.0, (xx + yy) * 2.0], axis=-1)
    image = np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
    image.setflags(write=False)
    return image
