"""Engine oracles: admission by bytes, round-robin at block boundaries, pacing to the consumer, idle TTL, LRU
eviction, every path returning every page, and the threaded worker equal to the offline command.

Most tests drive the engine with `run_once` (start_worker=False) and an injected clock, so nothing depends on
timing. The pipeline is the tiny float32 model of test_session (window slides from block 2 on, slim VAE).
"""

from __future__ import annotations

import dataclasses
import gc
import importlib.util
import json
import os
import threading
import time
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

from lingbot_core.config import WAN21_VAE, tiny_config
from lingbot_core.boundary.events import EventError, read_events
from lingbot_core.boundary.offline import controls_from_events
from lingbot_core.blocks.loading import build_seeded_parts
from lingbot_core.blocks.pages import PageAllocator
from lingbot_core.blocks.pipeline import Pipeline
from lingbot_core.boundary.requests import StartRequest, parse_start
from lingbot_core.serving.contract import (Admission, AdmissionRefused, Block, CloseCause, Closed, EngineConfig, Failed,
                                           NewWorld, UnknownSession, Waiting)
from lingbot_core.serving.engine import Engine
from lingbot_core.model.held_bytes import held_bytes
from lingbot_core.serving.session import Replay, Session
from lingbot_core.boundary.video import count_frames, frames_to_uint8

SLIM_VAE = dict(WAN21_VAE, base_dim=4, num_res_blocks=1)
CONFIG = dataclasses.replace(tiny_config(rope_max_seq_len=8, sink_size=3, sliding_window_num_frames=9), vae=SLIM_VAE)
# For the 1,000-cycle test: one latent frame per block, 32x32 pixels.
MICRO = dataclasses.replace(tiny_config(num_frames_per_block=1, sink_size=1, sliding_window_num_frames=3),
                            vae=SLIM_VAE, width=32)
BLOCK = CONFIG.transformer.num_frames_per_block
PROMPT = "a lighthouse on a cliff"
BIG = 1 << 34  # a budget that never binds here; capacity comes from max_sessions


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


pytestmark = pytest.mark.usefixtures("single_thread")  # conftest: one intra-op thread for tiny tensors


def _pipeline(config) -> Pipeline:
    parts = build_seeded_parts(config, seed=0, dtype=torch.float32)
    return Pipeline.from_parts(parts)


@pytest.fixture(scope="module")
def pipe() -> Pipeline:
    return _pipeline(CONFIG)


@pytest.fixture(scope="module")
def image() -> np.ndarray:
    rng = np.random.default_rng(1)
    return rng.integers(0, 256, size=(48, 80, 3), dtype=np.uint8)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def _engine(pipe, clock, **config) -> Engine:
    config.setdefault("memory_budget_bytes", BIG)
    return Engine(pipe, EngineConfig(**config), clock=clock, start_worker=False)


def _request(image, prompt: str, seed: int, config=CONFIG) -> StartRequest:
    return parse_start(image, prompt, seed, config)  # what the app's boundary hands the engine


def _admit(engine: Engine, image, seed: int = 0, prompt: str = PROMPT) -> str:
    ticket = engine.admit(_request(image, prompt, seed, engine.pipeline.config))
    assert ticket.admission is Admission.ADMITTED
    return ticket.session_id


def _take(engine: Engine, session_id: str, timeout: float = 0):
    """The session's next message past any NewWorld (every outbox starts with one; see
    test_the_outbox_tells_each_world_and_its_blocks_and_builds_the_replay)."""
    message = engine.next_message(session_id, timeout=timeout)
    while isinstance(message, NewWorld):
        message = engine.next_message(session_id, timeout=timeout)
    return message


def _counting_steps(monkeypatch, pipe) -> list:
    """Every block the pipeline runs, by the prompt of the state it ran on."""
    calls = []
    step = Pipeline.step

    def counted(self, pool, pages, state, control, on_stage=None):
        calls.append(state.prompt)
        return step(self, pool, pages, state, control, on_stage)

    monkeypatch.setattr(Pipeline, "step", counted)
    return calls


# ---------------------------------------------------------------------------------------------
# Admission


def test_the_memory_probe_runs_no_block_of_the_model(pipe, clock, monkeypatch):
    """Start-up stays cheap: the footprint comes from shapes and a small-frame VAE stream, never a whole block
    (tests/test_session.py checks its figures against a real rollout)."""
    steps = _counting_steps(monkeypatch, pipe)
    forwards = []
    handle = pipe.transformer.register_forward_pre_hook(lambda module, args: forwards.append(1))
    try:
        engine = _engine(pipe, clock, max_sessions=1)
    finally:
        handle.remove()
    assert steps == [] and forwards == [] and engine.footprint.condition > 0
    engine.shutdown()


