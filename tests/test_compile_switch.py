"""Compiled where it pays, eager until the graphs exist: the switch happens only between blocks, and a
rollout that switches mid-way makes the blocks an all-eager rollout makes.

The switching logic is checked exactly with an injected stand-in for torch.compile (it runs the eager
function and counts its calls), so the test controls when the "build" finishes: in the middle of a block.
One small real-compile test (tiny model, fp32) checks that the warm-up rollout builds every graph a
rollout needs (no recompiles after the switch) and that compiled blocks agree with eager within fp32
tolerance; it is marked `compile` and runs with LINGBOT_TEST_COMPILE=1.
"""

from __future__ import annotations

import os
import threading
from dataclasses import replace

import pytest
import torch

from lingbot_core.process.compile_cache import graphs_cached, graphs_key, mark_graphs_cached
from lingbot_core.process.compile_switch import BACKGROUND, COMPILED, EAGER, CompileSwitch, warm_blocks
from lingbot_core.config import EMBEDDED, tiny_config
from lingbot_core.blocks.loading import build_seeded_parts
from lingbot_core.model.attention import context_frames
from lingbot_core.blocks.pages import PageAllocator
from lingbot_core.blocks.pipeline import Pipeline, compile_plan
from lingbot_core.boundary.requests import BlockControl
from lingbot_core.blocks.rollout import release

from conftest import WINDOW_CONFIG

pytestmark = pytest.mark.usefixtures("single_thread")

BLOCKS = 5
SWITCH_DURING = 2  # the background build finishes in the middle of this block


class FakeCompile:
    """Stands in for torch.compile: the "compiled" callable is the eager one, counting the model thread's
    calls per block (calls from the build thread are the warm-up's, counted apart)."""

    def __init__(self) -> None:
        self.model_thread = threading.get_ident()
        self.block = -1  # the model thread's current block, set by the test loop
        self.calls: dict[int, int] = {}
        self.warm_calls = 0

    def __call__(self, fn, **options):
        assert options == {"dynamic": False}

        def compiled(*args, **kwargs):
            if threading.get_ident() == self.model_thread:
                self.calls[self.block] = self.calls.get(self.block, 0) + 1
            else:
                self.warm_calls += 1
            return fn(*args, **kwargs)

        return compiled


def _seeded_pipeline() -> Pipeline:
    """Own parts (the switch installs itself on the blocks, so the shared fixture's stay untouched)."""
    return Pipeline.from_parts(build_seeded_parts(WINDOW_CONFIG, seed=0, dtype=torch.float32))


def _controls(config, count=BLOCKS):
    keys = ("w", "a", "", "d", "j", "s", "w", "l")
    frames = config.transformer.num_frames_per_block
    return [BlockControl(actions=(frozenset(keys[i % len(keys)]),) * frames) for i in range(count)]


def _rollout(pipe, image, controls, before_stage=None, on_block=None):
    """Blocks of one rollout through pipe.step; before_stage(block, stage) runs inside each block."""
    pool = pipe.new_pool()
    pages = PageAllocator(pool.num_pages)
    state = pipe.start(image, "a quiet street", 3)
    outputs = []
    try:
        for index, control in enumerate(controls):
            if on_block is not None:
                on_block(index)
            hook = None if before_stage is None else (lambda stage, i=index: before_stage(i, stage))
            output, state = pipe.step(pool, pages, state, control, on_stage=hook)
            outputs.append(output)
    finally:
        release(pages, state)
    return outputs


def _calls_per_block(pipe) -> dict[str, int]:
    """Block forwards and decoder steps one block makes (all of them, either path)."""
    forwards = len(pipe.config.sampler.timesteps) + 1  # the denoise forwards and the commit forward
    return {"blocks": forwards * pipe.config.transformer.num_layers,
            "decode": pipe.config.transformer.num_frames_per_block}


def test_background_build_switches_only_between_blocks_and_matches_eager(start_image):
    eager = _rollout(_seeded_pipeline(), start_image, _controls(WINDOW_CONFIG))

    pipe = _seeded_pipeline()
    fake = FakeCompile()
    switch = CompileSwitch(pipe.transformer.blocks, compile_fn=fake)
    pipe.decode_frame, pipe.compile_switch = switch.decode_frame, switch
    release_build = threading.Event()
    reports = []

    def warm():
        release_build.wait(timeout=60)
        pipe.warm_rollout()

    switch.build_in_background(warm, report=reports.append)

    def finish_build_mid_block(block, stage):
        if block == SWITCH_DURING and stage == "denoise":
            release_build.set()
            assert switch.wait(timeout=120), "the background build did not finish"
            assert not switch.compiled  # built, but this block started eager and stays eager

    def set_block(index):
        fake.block = index

    switched = _rollout(pipe, start_image, _controls(WINDOW_CONFIG), finish_build_mid_block, set_block)

    assert switch.error is None and reports and "built" in reports[0]
    assert fake.warm_calls > 0  # the warm-up rollout ran on the compiled path, in its own thread
    assert switch.switched_before_block == SWITCH_DURING + 1
    per_block = _calls_per_block(pipe)
    for block in range(BLOCKS):
        want = 0 if block <= SWITCH_DURING else per_block["blocks"] + per_block["decode"]
        assert fake.calls.get(block, 0) == want, f"block {block}: {fake.calls.get(block, 0)} compiled calls"
    for got, want in zip(switched, eager):
        torch.testing.assert_close(got.frames, want.frames, rtol=0, atol=0)
        torch.testing.assert_close(got.latents, want.latents, rtol=0, atol=0)


