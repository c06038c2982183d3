"""Offline renders share the model with live worlds block by block (hardening, second attack: F5, F9, F10).

A 64-block render used to run as one model-thread job and stopped every live world for its whole length.
Here a healthy world streams while renders run: its blocks keep coming with at most one render block
between two of them, renders wait in a bounded line and are told their place, and a request is checked
whole (its length bounded first, every prompt cleaned) before its first block. The longest gap of the
healthy world is printed beside its usual interval; the figures on the embedded model are
`benchmarks/bench_hardening.py`'s.
"""

from __future__ import annotations

import statistics
import threading
import time

import numpy as np
import pytest

from lingbot_core.config import tiny_config
from lingbot_core.boundary.events import EventError
from lingbot_core.boundary.offline import RenderRequest, parse_render
from lingbot_core.boundary.requests import BlockControl
from lingbot_core.serving.contract import Admission, Block, EngineConfig, RenderFailedError, RenderRefused
from lingbot_core.serving.engine import Engine
from lingbot_core.serving.renders import RenderLimits, RenderProgress
from lingbot_core.boundary.video import count_frames
from test_engine import CONFIG, PROMPT, _pipeline, _request

BIG = 1 << 34
pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def pipe():
    return _pipeline(CONFIG)


@pytest.fixture(scope="module")
def image() -> np.ndarray:
    return np.random.default_rng(1).integers(0, 256, size=(48, 80, 3), dtype=np.uint8)


def _render_request(image, blocks: int) -> RenderRequest:
    keys = (frozenset("w"),) * CONFIG.transformer.num_frames_per_block
    return RenderRequest(_request(image, PROMPT, 3), tuple(BlockControl(actions=keys) for _ in range(blocks)))


class Timeline:
    """Which kind of block the engine's worker ran, in order: "live" or "render"."""

    def __init__(self, engine: Engine) -> None:
        self.kinds: list[str] = []
        run_once, render_block = engine.run_once, engine._render_block

        def live():
            ran = run_once()
            if ran is not None:
                self.kinds.append("live")
            return ran

        def render(*args, **kwargs):
            ran = render_block(*args, **kwargs)
            if ran:
                self.kinds.append("render")
            return ran

        engine.run_once, engine._render_block = live, render

    def most_renders_between_live_blocks(self) -> int:
        runs, current, seen_live = [0], 0, False
        for kind in self.kinds:
            if kind == "live":
                if seen_live:
                    runs.append(current)
                seen_live, current = True, 0
            else:
                current += 1
        return max(runs)


def _healthy_viewer(engine: Engine, session_id: str, stop: threading.Event, arrivals: list[float]) -> None:
    """A viewer that reads every block at once and presses W now and then (so the idle TTL never closes it)."""
    event_id = 0
    while not stop.is_set():
        message = engine.next_message(session_id, timeout=0.05)
        if isinstance(message, Block):
            arrivals.append(time.monotonic())
            if message.block_index % 4 == 0:
                event_id += 1
                engine.post_event(session_id, {"event_id": event_id, "keys": ["w"] if event_id % 2 else []})


def _gaps(arrivals: list[float]) -> list[float]:
    return [b - a for a, b in zip(arrivals, arrivals[1:])]


def test_a_render_shares_the_model_with_a_live_world_block_by_block(pipe, image, tmp_path):
    engine = Engine(pipe, EngineConfig(memory_budget_bytes=BIG, max_sessions=2))
    timeline = Timeline(engine)
    try:
        ticket = engine.admit(_request(image, PROMPT, 1))
        assert ticket.admission is Admission.ADMITTED
        stop, arrivals = threading.Event(), []
        viewer = threading.Thread(target=_healthy_viewer, args=(engine, ticket.session_id, stop, arrivals))
        viewer.start()
        while len(arrivals) < 6:  # the healthy world's usual pace, alone
            time.sleep(0.01)
        alone = statistics.median(_gaps(arrivals))
        seen: list[RenderProgress] = []
        during_from = len(arrivals)
        blocks = engine.render(_render_request(image, 12), tmp_path / "out.mp4", owner="1.2.3.4", progress=seen.append)
        during = _gaps(arrivals[during_from - 1:])
        stop.set()
        viewer.join()
    finally:
        engine.shutdown()
    assert blocks == 12 and count_frames(tmp_path / "out.mp4")[0] == CONFIG.pixel_frames_for_blocks(12)
    assert seen[0] == RenderProgress(0, 0, 12) and seen[-1] == RenderProgress(0, 12, 12)
    # The live world kept streaming: it made blocks all through the render, never more than one render block
    # apart (a render block runs in the gaps a live block leaves, or once it has waited its longest).
    assert len(during) >= 6
    assert timeline.most_renders_between_live_blocks() <= 1
    print(f"\nhealthy world: usual interval {1000 * alone:.0f} ms, longest gap during a 12-block render "
          f"{1000 * max(during):.0f} ms ({max(during) / alone:.1f}x)")