def test_without_a_budget_the_engine_plans_with_its_devices_share_of_free_memory(pipe, clock, monkeypatch):
    """EngineConfig.memory_fraction None: 0.9 of a GPU's free memory (the engine's alone; at 0.5 the 14B
    model admitted no session on an H200, benchmarks/bench_gpu.py), 0.5 of a CPU host's; a fraction given wins."""
    from lingbot_core.serving import memory

    free = 8 << 30
    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: free)
    assert EngineConfig().memory_fraction is None
    assert memory.DEFAULT_MEMORY_FRACTION == {"cuda": 0.9, "cpu": 0.5}
    for config, share in ((EngineConfig(), memory.DEFAULT_MEMORY_FRACTION["cpu"]),
                          (EngineConfig(memory_fraction=0.25), 0.25)):
        engine = Engine(pipe, config, clock=clock, start_worker=False)
        assert engine.memory_budget == int(free * share)
        engine.shutdown()


def test_admission_by_bytes_waits_in_line_then_refuses(pipe, image, clock):
    probe = _engine(pipe, clock, max_sessions=1)
    one, reserve = probe.session_bytes, probe.reserved_bytes
    assert one >= probe.footprint.committed + probe.footprint.message and probe.block_reserve >= probe.footprint.in_flight
    assert reserve == probe.block_reserve + probe.conditions.max_bytes
    probe.shutdown()
    with pytest.raises(ValueError, match="holds no session"):
        _engine(pipe, clock, memory_budget_bytes=reserve + one - 1)

    engine = _engine(pipe, clock, memory_budget_bytes=reserve + 3 * one - 1, max_waiting=2, ticket_ttl_s=30,
                     evictable_after_s=1000)
    assert engine.capacity == 2
    first, second = _admit(engine, image), _admit(engine, image)
    t1 = engine.admit(_request(image, PROMPT, 0))
    t2 = engine.admit(_request(image, PROMPT, 0))
    assert (t1.admission, t1.position, t2.position) == (Admission.WAITING, 1, 2)
    with pytest.raises(AdmissionRefused, match="server is full"):
        engine.admit(_request(image, PROMPT, 0))
    assert engine.stats()["waiting"] == 2

    engine.close(first)  # the engine seats the first in line itself; the second may not jump ahead
    assert t1.session_id in engine.session_ids() and t2.session_id not in engine.session_ids()
    assert engine.next_message(t1.session_id, timeout=0) == Waiting(1)  # its unread place, then its world
    assert isinstance(engine.next_message(t1.session_id, timeout=0), NewWorld)
    # The first place is gone; the second is now first, but there is no room.
    assert [engine.next_message(t2.session_id, timeout=0) for _ in range(3)] == [Waiting(2), Waiting(1), None]
    # A place whose outbox nobody reads for ticket_ttl_s leaves the line with a Closed message.
    clock.now += 31
    t3 = engine.admit(_request(image, PROMPT, 0))
    assert t3.position == 1 and engine.stats()["waiting"] == 1
    assert "left the line" in engine.next_message(t2.session_id, timeout=0).reason
    engine.shutdown()
    assert engine.next_message(t3.session_id, timeout=0) == Closed("server shutting down", CloseCause.SHUTDOWN)
    assert engine.pages.num_in_use == 0 and second not in engine.session_ids()


# ---------------------------------------------------------------------------------------------
# The condition stream, once per picture


def _count_encoder_calls(pipe) -> list:
    calls = []
    handle = pipe.vae.encoder.register_forward_pre_hook(lambda module, args, kwargs: calls.append(1),
                                                        with_kwargs=True)
    return calls, handle


def _run_blocks(engine, session_id, blocks: int) -> list[torch.Tensor]:
    """Run until `session_id` has made `blocks` more blocks (others make at most one, left in their outboxes)."""
    latents = []
    while len(latents) < blocks:
        ran = engine.run_once()
        assert ran is not None
        if ran == session_id:
            latents.append(_take(engine, session_id).latents)
    return latents