def test_a_failed_build_stays_eager_and_says_why(start_image):
    pipe = _seeded_pipeline()
    fake = FakeCompile()
    switch = CompileSwitch(pipe.transformer.blocks, compile_fn=fake)
    pipe.decode_frame, pipe.compile_switch = switch.decode_frame, switch
    reports = []

    def broken():
        raise RuntimeError("no C++ compiler")

    switch.build(broken, report=reports.append)
    _rollout(pipe, start_image, _controls(WINDOW_CONFIG, 2), on_block=lambda i: setattr(fake, "block", i))
    assert not switch.compiled and fake.calls == {}
    assert "staying eager" in reports[0] and "no C++ compiler" in reports[0]


@pytest.mark.parametrize("config", [WINDOW_CONFIG, tiny_config(), EMBEDDED], ids=["window", "tiny", "embedded"])
def test_the_warm_up_rollout_meets_every_context_length(config):
    t = config.transformer
    lengths = lambda blocks: {len(context_frames(b * t.num_frames_per_block, t)) for b in range(blocks)}  # noqa: E731
    warm = warm_blocks(t.num_frames_per_block, lambda frame: len(context_frames(frame, t)))
    assert warm >= 2 and lengths(warm) == lengths(200)


def test_compile_plan_flags_win_and_the_default_compiles_where_measured(monkeypatch):
    import lingbot_core.blocks.pipeline as pipeline_module

    assert compile_plan(None, "cpu", "embedded", False)[0] == EAGER  # nothing measured to pay at present
    monkeypatch.setattr(pipeline_module, "CPU_COMPILE_PAYS", frozenset({"embedded"}))
    assert compile_plan(False, "cpu", "embedded", True)[0] == EAGER  # --no-compile wins
    assert compile_plan(False, "cuda", "embedded", True)[0] == EAGER
    assert compile_plan(True, "cpu", "tiny", False)[0] == COMPILED  # --compile forces it, cold or not
    assert compile_plan(None, "cuda", "anything", False)[0] == COMPILED
    # The default on a CPU serves eager at once and switches when the graphs are built (minutes when the
    # inductor cache is cold, seconds when warm), so start-up never waits for the compiler.
    assert compile_plan(None, "cpu", "embedded", False) == (BACKGROUND, "default for 'embedded' on a CPU; "
                                                            "inductor cache cold: minutes to build")
    assert compile_plan(None, "cpu", "embedded", True)[0] == BACKGROUND
    assert "warm" in compile_plan(None, "cpu", "embedded", True)[1]
    assert compile_plan(None, "cpu", "tiny", False)[0] == EAGER  # not measured to pay


def test_a_marker_says_which_graphs_are_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    key = graphs_key(EMBEDDED, torch.float32, "cpu")
    assert key == graphs_key(EMBEDDED, torch.float32, "cpu")
    assert key != graphs_key(EMBEDDED, torch.bfloat16, "cpu") and key != graphs_key(tiny_config(), torch.float32, "cpu")
    assert not graphs_cached(key)
    mark_graphs_cached(key)
    assert graphs_cached(key) and not graphs_cached(graphs_key(tiny_config(), torch.float32, "cpu"))


@pytest.mark.compile
@pytest.mark.skipif(os.environ.get("LINGBOT_TEST_COMPILE") != "1",
                    reason="a real torch.compile of the tiny model; set LINGBOT_TEST_COMPILE=1")