def test_renders_wait_in_a_bounded_line_and_are_told_their_place(pipe, image, tmp_path):
    limits = RenderLimits(max_renders=2, max_per_owner=1)
    engine = Engine(pipe, EngineConfig(memory_budget_bytes=BIG, renders=limits), start_worker=False)
    try:
        first_seen, second_seen = [], []
        first = threading.Thread(target=lambda: engine.render(_render_request(image, 3), tmp_path / "a.mp4", "a",
                                                              first_seen.append))
        # Without a worker the first caller makes its blocks itself; hold it at its first progress report so
        # the line is full while it runs.
        gate = threading.Event()
        proceed = threading.Event()

        def slow_first(progress):
            first_seen.append(progress)
            gate.set()
            proceed.wait(10)

        first = threading.Thread(target=lambda: engine.render(_render_request(image, 3), tmp_path / "a.mp4", "a",
                                                              slow_first))
        first.start()
        assert gate.wait(10)
        with pytest.raises(RenderRefused, match="already have an offline render"):
            engine.render(_render_request(image, 1), tmp_path / "b.mp4", "a")
        second = threading.Thread(target=lambda: engine.render(_render_request(image, 1), tmp_path / "c.mp4", "c",
                                                               second_seen.append))
        second.start()
        deadline = time.monotonic() + 10
        while not second_seen and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(RenderRefused, match="2 offline renders are running or waiting"):
            engine.render(_render_request(image, 1), tmp_path / "d.mp4", "d")
        proceed.set()
        first.join(30)
        second.join(30)
    finally:
        engine.shutdown()
    assert second_seen[0] == RenderProgress(1, 0, 1)  # one render ahead of it
    assert RenderProgress(0, 1, 1) in second_seen  # then it ran
    assert (tmp_path / "a.mp4").exists() and (tmp_path / "c.mp4").exists()
    assert not (tmp_path / "b.mp4").exists() and not (tmp_path / "d.mp4").exists()


def test_a_render_that_fails_leaves_no_file_and_the_engine_goes_on(pipe, image, tmp_path, monkeypatch):
    engine = Engine(pipe, EngineConfig(memory_budget_bytes=BIG))
    try:
        calls = []
        step = type(pipe).step

        def failing(self, pool, pages, state, control, on_stage=None):
            calls.append(state.block_index)
            if state.block_index == 1 and control.actions and "s" in control.actions[0]:
                raise RuntimeError("poisoned block")
            return step(self, pool, pages, state, control, on_stage)

        monkeypatch.setattr(type(pipe), "step", failing)
        keys = [(frozenset("w"),) * 3, (frozenset("s"),) * 3, (frozenset("w"),) * 3]
        request = RenderRequest(_request(image, PROMPT, 3), tuple(BlockControl(actions=k) for k in keys))
        with pytest.raises(RenderFailedError, match="block 1 failed: RuntimeError: poisoned block"):
            engine.render(request, tmp_path / "out.mp4")
        assert not (tmp_path / "out.mp4").exists()
        assert engine.render(_render_request(image, 2), tmp_path / "next.mp4") == 2
        assert engine.pages.num_in_use == 0  # the failed render's pages went back (its pool is private)
    finally:
        engine.shutdown()


def test_a_script_is_bounded_before_it_is_read_whole(image):
    config = CONFIG
    line = '{"event_id": %d, "keys": ["w"]}\n'
    huge = "".join(line % i for i in range(200_000))
    started = time.perf_counter()
    with pytest.raises(EventError, match="characters; 64 blocks take at most"):
        parse_render(config, image, PROMPT, 0, script_text=huge, max_blocks=64)
    # A script under the byte bound but over the block bound stops at the first event past it.
    many = "".join(line % i for i in range(65)) + "{not json at all\n" * 100
    with pytest.raises(EventError, match="line 65: the script holds more than 64 events"):
        parse_render(config, image, PROMPT, 0, script_text=many, max_blocks=64)
    assert time.perf_counter() - started < 60  # not a timing claim: a hang would be a bug


def test_every_prompt_of_a_script_is_checked_before_the_first_block(pipe, image, tmp_path, monkeypatch):
    """A bad prompt on the last line is refused by the parse, so no block is made (F9)."""
    events = [f'{{"event_id": {i}, "keys": ["w"]}}' for i in range(63)] + ['{"event_id": 63, "keys": [], "prompt": "  "}']
    with pytest.raises(EventError, match="line 64: event 63 prompt: prompt is empty"):
        parse_render(CONFIG, image, PROMPT, 0, script_text="\n".join(events), max_blocks=64)
    # and a prompt that cleans is cleaned there, once
    request = parse_render(CONFIG, image, PROMPT, 0, script_text='{"event_id": 0, "keys": [], "prompt": "a &amp;amp; b"}',
                           max_blocks=64)
    assert request.controls[0].prompt == "a & b"


def test_a_long_trajectory_file_is_cut_before_its_frames_are_checked(image, tmp_path):
    """A pose file of 100,000 frames for a 2-block request: only its first 21 frames are checked and resampled,
    and the note says how many were used and dropped (F5's 10^6-frame file, smaller)."""
    frames = 100_000
    poses = np.tile(np.eye(4, dtype=np.float16), (frames, 1, 1))
    poses[:, 2, 3] = (np.arange(frames) % 100) * 0.01
    intrinsics = np.tile(np.array([500, 500, 416, 240], np.float16), (frames, 1))
    np.save(tmp_path / "poses.npy", poses)
    np.save(tmp_path / "intrinsics.npy", intrinsics)
    started = time.perf_counter()
    request = parse_render(CONFIG, image, PROMPT, 0, poses_path=tmp_path / "poses.npy",
                           intrinsics_path=tmp_path / "intrinsics.npy", trusted_root=tmp_path, max_blocks=2)
    assert len(request.controls) == 2
    assert request.note == f"trajectory: 21 of its {frames} frames used for 2 blocks, {frames - 21} dropped"
    print(f"\na {frames}-frame pose file parsed for 2 blocks in {1000 * (time.perf_counter() - started):.0f} ms")