def test_a_second_session_from_the_same_picture_does_not_encode_its_condition_again(pipe, image, clock):
    calls, handle = _count_encoder_calls(pipe)
    try:
        engine = _engine(pipe, clock, max_sessions=2)
        first = _admit(engine, image, seed=0)
        _run_blocks(engine, first, 8)  # past the condition fixed point (block 6 here)
        first_calls = len(calls)
        assert first_calls > 0  # the first session paid the warm-up

        # Same pixels from another array (another upload of the same picture), another seed and prompt.
        second = _admit(engine, image.copy(), seed=5, prompt="another prompt")
        _run_blocks(engine, second, 8)
        assert len(calls) == first_calls, "the second session re-encoded its condition stream"

        # Kept after every reader is gone: a later session from the picture still pays nothing.
        engine.close(first)
        engine.close(second)
        third = _admit(engine, image, seed=1)
        _run_blocks(engine, third, 3)
        assert len(calls) == first_calls and len(engine.conditions) == 1

        # Another picture has its own stream.
        other = _admit(engine, 255 - image, seed=0)
        _run_blocks(engine, other, 1)
        assert len(calls) > first_calls and len(engine.conditions) == 2
        engine.shutdown()
    finally:
        handle.remove()


def test_a_shared_condition_stream_gives_exactly_the_blocks_of_a_private_one(pipe, image, clock):
    """Two sessions from one picture, interleaved block by block, each equal to a session with its own stream."""
    engine = _engine(pipe, clock, max_sessions=2)
    ids = [_admit(engine, image, seed=seed) for seed in (3, 4)]
    shared = {session_id: [] for session_id in ids}
    for _ in range(9):  # round-robin: the sessions alternate, one extends the stream, the other reads it
        for _ in ids:
            session_id = engine.run_once()
            shared[session_id].append(_take(engine, session_id).latents)
    assert engine._sessions[ids[0]].session.rollout.condition.shared is \
        engine._sessions[ids[1]].session.rollout.condition.shared
    engine.shutdown()
    for session_id, seed in zip(ids, (3, 4)):
        pool = pipe.new_pool()
        private = Session("private", pipe, pool, PageAllocator(pool.num_pages), _request(image, PROMPT, seed))
        assert private.rollout.condition.shared is None
        for block, latents in enumerate(shared[session_id]):
            assert torch.equal(private.step().latents, latents), (seed, block)
        private.close()


def test_prewarm_encodes_a_picture_while_idle_and_its_sessions_then_encode_nothing(pipe, image, clock):
    """The app's examples: encoded one block at a time while nobody plays, and a session from the picture
    then encodes nothing and equals one that encoded its own stream."""
    calls, handle = _count_encoder_calls(pipe)
    try:
        engine = _engine(pipe, clock, max_sessions=2)
        picture = _request(image, PROMPT, 0).picture
        probed = len(calls)  # the engine's memory probe ran the encoder
        engine.prewarm([picture])
        assert len(engine.conditions) == 1 and len(calls) == probed  # queued, nothing encoded yet

        other = _admit(engine, 255 - image)  # nothing while anyone plays, even between blocks
        assert not engine.warm_one_condition_block()
        assert engine.run_once() == other  # its block waits for its consumer: the model is idle
        assert not engine.warm_one_condition_block()
        engine.close(other)
        stream = pipe.shared_condition(pipe.pixels(picture), engine.conditions)  # the entry the prewarm fills
        warmed = 0
        while engine.warm_one_condition_block():
            warmed += 1
            assert stream.blocks_known == warmed  # one block a call
        assert stream.fixed and warmed > 3
        assert engine.conditions.nbytes() <= engine.conditions.max_bytes

        done = len(calls)
        session = _admit(engine, image, seed=4)
        warm = _run_blocks(engine, session, warmed + 2)  # past the fixed point
        assert len(calls) == done, "a session from a prewarmed picture encoded its condition again"
        engine.shutdown()
    finally:
        handle.remove()
    pool = pipe.new_pool()
    private = Session("private", pipe, pool, PageAllocator(pool.num_pages), _request(image, PROMPT, 4))
    for block, latents in enumerate(warm):
        assert torch.equal(private.step().latents, latents), block
    private.close()


def test_the_worker_prewarms_on_its_own_then_serves_a_start(pipe, image):
    engine = Engine(pipe, EngineConfig(memory_budget_bytes=BIG, max_sessions=1))
    try:
        picture = _request(image, PROMPT, 0).picture
        engine.prewarm([picture])
        stream = pipe.shared_condition(pipe.pixels(picture), engine.conditions)  # the entry the prewarm fills
        deadline = time.monotonic() + 60
        while not stream.fixed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stream.fixed, "the idle worker did not finish the prewarm"
        session = engine.admit(_request(image, PROMPT, 1)).session_id
        assert isinstance(_take(engine, session, timeout=30), Block)
    finally:
        engine.shutdown()


def test_the_kept_condition_streams_stay_within_their_bytes(pipe, image, clock):
    engine = _engine(pipe, clock, max_sessions=1, condition_cache_bytes=0)
    first = _admit(engine, image)
    _run_blocks(engine, first, 2)
    assert len(engine.conditions) == 1  # read by a session: alive even beyond the bound
    engine.close(first)
    assert len(engine.conditions) == 0 and engine.accounted_bytes() == 0  # nothing kept at a bound of 0
    engine.shutdown()