def test_real_compile_switches_mid_rollout_without_recompiling(start_image):
    from torch._dynamo.utils import counters

    eager = _rollout(_seeded_pipeline(), start_image, _controls(WINDOW_CONFIG))
    pipe = _seeded_pipeline()
    switch = CompileSwitch(pipe.transformer.blocks)
    pipe.decode_frame, pipe.compile_switch = switch.decode_frame, switch
    release_build = threading.Event()

    def warm():
        release_build.wait(timeout=60)
        pipe.warm_rollout()

    switch.build_in_background(warm)
    graphs = []

    def finish_build_mid_block(block, stage):
        if block == SWITCH_DURING and stage == "denoise":
            release_build.set()
            assert switch.wait(timeout=900)
            graphs.append(counters["stats"]["unique_graphs"])

    switched = _rollout(pipe, start_image, _controls(WINDOW_CONFIG), finish_build_mid_block)
    assert switch.error is None, switch.error
    assert switch.switched_before_block == SWITCH_DURING + 1
    assert counters["stats"]["unique_graphs"] == graphs[0], "the rollout compiled graphs the warm-up had not"
    for got, want in zip(switched, eager):
        torch.testing.assert_close(got.frames, want.frames, rtol=1e-4, atol=1e-4)


# The compile policy goes by the model's name: the tiny model under the embedded model's name loads in a
# fraction of the time and takes the same decisions.
TINY_NAMED_EMBEDDED = replace(tiny_config(), name="embedded")


def _load_log(monkeypatch, **kwargs) -> tuple[Pipeline, str, list]:
    """load_pipeline with a log; a background build is recorded instead of started."""
    import io

    from lingbot_core.blocks.pipeline import load_pipeline
    from lingbot_core.process.startup import StartupLog

    started = []
    monkeypatch.setattr(CompileSwitch, "build_in_background",
                        lambda self, warm, report=None: started.append(warm))
    out = io.StringIO()
    kwargs.setdefault("preset_hint", TINY_NAMED_EMBEDDED)
    pipe = load_pipeline("embedded", dtype="fp32", log=StartupLog(out=out), **kwargs)
    return pipe, out.getvalue(), started


def test_the_default_on_a_cpu_serves_eager_and_builds_in_background(monkeypatch):
    import lingbot_core.blocks.pipeline as pipeline_module

    monkeypatch.setattr(pipeline_module, "CPU_COMPILE_PAYS", frozenset({"embedded"}))  # where measured to pay
    pipe, log, started = _load_log(monkeypatch)
    assert pipe.compile_mode == BACKGROUND and len(started) == 1
    assert pipe.decode_frame == pipe.compile_switch.decode_frame and not pipe.compile_switch.compiled
    assert "compile: eager now, compiling in background (default for 'embedded' on a CPU" in log


def test_no_compile_wins_and_a_test_preset_stays_eager(monkeypatch):
    pipe, log, started = _load_log(monkeypatch, compile=False)
    assert pipe.compile_mode == EAGER and pipe.compile_switch is None and not started
    assert "compile: eager (--no-compile)" in log
    pipe, log, started = _load_log(monkeypatch, preset_hint=tiny_config())
    assert pipe.compile_mode == EAGER and pipe.compile_switch is None and not started
    assert "compile: eager (compiling 'tiny' on a CPU is not measured to pay" in log


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last_3d])
def test_the_onednn_convolution_traces_with_the_layout_it_runs_with(layout):
    """The VAE's CPU convolution (cpu_kernels.py) must trace: under compile it is the custom op
    lingbot::onednn_conv, whose fake output has the real output's shape and strides whatever the
    input's layout (oneDNN answers a channels-last input with channels-last output; the op does not)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lingbot_core.model.cpu_kernels import _onednn_conv, _onednn_eager

    x, w, b = torch.randn(1, 8, 3, 6, 10).contiguous(memory_format=layout), torch.randn(4, 8, 3, 3, 3), torch.randn(4)
    conv = ([0, 1, 1], [1, 1, 1], [1, 1, 1], 1)  # padding, stride, dilation, groups
    real = _onednn_conv(x, w, b, *conv)
    # Bit for bit what eager runs, whatever the input's layout: both hand oneDNN channels-last operands.
    assert torch.equal(real, _onednn_eager(x, w, b, *conv))
    assert torch.equal(real, _onednn_conv(x.contiguous(memory_format=torch.channels_last_3d), w, b, *conv))
    # Against other kernels only within rounding: oneDNN's plain-layout kernel sums in another order than its
    # channels-last one (about 6e-6 apart on an AVX2-only CPU; up to 1.9e-5 seen on AVX-512 for outputs of
    # magnitude ~5, a sum of 216 products): float32 rounding of such sums, not a different function.
    tolerance = dict(rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(real, torch.mkldnn_convolution(x.contiguous(), w, b, *conv), **tolerance)
    torch.testing.assert_close(real, torch.nn.functional.conv3d(x, w, b, padding=(0, 1, 1)), **tolerance)
    with FakeTensorMode() as mode:
        fake = _onednn_conv(mode.from_tensor(x), mode.from_tensor(w), mode.from_tensor(b), *conv)
    assert fake.shape == real.shape and fake.stride() == real.stride()
    torch.library.opcheck(_onednn_conv, (x, w, b, *conv))
