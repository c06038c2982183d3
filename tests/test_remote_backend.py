"""The SGLang backend (lingbot_core/protocols/sglang/backend.py over protocols/remote_engine.py) against in-process upstream-like servers over real
WebSockets (tests/fake_upstream.py: one session per server, as upstream).

Oracles: each Block's pixels are exactly the frames the server sent for that chunk of that session; the
events the server received are the ones posted, under the same ids; the download's MP4 holds as many frames
as the blocks received. Time: nothing asserts on the wall clock; waits are bounded only so a bug fails
instead of hanging, and the idle TTL runs on an injected clock.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import numpy as np
import pytest

from fake_upstream import BUSY_TEXT, FakeUpstream
from outbox import take
from lingbot_core.config import tiny_config
from lingbot_core.boundary.events import EventError, KeyStateEvent, ScriptEvent
from lingbot_core.boundary.offline import RenderRequest, controls_from_events
from lingbot_core.model.camera import CameraState
from lingbot_core.protocols.sglang.backend import RemoteConfig, SglangEngine
from lingbot_core.serving.contract import RenderRefused
from lingbot_core.protocols.pool import ServerPool, ServerState
from lingbot_core.boundary.requests import parse_start
from lingbot_core.serving.contract import (Admission, AdmissionRefused, Block, Closed, EngineConfig, Failed,
                                           NewWorld, UnknownSession, Waiting)
from lingbot_core.serving.streaming import LiveService, StreamConfig
from lingbot_core.boundary.video import count_frames

CONFIG = tiny_config()  # 64x32 pixels, 3 latent frames a block
PROMPT = "a harbour at dawn"
WAIT_S = 20.0  # a bound so a bug fails instead of hanging, not a speed figure


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def servers():
    made = []

    def make(**kwargs) -> FakeUpstream:
        server = FakeUpstream(width=CONFIG.width, height=CONFIG.height, **kwargs)
        made.append(server)
        return server

    yield make
    for server in made:
        server.stop()


@pytest.fixture
def request_for(start_image):
    return lambda seed=3, prompt=PROMPT: parse_start(start_image, prompt, seed, CONFIG)


def engine_for(*servers_or_urls, clock=time.monotonic, **config) -> SglangEngine:
    urls = [s if isinstance(s, str) else s.url for s in servers_or_urls]
    remote = RemoteConfig(receive_timeout_s=10, open_timeout_s=5, **config.pop("remote", {}))
    return SglangEngine(urls, CONFIG, EngineConfig(**config), remote, clock=clock)


def sent_frames(server: FakeUpstream, session: int, chunk: int) -> np.ndarray:
    with server.lock:
        index, _, frames = server.chunks[session][chunk]
    assert index == chunk
    return frames


def wait_for(predicate, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def no_remote_threads() -> bool:
    return not any(t.name.startswith("lingbot-remote") and t.is_alive() for t in threading.enumerate())


def test_a_world_plays_with_keys_prompt_reset_and_stop(servers, request_for):
    server = servers()
    engine = engine_for(server)
    try:
        ticket = engine.admit(request_for())
        assert ticket.admission is Admission.ADMITTED
        sid = ticket.session_id
        world = take(engine, sid, NewWorld)
        assert (world.replay.seed, world.replay.prompt, world.replay.model) == (3, PROMPT, "tiny")
        first = take(engine, sid)
        assert first.block_index == 0 and first.latents is None
        np.testing.assert_array_equal(first.pixels, sent_frames(server, 0, 0))
        assert first.block_ms == 600.0 and first.stage_ms["chunk_total"] == 650.0
        assert first.source["server"] == server.url
        init = server.inits[0]
        assert (init["size"], init["seed"], init["prompt"], init["realtime_output_format"]) == \
            ("64x32", 3, PROMPT, "raw")
        assert init["realtime_output_pacing"] is True and init["first_frame"][:8] == b"\x89PNG\r\n\x1a\n"

        engine.post_event(sid, KeyStateEvent(1, frozenset({"w"})))
        with pytest.raises(EventError, match="stale"):
            engine.post_event(sid, {"event_id": 1, "keys": ["a"]})
        while True:  # the blocks the server made before the event arrived carry no event
            block = take(engine, sid)
            np.testing.assert_array_equal(block.pixels, sent_frames(server, 0, block.block_index))
            if block.event_ids:
                break
        assert block.replay_entry == {"frames": [["w"]] * 3, "event_ids": [1]}
        engine.post_event(sid, {"event_id": 5, "keys": ["w", "j"], "prompt": "the harbour at night"})
        while not (block := take(engine, sid)).event_ids:
            pass
        assert block.replay_entry == {"frames": [["j", "w"]] * 3, "event_ids": [5], "prompt": "the harbour at night"}
        assert [e["event_id"] for e in server.events[0]] == [1, 5]
        assert server.events[0][0]["payload"] == {"mode": "state", "transitions": [{"actions": ["w"]}]}
        assert server.events[0][1]["kind"] == "composite_input"
        assert engine.replay(sid).blocks[-1] == block.replay_entry

        engine.reset(sid, request_for(seed=9))
        world = take(engine, sid, NewWorld)  # old-world blocks not taken were dropped
        assert world.replay.seed == 9 and world.replay.blocks == []
        block = take(engine, sid)
        assert block.block_index == 0
        np.testing.assert_array_equal(block.pixels, sent_frames(server, 1, 0))
        assert len(server.inits) == 2 and server.inits[1]["seed"] == 9
        engine.post_event(sid, KeyStateEvent(6, frozenset({"s"})))  # ids go on increasing across the reset
        while not take(engine, sid).event_ids:
            pass
        assert server.events[1][0]["event_id"] == 6

        engine.close(sid, "stopped by the user")
        assert engine.next_message(sid) == Closed("stopped by the user")
        with pytest.raises(UnknownSession, match="stopped by the user"):
            engine.post_event(sid, KeyStateEvent(7, frozenset()))
        wait_for(lambda: server.open_connections() == 0, "the server's sockets to close")
        assert engine.stats()["active_sessions"] == 0
        wait_for(lambda: not any(t.name == f"lingbot-remote-{sid[:8]}" for t in threading.enumerate()),
                 "the session's thread to end")  # before shutdown: a closed session leaves no thread
    finally:
        engine.shutdown()
    assert no_remote_threads()


def test_the_stream_records_and_downloads_what_the_server_sent(servers, start_image, tmp_path):
    server = servers()
    engine = engine_for(server)
    service = LiveService(engine, tmp_path / "recordings", StreamConfig(poll_s=0.05))

    async def play():
        updates, blocks = [], []
        async for update in service.stream(start_image, PROMPT, 4, viewer="viewer"):
            updates.append(update)
            if update.block is not None:
                blocks.append(update.block)
            if len(blocks) == 3:
                break
        return updates, blocks

    try:
        updates, blocks = asyncio.run(play())
        sid = updates[-1].session_id
        assert "from " + server.url in updates[-1].telemetry and "1/1 remote servers up" in updates[-1].telemetry
        mp4, replay_path = service.download(sid, "viewer")
        frames, _ = count_frames(mp4)
        assert frames == sum(len(b.pixels) for b in blocks) == 9 + 12 + 12
        for block in blocks:
            np.testing.assert_array_equal(block.pixels, sent_frames(server, 0, block.block_index))
        replay = json.loads(replay_path.read_text())
        assert replay["seed"] == 4 and len(replay["blocks"]) == 3
    finally:
        service.shutdown()
        engine.shutdown()
    wait_for(lambda: server.open_connections() == 0, "the stream's socket to close")
    assert no_remote_threads()


def test_a_busy_server_is_skipped(servers, request_for):
    busy, free = servers(busy=True), servers()
    engine = engine_for(busy, free)
    try:
        sid = engine.admit(request_for()).session_id
        assert isinstance(engine.next_message(sid, timeout=WAIT_S), NewWorld)  # no Failed: nothing was shown
        block = take(engine, sid)
        np.testing.assert_array_equal(block.pixels, sent_frames(free, 0, 0))
        assert busy.refused == 1 and block.source["server"] == free.url
        stats = engine.stats()
        assert (stats["servers_busy"], stats["servers_up"]) == (1, 1)
        assert BUSY_TEXT in engine.pool.servers[0].problem
    finally:
        engine.shutdown()


def test_a_server_killed_mid_stream_fails_the_world_which_restarts_on_the_next_seat(servers, request_for):
    first, second = servers(), servers()
    engine = engine_for(first, second)
    try:
        a = engine.admit(request_for(seed=1)).session_id
        take(engine, a)
        assert engine.session_status(a)["server"] == first.url
        b = engine.admit(request_for(seed=2)).session_id  # the other seat
        take(engine, b)
        first.kill()
        failed = take(engine, a, Failed, skip=(Block,))
        assert first.url in failed.text and "restarts" in failed.text
        assert take(engine, a, Waiting, skip=()) == Waiting(1)  # back in line, first: the other seat is taken
        assert engine.stats()["servers_down"] == 1
        engine.close(b)
        # (On a slow machine the dead server's 2 s backoff may run out first: one more Failed, then this.)
        world = take(engine, a, NewWorld, skip=(Waiting, Failed))
        assert world.replay.seed == 1
        block = take(engine, a)
        assert block.block_index == 0 and block.source["server"] == second.url
        np.testing.assert_array_equal(block.pixels, sent_frames(second, 1, 0))  # the 2nd session on that server
    finally:
        engine.shutdown()
    assert no_remote_threads()


def test_restarts_are_bounded_then_the_world_closes_with_the_reason(servers, request_for):
    server = servers()
    engine = engine_for(server, remote={"max_restarts": 0})
    try:
        sid = engine.admit(request_for()).session_id
        take(engine, sid)
        server.kill()
        closed = take(engine, sid, Closed, skip=(Block, NewWorld))
        assert server.url in closed.reason and "gave up" in closed.reason
    finally:
        engine.shutdown()


def test_an_unreachable_server_is_marked_down_and_the_next_one_serves(servers, request_for):
    dead = servers()
    dead.stop()
    alive = servers()
    engine = engine_for(dead.url, alive)
    try:
        sid = engine.admit(request_for()).session_id
        failed = take(engine, sid, Failed, skip=())
        assert dead.url in failed.text and "could not be reached" in failed.text
        take(engine, sid, NewWorld)
        np.testing.assert_array_equal(take(engine, sid).pixels, sent_frames(alive, 0, 0))
        assert engine.pool.servers[0].state is ServerState.DOWN
    finally:
        engine.shutdown()


def test_a_server_playing_another_size_is_refused_clearly(servers, request_for):
    other = servers()
    other.width = 32  # serves 32x32 frames to a 64x32 app
    engine = engine_for(other, remote={"max_restarts": 0})
    try:
        sid = engine.admit(request_for()).session_id
        closed = take(engine, sid, Closed, skip=())
        assert "sent 32x32 frames, this app plays 64x32" in closed.reason
    finally:
        engine.shutdown()


def test_two_servers_three_viewers_the_third_waits_then_is_seated(servers, request_for):
    one, two = servers(), servers()
    engine = engine_for(one, two, max_waiting=1)
    try:
        tickets = [engine.admit(request_for(seed=seed)) for seed in (1, 2, 3)]
        assert [t.admission for t in tickets] == [Admission.ADMITTED, Admission.ADMITTED, Admission.WAITING]
        assert tickets[2].position == 1
        with pytest.raises(AdmissionRefused, match="every remote server is taken"):
            engine.admit(request_for(seed=4))
        third = tickets[2].session_id
        assert engine.next_message(third, timeout=0) == Waiting(1)
        stats = engine.stats()
        assert (stats["active_sessions"], stats["waiting"], stats["capacity"]) == (2, 1, 2)
        take(engine, tickets[0].session_id)
        engine.close(tickets[0].session_id, "stopped by the user")
        world = take(engine, third, NewWorld, skip=())
        assert world.replay.seed == 3
        block = take(engine, third)
        np.testing.assert_array_equal(block.pixels, sent_frames(one, 1, 0))  # the freed server's next session
    finally:
        engine.shutdown()
    assert no_remote_threads()


def test_idle_ttl_closes_the_socket(servers, request_for):
    server = servers()
    clock = FakeClock()
    engine = engine_for(server, clock=clock, idle_ttl_s=30.0)
    try:
        sid = engine.admit(request_for()).session_id
        take(engine, sid)
        clock.now += 20
        engine.post_event(sid, KeyStateEvent(1, frozenset({"d"})))  # input restarts the TTL
        clock.now += 20
        engine.housekeeping()
        assert engine.session_status(sid)["status"] == "active"
        clock.now += 11
        engine.housekeeping()
        closed = take(engine, sid, Closed, skip=(Block, NewWorld))
        assert closed.idle and "no input for 30 s" in closed.reason
        wait_for(lambda: server.open_connections() == 0, "the server's socket to close")
        assert engine.stats()["active_sessions"] == 0
    finally:
        engine.shutdown()


def test_backpressure_holds_the_reader_at_the_lead(servers, request_for):
    server = servers(interval_s=0.01)
    engine = engine_for(server, max_lead_blocks=1)
    try:
        sid = engine.admit(request_for()).session_id
        wait_for(lambda: engine.session_status(sid)["blocks_waiting"] == 2, "two blocks to wait unread")
        time.sleep(0.3)  # the server keeps sending meanwhile; the reader must not take more
        assert engine.session_status(sid)["blocks_waiting"] == 2
        take(engine, sid, NewWorld)
        assert [take(engine, sid).block_index for _ in range(4)] == [0, 1, 2, 3]  # none lost
    finally:
        engine.shutdown()


def test_offline_render_over_one_server(servers, request_for, tmp_path, start_image):
    server = servers()
    engine = engine_for(server)
    try:
        controls = controls_from_events([ScriptEvent(0, (frozenset({"w"}),) * 3),
                                         KeyStateEvent(1, frozenset({"a"}))], engine.model_config)
        out = tmp_path / "out.mp4"
        assert engine.render(RenderRequest(request_for(), tuple(controls)), out) == 2
        assert count_frames(out)[0] == 9 + 12
        init = server.inits[0]
        assert init["max_chunks"] == 2 and init["condition_inputs"]["camera_actions"] == [["w"]] * 3 + [["a"]] * 3
        with pytest.raises(RenderRefused, match="trajectories"):
            engine.render(RenderRequest(request_for(), tuple(controls), CameraState(np.eye(4))), out)
        assert engine.stats()["active_sessions"] == 0 and engine.pool.servers[0].holder is None
    finally:
        engine.shutdown()


def test_server_pool_backoff_doubles_and_resets():
    pool = ServerPool(["ws://a:1", "ws://b:1"], backoff_s=2.0, max_backoff_s=5.0)
    a = pool.take("s1", now=0.0)
    assert a.url == "ws://a:1"
    pool.release(a, "s1")
    assert [pool.mark(a, ServerState.DOWN, "cut", now=0.0) for _ in range(3)] == [2.0, 4.0, 5.0]
    assert pool.take("s2", now=1.0).url == "ws://b:1"  # a waits out its backoff
    assert pool.take("s3", now=1.0) is None
    assert pool.take("s3", now=5.0) is a
    pool.mark_ok(a)
    assert (a.state, a.failures) == (ServerState.UP, 0)
    with pytest.raises(ValueError, match="more than once"):
        ServerPool(["ws://a:1", "ws://a:1"])
    with pytest.raises(ValueError, match="ws://host:port"):
        ServerPool(["http://a:1"])


def test_a_place_in_line_can_be_withdrawn_or_expires_unread(servers, request_for):
    server = servers()
    clock = FakeClock()
    engine = engine_for(server, clock=clock, ticket_ttl_s=30.0)
    try:
        seated = engine.admit(request_for(seed=1)).session_id
        waiting = engine.admit(request_for(seed=2))
        assert waiting.admission is Admission.WAITING
        assert not engine.withdraw(seated) and engine.withdraw(waiting.session_id, "the viewer left")
        assert engine.next_message(waiting.session_id) == Closed("the viewer left")
        unread = engine.admit(request_for(seed=3)).session_id
        clock.now += 31  # nobody reads its outbox
        engine.post_event(seated, KeyStateEvent(1, frozenset()))  # the seated one is not idle
        engine.housekeeping()
        assert "nobody waited for 30 s" in engine.next_message(unread).reason
        assert engine.stats()["waiting"] == 0 and engine.session_status(seated)["status"] == "active"
    finally:
        engine.shutdown()