def test_accounted_bytes_match_live_tensors_and_stay_under_the_charge(pipe, image, clock):
    engine = _engine(pipe, clock, max_sessions=3, max_lead_blocks=2)
    ids = [_admit(engine, image, seed) for seed in range(3)]
    for _ in range(6):  # 3 sessions x 2 blocks ahead
        assert engine.run_once() is not None
    assert engine.run_once() is None
    for _ in range(2):
        assert isinstance(_take(engine, ids[0]), Block)
    engine.run_once()  # ids[0] one block further: outboxes hold 1, 2 and 2 blocks

    page_bytes = engine.footprint.page_bytes
    seen: set[int] = set()
    live = 0
    for live_session in engine._sessions.values():  # the real tensors, not the accounting code
        rollout = live_session.session.rollout
        live += held_bytes(rollout, seen) + len(rollout.kv.frame_pages) * page_bytes
        live += held_bytes(list(live_session.outbox), seen)
    assert engine.accounted_bytes() == pytest.approx(live, rel=0.10)
    assert engine.pages.num_in_use * page_bytes == sum(
        len(s.session.rollout.kv.frame_pages) * page_bytes for s in engine._sessions.values())
    for session_id in ids:
        status = engine.session_status(session_id)
        assert status["bytes"] + status["blocks_waiting"] * engine.footprint.message <= engine.session_bytes
    assert engine.stats()["accounted_bytes"] <= engine.capacity * engine.session_bytes
    engine.shutdown()


# ---------------------------------------------------------------------------------------------
# Scheduling


def test_round_robin_at_block_boundaries_and_no_compute_for_idle_viewers(pipe, image, clock, monkeypatch):
    engine = _engine(pipe, clock, max_sessions=3)
    ids = [_admit(engine, image, seed, prompt=f"world {seed}") for seed in range(3)]
    calls = _counting_steps(monkeypatch, pipe)
    order = []
    for _ in range(9):  # every consumer takes each block at once: strict rotation
        session_id = engine.run_once()
        order.append(ids.index(session_id))
        assert isinstance(_take(engine, session_id), Block)
    assert order == [0, 1, 2] * 3
    assert [engine.session_status(s)["block_index"] for s in ids] == [3, 3, 3]

    # Nobody consumes: each session makes one block (the default lead) and then nothing runs.
    for _ in range(3):
        assert engine.run_once() is not None
    before = len(calls)
    for _ in range(5):
        assert engine.run_once() is None
    assert len(calls) == before
    assert [engine.session_status(s)["block_index"] for s in ids] == [4, 4, 4]

    # One viewer takes its block: only that session runs again.
    assert _take(engine, ids[1]).block_index == 3
    assert engine.run_once() == ids[1] and engine.run_once() is None
    assert calls[before:] == ["world 1"]
    engine.shutdown()


def test_lead_lets_a_session_run_ahead_by_that_many_blocks(pipe, image, clock):
    engine = _engine(pipe, clock, max_sessions=1, max_lead_blocks=3)
    session_id = _admit(engine, image)
    assert [engine.run_once() for _ in range(4)] == [session_id] * 3 + [None]
    assert [_take(engine, session_id).block_index for _ in range(3)] == [0, 1, 2]
    assert _take(engine, session_id) is None
    engine.shutdown()


def test_a_paced_session_starts_each_block_just_in_time_with_the_input_until_then(pipe, image, clock):
    engine = _engine(pipe, clock, max_sessions=1)
    session_id = _admit(engine, image)
    assert engine.run_once() == session_id  # not paced yet: as soon as the outbox has room
    assert _take(engine, session_id).block_index == 0
    engine.pace(session_id, 2.0)
    assert engine.run_once() is None  # not before its start time
    clock.now += 1.0
    engine.post_event(session_id, {"event_id": 1, "keys": ["w"]})  # pressed while the block had not started
    assert engine.run_once() is None
    clock.now += 1.0
    assert engine.run_once() == session_id
    block = _take(engine, session_id)
    assert (block.block_index, block.event_ids) == (1, (1,))
    clock.now += 100.0
    assert engine.run_once() is None  # a taken block holds the next one until its consumer paces again
    engine.pace(session_id, -0.5)  # late already: at once
    assert engine.run_once() == session_id
    engine.shutdown()


