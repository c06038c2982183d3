"""Across real processes: the vLLM-Omni backend (lingbot_core/protocols/vllm_omni/backend.py) plays worlds that our
own server (`python -m lingbot_core.serve`, tiny preset, its `/v1/realtime/video` route) generates in other
processes, over real WebSockets.

Oracle: each world received is the world its replay describes. The replay the backend builds (from the chunks'
event lists and the interactions it sent) is run offline in this process with the same seeded tiny model, one
thread as the servers run, through the same fMP4 writer and reader as the wire: the frames must be equal, for keys
(as velocities), a prompt switch, a reset, a viewer seated from the line and a restart after a server is killed.
"""

from __future__ import annotations

import numpy as np
import pytest

from test_remote_e2e import oracle, regenerate_blocks, spawn  # noqa: F401 (fixtures)
from lingbot_core.boundary.events import KeyStateEvent, PromptEvent
from lingbot_core.boundary.fmp4 import Fmp4Reader, Fmp4Writer
from lingbot_core.boundary.requests import parse_start
from lingbot_core.protocols.model_config import remote_model_config
from lingbot_core.protocols.remote_engine import RemoteConfig
from lingbot_core.protocols.vllm_omni.backend import VllmOmniEngine
from lingbot_core.serving.contract import Admission, Block, EngineConfig, Failed, NewWorld, Waiting

pytestmark = pytest.mark.slow  # servers in other processes: .ci/run runs these, the fast suite does not
WAIT_S = 60.0


def through_the_wire(pipeline, request, entries: list[dict]) -> list[np.ndarray]:
    """The world a replay describes, made offline, each block through a new stream's fMP4 writer and reader as the
    server and the backend pass it."""
    config = pipeline.config
    writer, reader = Fmp4Writer(config.width, config.height, config.fps), Fmp4Reader()
    return [np.stack(reader.feed(writer.add(frames))) for frames in regenerate_blocks(pipeline, request, entries)]


def take(engine, session_id: str):
    """The session's next message (bounded so a bug fails instead of hanging)."""
    message = engine.next_message(session_id, timeout=WAIT_S)
    assert message is not None, "no message within the bound"
    return message


def world(engine, session_id: str, blocks: int, until=None) -> list[Block]:
    """`blocks` blocks of the session's current world (after `until(block)` first holds, if given)."""
    got: list[Block] = []
    while len(got) < blocks or (until is not None and not any(until(b) for b in got)):
        message = take(engine, session_id)
        if isinstance(message, NewWorld):
            got = []
        elif isinstance(message, Block):
            got.append(message)
    return got


def check(oracle, request, blocks: list[Block]) -> None:
    expected = through_the_wire(oracle, request, [b.replay_entry for b in blocks])
    for index, (block, frames) in enumerate(zip(blocks, expected, strict=True)):
        assert np.array_equal(block.pixels, frames), f"block {index} differs from its replay"


def test_three_viewers_on_two_servers_with_keys_a_prompt_a_reset_and_a_killed_server(spawn, oracle, start_image):
    servers = [spawn("--max-sessions", "1", "--max-waiting", "0") for _ in range(2)]
    config = remote_model_config("tiny")
    engine = VllmOmniEngine([s.url for s in servers], config, EngineConfig(max_waiting=2),
                            RemoteConfig(receive_timeout_s=30, open_timeout_s=10, backoff_s=0.5))
    requests = [parse_start(start_image, "a harbour at dawn", seed, config) for seed in (1, 2, 3)]
    try:
        tickets = [engine.admit(request) for request in requests]
        assert [t.admission for t in tickets] == [Admission.ADMITTED, Admission.ADMITTED, Admission.WAITING]
        one, two, three = (t.session_id for t in tickets)
        assert isinstance(take(engine, three), Waiting)

        # viewer one: W held, then a prompt switch; every block regenerates from its replay
        first = world(engine, one, 1)
        engine.post_event(one, KeyStateEvent(1, frozenset({"w"})))
        engine.post_event(one, PromptEvent(2, "a harbour at night"))
        later = world(engine, one, 3, until=lambda b: 2 in b.event_ids)
        assert any("poses" in b.replay_entry for b in later) and any("prompt" in b.replay_entry for b in later)
        check(oracle, requests[0], first + later)
        # a reset: a new world on the same seat
        other = parse_start(start_image, "a harbour at noon", 9, config)
        engine.reset(one, other)
        check(oracle, other, world(engine, one, 2))

        # viewer two leaves: viewer three takes its seat from the line
        engine.close(two)
        seated = world(engine, three, 2)
        check(oracle, requests[2], seated)
        host = engine.session_status(three)["server"]

        # viewer three's server is killed mid-world: told which and why, restarted on the other seat
        engine.close(one)  # frees the other server
        next(s for s in servers if s.url == host).kill()
        failed = take(engine, three)
        while not isinstance(failed, Failed):
            failed = take(engine, three)
        assert host in failed.text and "restarts" in failed.text
        check(oracle, requests[2], world(engine, three, 2))
        assert engine.session_status(three)["server"] != host
        engine.close(three)
    finally:
        engine.shutdown()


def test_the_page_over_vllm_omni_servers_in_other_processes(spawn, tmp_path):
    from test_vllm_omni_backend import drive_the_page
    from lingbot_core.protocols.vllm_omni.backend import create_vllm_omni_engine

    servers = [spawn("--max-sessions", "1", "--max-waiting", "0") for _ in range(2)]
    engine = create_vllm_omni_engine([s.url for s in servers], environ={"LINGBOT_TEST_PRESET": "tiny"},
                                     remote=RemoteConfig(receive_timeout_s=30, open_timeout_s=10))
    try:
        drive_the_page(engine, tmp_path)
    finally:
        engine.shutdown()