def test_input_applies_at_the_next_block_boundary(pipe, image, clock):
    engine = _engine(pipe, clock, max_sessions=1)
    session_id = _admit(engine, image)
    engine.post_event(session_id, {"event_id": 3, "keys": ["w"]})
    engine.post_event(session_id, {"event_id": 4, "frames": [["l"], ["l"], []]})
    engine.run_once()
    first = _take(engine, session_id)
    assert first.event_ids == (3, 4)
    engine.run_once()
    assert _take(engine, session_id).event_ids == ()
    with pytest.raises(EventError, match="stale"):
        engine.post_event(session_id, {"event_id": 4, "keys": []})
    frames = [b["frames"] for b in engine.replay(session_id).blocks]
    assert frames == [[["l", "w"], ["l", "w"], ["w"]], [["w"], ["w"], ["w"]]]
    engine.shutdown()


def test_a_failed_block_is_reported_and_retried_only_after_new_input(pipe, image, clock, monkeypatch):
    engine = _engine(pipe, clock, max_sessions=1)
    session_id = _admit(engine, image)
    engine.run_once()
    _take(engine, session_id)
    step = Pipeline.step

    def failing(self, pool, pages, state, control, on_stage=None):
        def hook(stage):
            if stage == "decode":
                raise RuntimeError("device lost")
        return step(self, pool, pages, state, control, hook)

    monkeypatch.setattr(Pipeline, "step", failing)
    pages = engine.pages.num_in_use
    assert engine.run_once() == session_id
    error = _take(engine, session_id)
    assert isinstance(error, Failed) and error.waiting_for_input and "device lost" in error.text
    status = engine.session_status(session_id)
    assert (status["status"], status["block_index"], status["waiting_for_input"]) == ("failed", 1, True)
    assert engine.pages.num_in_use == pages
    assert engine.run_once() is None  # no retry loop without new input
    monkeypatch.setattr(Pipeline, "step", step)
    engine.post_event(session_id, {"event_id": 0, "keys": ["s"]})
    assert engine.run_once() == session_id
    message = _take(engine, session_id)
    assert message.block_index == 1 and message.event_ids == (0,)
    assert engine.session_status(session_id)["status"] == "active"
    engine.shutdown()


# ---------------------------------------------------------------------------------------------
# Eviction and cleanup


def test_idle_ttl_closes_a_session_and_tells_its_consumer(pipe, image, clock):
    """The one idle policy: no input for idle_ttl_s closes a session, even one whose consumer watches."""
    engine = _engine(pipe, clock, max_sessions=2, idle_ttl_s=60)
    played, idle = _admit(engine, image), _admit(engine, image)
    for event_id in range(4):
        clock.now += 25  # both are watched; only `played` gets input
        engine.post_event(played, {"event_id": event_id, "keys": ["w"]})
        engine.run_once()
        _take(engine, played)
        _take(engine, idle)
    assert engine.session_ids() == [played]
    message = _take(engine, idle)
    assert message == Closed("no input for 60 s", CloseCause.IDLE) and message.idle
    assert engine.next_message(idle, timeout=0) == message  # and so on, while the engine remembers it
    assert engine.session_status(idle) == {"status": "closed", "closed_reason": message.reason}
    with pytest.raises(UnknownSession, match="closed: no input"):
        engine.post_event(idle, {"event_id": 0, "keys": []})
    with pytest.raises(UnknownSession, match="never existed"):
        engine.next_message("nope", timeout=0)
    engine.close(played, "consumer disconnected")
    assert engine.pages.num_in_use == 0
    assert engine.accounted_bytes() == engine.conditions.nbytes() <= engine.conditions.max_bytes
    assert _take(engine, played) == Closed("consumer disconnected")
    engine.shutdown()


def test_a_queued_viewer_is_told_its_place_as_it_moves_up_then_gets_its_world(pipe, image, clock):
    """Gap of the redesign: the line is messages, not polling. A place receives Waiting(position) on joining and
    at each change, in decreasing order, then NewWorld once the engine seats it, then its blocks."""
    engine = _engine(pipe, clock, max_sessions=1, max_waiting=3, evictable_after_s=1000)
    seated = _admit(engine, image)
    places = [engine.admit(_request(image, PROMPT, seed)) for seed in (1, 2, 3)]
    assert [(t.admission, t.position) for t in places] == [(Admission.WAITING, p) for p in (1, 2, 3)]
    first, second, third = (t.session_id for t in places)
    received = []

    def drain(session_id):
        while (message := engine.next_message(session_id, timeout=0)) is not None:
            received.append(message)
            if isinstance(message, NewWorld):
                return

    drain(third)
    assert received == [Waiting(3)]
    engine.close(seated)  # a seat frees: the engine seats the first in line itself
    engine.close(second, "the viewer left the line")  # someone ahead leaves
    assert engine.session_ids() == [first] and engine.stats()["waiting"] == 1
    drain(third)
    assert received == [Waiting(3), Waiting(2), Waiting(1)]
    assert engine.next_message(second, timeout=0) == Closed("the viewer left the line")
    engine.close(first)
    drain(third)
    assert received[:3] == [Waiting(3), Waiting(2), Waiting(1)] and isinstance(received[3], NewWorld)
    assert len(received) == 4 and engine.session_ids() == [third]
    assert engine.run_once() == third
    assert isinstance(engine.next_message(third, timeout=0), Block)
    engine.shutdown()
    assert engine.pages.num_in_use == 0


def test_lru_idle_session_is_evicted_for_a_newcomer(pipe, image, clock):
    engine = _engine(pipe, clock, max_sessions=2, evictable_after_s=10, idle_ttl_s=1000)
    old, recent = _admit(engine, image), _admit(engine, image)
    for session_id in (old, recent):
        engine.run_once()
    clock.now += 5
    engine.post_event(recent, {"event_id": 0, "keys": ["w"]})
    ticket = engine.admit(_request(image, PROMPT, 1))
    assert ticket.admission is Admission.WAITING  # nobody idle long enough yet
    clock.now += 5.5  # old idle 10.5 s, recent 5.5 s
    engine.next_message(ticket.session_id, timeout=0)  # its consumer reads its place (Waiting(1))
    clock.now += 0.5
    # The engine seats the line before each block, evicting `old`; then the newcomer runs (`recent`'s block 0
    # waits untaken in its outbox).
    assert engine.run_once() == ticket.session_id
    assert set(engine.session_ids()) == {recent, ticket.session_id}
    assert isinstance(engine.next_message(ticket.session_id, timeout=0), NewWorld)
    assert "evicted" in _take(engine, old).reason
    window = CONFIG.transformer.sliding_window_num_frames - BLOCK
    assert engine.pages.num_in_use == 2 * BLOCK  # `recent`'s and the newcomer's block 0 pages
    assert engine.pages.num_pages == 2 * window + BLOCK
    engine.shutdown()
    assert engine.pages.num_in_use == 0


def test_reset_drops_the_old_world_and_keeps_event_ids_monotonic(pipe, image, clock):
    engine = _engine(pipe, clock, max_sessions=1, max_lead_blocks=2)
    session_id = _admit(engine, image)
    engine.post_event(session_id, {"event_id": 5, "keys": ["w"]})
    for _ in range(2):
        engine.run_once()
    engine.post_event(session_id, {"event_id": 6, "keys": ["a"]})
    engine.reset(session_id, _request(np.flipud(image).copy(), "a new world", 9))
    world = engine.next_message(session_id, timeout=0)  # old blocks dropped: the new world comes next
    assert isinstance(world, NewWorld) and (world.replay.seed, world.replay.blocks) == (9, [])
    assert engine.next_message(session_id, timeout=0) is None
    assert engine.pages.num_in_use == 0
    with pytest.raises(EventError, match="stale"):
        engine.post_event(session_id, {"event_id": 6, "keys": []})
    engine.post_event(session_id, {"event_id": 7, "keys": ["d"]})
    engine.run_once()
    message = _take(engine, session_id)
    assert (message.block_index, message.event_ids) == (0, (7,))
    replay = engine.replay(session_id)
    assert (replay.seed, replay.prompt, len(replay.blocks)) == (9, "a new world", 1)
    engine.shutdown()


def test_the_outbox_tells_each_world_and_its_blocks_and_builds_the_replay(pipe, image, clock):
    """A consumer that keeps only what it drains (a NewWorld's header, each Block's replay entry) holds the
    session's replay exactly, across a reset, without ever reading the session."""
    engine = _engine(pipe, clock, max_sessions=1, max_lead_blocks=2)
    session_id = _admit(engine, image, seed=2)
    built = []

    def drain():
        while (message := engine.next_message(session_id, timeout=0)) is not None:
            if isinstance(message, NewWorld):
                built.append(dataclasses.replace(message.replay, blocks=[]))
            else:
                assert isinstance(message, Block)
                built[-1].blocks.append(message.replay_entry)

    engine.post_event(session_id, {"event_id": 1, "keys": ["w"]})
    for _ in range(3):
        engine.run_once()
        drain()
    assert len(built) == 1 and built[0] == engine.replay(session_id) and len(built[0].blocks) == 3
    engine.post_event(session_id, {"event_id": 2, "frames": [["l"], [], []], "prompt": "a new prompt"})
    engine.run_once()  # left in the outbox: the reset drops it
    engine.reset(session_id, _request(image, "another world", 3))
    engine.run_once()
    drain()
    assert len(built) == 2 and built[1] == engine.replay(session_id)
    assert (built[1].seed, built[1].prompt, len(built[1].blocks)) == (3, "another world", 1)
    entry = engine.replay(session_id).blocks[0]
    entry["frames"].append("changed")  # a copy: the session's log is its own
    assert engine.replay(session_id).blocks[0] != entry
    engine.shutdown()


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow  # a minute or more on 2 cores: .ci/run runs it, the fast suite does not
def test_a_thousand_sessions_through_every_exit_leave_an_empty_pool_and_flat_rss(image, clock, monkeypatch):
    pipe = _pipeline(MICRO)
    engine = Engine(pipe, EngineConfig(memory_budget_bytes=BIG, max_sessions=2, idle_ttl_s=60, evictable_after_s=10),
                    clock=clock, start_worker=False)
    step = Pipeline.step
    fail_next = []

    def fail_at_commit(stage):
        if stage == "commit":
            raise RuntimeError("injected")

    def maybe_failing(self, pool, pages, state, control, on_stage=None):
        if fail_next:
            fail_next.pop()
            on_stage = fail_at_commit
        return step(self, pool, pages, state, control, on_stage)

    monkeypatch.setattr(Pipeline, "step", maybe_failing)
    sessions, rss = [], []
    for cycle in range(1000):
        if cycle == 100:
            gc.collect()
            rss.append(_rss_bytes())
        session_id = _admit(engine, image, seed=cycle)
        sessions.append(weakref.ref(engine._sessions[session_id].session))
        engine.post_event(session_id, {"event_id": 0, "keys": ["w"]})
        assert engine.run_once() == session_id
        path = cycle % 6
        if path == 0:  # watched, then closed by the user
            _take(engine, session_id)
            engine.close(session_id)
        elif path == 1:  # reset into a new world, one more block, then the consumer disconnects
            engine.reset(session_id, _request(image, "another world", cycle, MICRO))
            engine.run_once()
            engine.close(session_id, "consumer disconnected")
        elif path == 2:  # nobody watches: the idle TTL closes it
            clock.now += 61
            assert engine.run_once() is None
        elif path == 3:  # a failed block, then a good one, then closed
            _take(engine, session_id)
            fail_next.append(True)
            engine.run_once()
            engine.post_event(session_id, {"event_id": 1, "keys": []})
            engine.run_once()
            engine.close(session_id)
        elif path == 4:  # evicted while idle to make room for two newcomers
            clock.now += 11
            others = [_admit(engine, image), _admit(engine, image)]
            assert session_id not in engine.session_ids()
            for other in others:
                engine.run_once()
                engine.close(other)
        else:  # the server shuts its sessions down at the end of a run of blocks
            _take(engine, session_id)
            for _ in range(2):
                engine.run_once()
            engine.close(session_id, "server shutting down")
        assert engine.pages.num_in_use == 0, f"cycle {cycle} (path {path}) leaked pages"
        assert engine.session_ids() == [] and engine.accounted_bytes() == engine.conditions.nbytes() <= engine.conditions.max_bytes
    gc.collect()
    rss.append(_rss_bytes())
    alive = [cycle for cycle, ref in enumerate(sessions) if ref() is not None]
    assert not alive, f"closed sessions of cycles {alive[:12]} are still referenced"
    assert engine.pages.num_free == engine.pages.num_pages
    assert rss[1] - rss[0] < 24 * 2**20, f"RSS grew by {(rss[1] - rss[0]) / 2**20:.1f} MiB over 900 cycles"
    engine.shutdown()


# ---------------------------------------------------------------------------------------------
# The worker thread


def test_worker_thread_stream_equals_the_offline_command(pipe, image):
    """Real threads and timing: which block takes which event depends on timing, the replay records it,
    and the offline rollout of the replay equals the streamed latents."""
    with Engine(pipe, EngineConfig(memory_budget_bytes=BIG, max_sessions=2)) as engine:
        session_id = _admit(engine, image, seed=4)
        latents = []
        for event_id, keys in enumerate((["w"], ["w", "l"], [], ["i"])):
            engine.post_event(session_id, {"event_id": event_id, "keys": keys})
            message = _take(engine, session_id, timeout=120)
            assert isinstance(message, Block), message
            latents.append(message.latents)
        replay = engine.replay(session_id)
        blocks = len(replay.blocks)
        assert blocks >= len(latents)
    assert engine.pages.num_in_use == 0
    controls = controls_from_events(read_events(replay.to_events_jsonl(), BLOCK), pipe.config)
    offline = [o.latents for o in pipe.rollout(image, PROMPT, 4, controls[:len(latents)])]
    for block, (a, b) in enumerate(zip(latents, offline)):
        assert torch.equal(a, b), f"block {block}"
    applied = sorted(i for b in replay.blocks for i in b["event_ids"])
    assert applied == list(range(len(applied)))  # every applied event once, in order


def test_all_model_work_runs_on_the_one_worker_thread(pipe, image, monkeypatch):
    """Loading, the footprint probe, admission, blocks, reset and close all run on the worker, the one thread
    that runs kernels (see engine.py), and an error raised there reaches the thread that asked."""
    seen = []
    for name in ("start_request", "step", "new_pool"):
        original = getattr(Pipeline, name)

        def recorded(self, *args, _original=original, _name=name, **kwargs):
            seen.append((_name, threading.current_thread().name))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(Pipeline, name, recorded)

    def loader() -> Pipeline:
        seen.append(("load", threading.current_thread().name))
        return pipe

    with Engine(loader, EngineConfig(memory_budget_bytes=BIG, max_sessions=1)) as engine:
        session_id = _admit(engine, image)
        engine.post_event(session_id, {"event_id": 0, "keys": ["w"]})
        message = _take(engine, session_id, timeout=120)
        assert isinstance(message, Block), message
        assert message.pixels.dtype == np.uint8
        first_block_frames = CONFIG.pixel_frames_per_block - (CONFIG.vae_temporal_factor - 1)  # frame 0 decodes to 1
        assert message.pixels.shape == (first_block_frames, CONFIG.height, CONFIG.width, 3)
        engine.reset(session_id, _request(image, "a harbour at night", 1))
        with pytest.raises(UnknownSession):
            engine.reset("no-such-session", _request(image, PROMPT, 0))  # raised on the worker, re-raised here
        engine.close(session_id)
        assert engine.pages.num_in_use == 0
    assert {what for what, _ in seen} == {"load", "start_request", "step", "new_pool"}
    assert {thread for _, thread in seen} == {"lingbot-engine"}, seen


# ---------------------------------------------------------------------------------------------
# examples/realtime.py


def _realtime_example():
    path = Path(__file__).resolve().parents[1] / "examples" / "realtime.py"
    spec = importlib.util.spec_from_file_location("realtime_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_realtime_example_saves_every_block_and_a_replay_that_reproduces_it(pipe, image, tmp_path):
    script = "\n".join(json.dumps(e) for e in [
        {"event_id": 0, "keys": ["w"]}, {"event_id": 2, "frames": [["l"], ["l"], []], "prompt": "a quiet harbour"},
        {"event_id": 3, "keys": []}, {"event_id": 7, "keys": ["s", "d"]}])
    events = read_events(script, BLOCK)
    _realtime_example().run(pipe, image, PROMPT, 5, events, tmp_path, log=lambda *_: None)

    replay = Replay.from_json((tmp_path / "replay.json").read_text())
    assert [b["event_ids"] for b in replay.blocks] == [[0], [2], [3], [7]]
    controls = controls_from_events(read_events((tmp_path / "replay.jsonl").read_text(), BLOCK), pipe.config)
    offline = list(pipe.rollout(image, PROMPT, 5, controls))
    for block, output in enumerate(offline):
        assert torch.equal(torch.load(tmp_path / f"block_{block:05d}_latents.pt"), output.latents), block
        np.testing.assert_array_equal(np.load(tmp_path / f"block_{block:05d}_frames.npy"),
                                      frames_to_uint8(output.frames))
    assert count_frames(tmp_path / "rollout.mp4")[0] == CONFIG.pixel_frames_for_blocks(len(events))


def test_first_events_apply_to_the_first_block_seated_at_once_or_from_the_line(pipe, image, clock):
    """admit(request, first_events): queued before the session can run (a protocol init's camera actions)."""
    from lingbot_core.boundary.events import KeyStateEvent, ScriptEvent

    engine = _engine(pipe, clock, max_sessions=1)
    script = ScriptEvent(0, (frozenset("w"), frozenset(), frozenset("a")))
    first = engine.admit(_request(image, PROMPT, 0), (script,))
    waiting = engine.admit(_request(image, PROMPT, 1), (KeyStateEvent(0, frozenset("l")),))
    assert first.admission is Admission.ADMITTED and waiting.admission is Admission.WAITING
    assert engine.run_once() == first.session_id
    assert _take(engine, first.session_id).replay_entry == {"frames": [["w"], [], ["a"]], "event_ids": [0]}
    engine.close(first.session_id)
    assert engine.run_once() == waiting.session_id  # seated, then its first block
    assert isinstance(engine.next_message(waiting.session_id, 0), Waiting)
    assert _take(engine, waiting.session_id).replay_entry == {"frames": [["l"]] * BLOCK, "event_ids": [0]}
    engine.close(waiting.session_id)
    assert engine.pages.num_in_use == 0
