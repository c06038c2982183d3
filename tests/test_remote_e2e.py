"""Across real processes: the remote backend (lingbot_core/protocols/sglang/backend.py) plays worlds that our own protocol
server (`python -m lingbot_core.serve`, tiny preset) generates in other processes, over real WebSockets.

Oracle: what a viewer receives remotely is the world the model makes. Each received world's replay (built by
the backend from the chunks and the events it sent) is run offline in this process with the same seeded tiny
model, one thread as the servers run, and its frames must equal the received frames exactly: keys, a prompt
switch, a reset and a restart on another server all included. Waits are bounded so a bug fails instead of
hanging; nothing asserts on the wall clock.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import av
import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from app_driver import FOREST, VILLAGE, free_port, stream_outputs
from gradio_client import Client, handle_file
from outbox import take
from lingbot_core.boundary.events import KeyStateEvent, read_events
from lingbot_core.boundary.offline import controls_from_events
from lingbot_core.serving.replay import Replay
from lingbot_core.protocols.sglang.backend import RemoteConfig, SglangEngine, create_remote_engine, png_bytes
from lingbot_core.protocols.sglang.client import RealtimeClient, list_models
from lingbot_core.protocols.model_config import remote_model_config
from lingbot_core.protocols.sglang.protocol import InitRequest
from lingbot_core.boundary.requests import parse_start
from lingbot_core.serving.contract import Admission, Block, EngineConfig, Failed, NewWorld, Waiting
from lingbot_core.serving.factory import create_engine
from lingbot_core.serving.streaming import StreamConfig
from lingbot_core.boundary.video import frames_to_uint8, mp4_segment

# Servers in other processes, seconds each to start: .ci/run runs these, the fast suite does not.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "a harbour at dawn"
OTHER_PROMPT = "a harbour at night"
WAIT_S = 60.0  # bounds only; the tiny model makes a block in ~0.1 s


class ServerProcess:
    """`python -m lingbot_core.serve` on a free port in its own process (tiny preset, fp32, one thread)."""

    def __init__(self, *args: str) -> None:
        env = dict(os.environ, LINGBOT_TEST_PRESET="tiny", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.process = subprocess.Popen([sys.executable, "-m", "lingbot_core.serve", "--port", "0", "--dtype", "fp32",
                                         *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.url = None
        for line in self.process.stdout:  # start-up lines, then the ready line
            self.lines.append(line)
            if line.startswith("ready at "):
                self.url = line.split()[2].removesuffix("/v1/realtime_video/generate")
                break
        assert self.url is not None, "no ready line:\n" + "".join(self.lines)
        threading.Thread(target=self._drain, daemon=True).start()
        assert list_models(self.url) == ["tiny"]

    def _drain(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(timeout=WAIT_S)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=WAIT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()


@pytest.fixture
def spawn():
    made: list[ServerProcess] = []

    def make(*args: str) -> ServerProcess:
        made.append(ServerProcess(*args))
        return made[-1]

    yield make
    for server in made:
        server.stop()
    assert all("Traceback" not in "".join(server.lines) for server in made), "a server logged a traceback"


@pytest.fixture(scope="module")
def oracle():
    """The tiny model the servers run (same preset, seeded weights, fp32), in this process."""
    engine = create_engine(preset="tiny", dtype="fp32", engine_config=EngineConfig(max_sessions=1))
    yield engine.pipeline
    engine.shutdown()


def remote_engine(*servers: ServerProcess, **config) -> SglangEngine:
    return SglangEngine([s.url for s in servers], remote_model_config("tiny"), EngineConfig(**config),
                        RemoteConfig(receive_timeout_s=30, open_timeout_s=10, backoff_s=0.5))


def regenerate_blocks(pipeline, request, entries: list[dict]) -> list[np.ndarray]:
    """The world a replay's entries describe (key sets or poses, prompts), made offline on one thread (the servers'
    thread count) through the offline command's reading of a replay: each block's uint8 frames."""
    config = pipeline.config
    replay = Replay(config.name, "", request.seed, request.prompt, entries)
    controls = controls_from_events(read_events(replay.to_events_jsonl(), config.transformer.num_frames_per_block),
                                    config)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return [frames_to_uint8(o.frames) for o in pipeline.rollout_request(request, controls)]
    finally:
        torch.set_num_threads(threads)


def regenerate(pipeline, request, entries: list[dict]) -> np.ndarray:
    return np.concatenate(regenerate_blocks(pipeline, request, entries))


def received(blocks: list[Block]) -> np.ndarray:
    return np.concatenate([b.pixels for b in blocks])


def test_a_remote_world_with_keys_a_prompt_switch_and_a_reset_is_the_world_the_model_makes(spawn, oracle,
                                                                                            start_image):
    server = spawn()
    engine = remote_engine(server)
    request = parse_start(start_image, PROMPT, 7, oracle.config)
    try:
        ticket = engine.admit(request)
        assert ticket.admission is Admission.ADMITTED
        sid = ticket.session_id
        world = take(engine, sid, NewWorld, skip=())
        assert world.replay.seed == 7 and world.replay.prompt == PROMPT
        blocks = [take(engine, sid)]
        # One change at a time, each applied before the next is sent, so the key sets are unambiguous.
        for event in (KeyStateEvent(1, frozenset("w")), KeyStateEvent(2, frozenset("j")),
                      KeyStateEvent(3, frozenset("j"), prompt=OTHER_PROMPT), KeyStateEvent(4, frozenset())):
            engine.post_event(sid, event)
            while event.event_id not in blocks[-1].event_ids:
                blocks.append(take(engine, sid))
        blocks.append(take(engine, sid))
        entries = [b.replay_entry for b in blocks]
        assert [b.block_index for b in blocks] == list(range(len(blocks)))
        assert any(["w"] in e["frames"] for e in entries) and any(["j"] in e["frames"] for e in entries)
        assert sum("prompt" in e for e in entries) == 1
        assert all(b.source["server"] == server.url for b in blocks)
        np.testing.assert_array_equal(received(blocks), regenerate(oracle, request, entries))

        # A reset: a new world on the same seat, exactly the new request's world.
        other = parse_start(np.flipud(start_image).copy(), OTHER_PROMPT, 11, oracle.config)
        engine.reset(sid, other)
        take(engine, sid, NewWorld, skip=(Block,))
        after = [take(engine, sid, skip=()) for _ in range(3)]
        assert [b.block_index for b in after] == [0, 1, 2]
        np.testing.assert_array_equal(received(after), regenerate(oracle, other, [b.replay_entry for b in after]))

        # Stop: the seat is free again, and the server serves the next world.
        engine.close(sid, "stopped by the user")
        again = engine.admit(request)
        assert again.admission is Admission.ADMITTED
        first = take(engine, again.session_id)
        np.testing.assert_array_equal(first.pixels, regenerate(oracle, request, [first.replay_entry]))
    finally:
        engine.shutdown()


def test_a_busy_server_is_skipped_and_a_killed_one_restarts_the_world_on_the_freed_seat(spawn, oracle, start_image):
    # Both servers hold one session and refuse a second at once (1008), as upstream does.
    one_seat = ("--max-sessions", "1", "--max-waiting", "0")
    busy, other = spawn(*one_seat), spawn(*one_seat)
    squatter = RealtimeClient.connect(busy.url, receive_timeout=WAIT_S)
    squatter.init(InitRequest(prompt=PROMPT, first_frame=png_bytes(Image.fromarray(start_image)), size="64x32"))
    squatter.next_chunk()  # busy holds its one session now
    engine = remote_engine(busy, other)
    request = parse_start(start_image, PROMPT, 5, oracle.config)
    try:
        sid = engine.admit(request).session_id
        block = take(engine, sid)
        assert block.source["server"] == other.url  # the busy one refused; the world went to the other
        assert engine.stats()["servers_busy"] == 1
        take(engine, sid)

        other.kill()  # mid-stream
        failed = take(engine, sid, Failed, skip=(Block,))
        assert other.url in failed.text
        squatter.close()  # the busy server's seat frees
        world = take(engine, sid, NewWorld, skip=(Waiting, Failed, Block))
        assert world.replay.seed == 5
        restarted = [take(engine, sid, skip=(Waiting, Failed)) for _ in range(2)]
        assert [b.block_index for b in restarted] == [0, 1]
        assert all(b.source["server"] == busy.url for b in restarted)
        np.testing.assert_array_equal(received(restarted),
                                      regenerate(oracle, request, [b.replay_entry for b in restarted]))
    finally:
        engine.shutdown()
        squatter.close()


def test_two_servers_seat_three_viewers_one_waits_until_a_seat_frees(spawn, oracle, start_image):
    servers = spawn(), spawn()
    engine = remote_engine(*servers)
    requests = [parse_start(start_image, PROMPT, seed, oracle.config) for seed in (1, 2, 3)]
    try:
        tickets = [engine.admit(r) for r in requests]
        assert [t.admission for t in tickets] == [Admission.ADMITTED, Admission.ADMITTED, Admission.WAITING]
        assert tickets[2].position == 1
        firsts = [take(engine, t.session_id) for t in tickets[:2]]
        assert {b.source["server"] for b in firsts} == {s.url for s in servers}  # one world per server
        engine.close(tickets[0].session_id, "stopped by the user")
        world = take(engine, tickets[2].session_id, NewWorld, skip=(Waiting,))
        assert world.replay.seed == 3
        block = take(engine, tickets[2].session_id)
        assert block.source["server"] == firsts[0].source["server"]  # the seat the first viewer gave back
        np.testing.assert_array_equal(block.pixels, regenerate(oracle, requests[2], [block.replay_entry]))
    finally:
        engine.shutdown()


def test_the_page_plays_a_world_made_by_a_protocol_server_in_another_process(spawn, oracle, tmp_path):
    """app.py's Gradio API over --backend sglang's engine, pointed at our own server process: start, a key, a
    reset, stop and the download, whose video is the downloaded replay regenerated offline and encoded as the
    stream encodes it (x264 is deterministic, so exactly)."""
    import app as lingbot_app

    server = spawn()
    engine = create_remote_engine([server.url], environ={"LINGBOT_TEST_PRESET": "tiny"},
                                  remote=RemoteConfig(receive_timeout_s=30, open_timeout_s=10))
    app = lingbot_app.build_demo(engine, stream_config=StreamConfig(), workdir=tmp_path / "work")
    try:
        _, url, _ = app.launch(server_name="127.0.0.1", server_port=free_port(), prevent_thread_lock=True, quiet=True)
        client = Client(url, verbose=False, download_files=False)
        job = client.submit(handle_file(str(FOREST)), "a forest path", 7, api_name="/start")
        session_id, segments, telemetry, reset_at, stopped = None, 0, [], None, False
        for video, text, sid in stream_outputs(job):
            telemetry.append(text)
            session_id = sid or session_id
            if not (isinstance(video, dict) and video.get("url")):
                continue
            segments += 1
            if segments == 1:
                assert client.predict(session_id, json.dumps({"event_id": 1, "keys": ["w"]}),
                                      api_name="/act") == "queued 1 event(s)"
            elif segments == 4 and reset_at is None:
                assert client.predict(session_id, handle_file(str(VILLAGE)), "a village", 5,
                                      api_name="/reset").startswith("reset")
                reset_at = segments
            elif reset_at is not None and segments == reset_at + 1:  # a key in the new world too
                assert client.predict(session_id, json.dumps({"event_id": 2, "keys": ["j"]}),
                                      api_name="/act") == "queued 1 event(s)"
            elif reset_at is not None and not stopped and segments >= reset_at + 5:
                assert client.predict(session_id, api_name="/stop").startswith("stopped after")
                stopped = True
        assert stopped and telemetry[-1].startswith("stopped after")
        assert any(f"from {server.url}" in t for t in telemetry)

        mp4_data, replay_data = client.predict(session_id, api_name="/download")  # the world after the reset
        mp4 = tmp_path / "rollout.mp4"
        mp4.write_bytes(httpx.get(mp4_data["url"], timeout=30).content)
        replay = json.loads(httpx.get(replay_data["url"], timeout=30).text)
        assert replay["seed"] == 5 and replay["prompt"] == "a village" and len(replay["blocks"]) >= 2
        assert any(["j"] in b["frames"] and 2 in b["event_ids"] for b in replay["blocks"])
        request = parse_start(VILLAGE.read_bytes(), "a village", 5, oracle.config)
        frames = regenerate(oracle, request, replay["blocks"])
        expected, start = [], 0
        for index in range(len(replay["blocks"])):  # one H.264 segment per block, as the stream encodes them
            count = oracle.config.pixel_frames_for_blocks(index + 1) - start
            segment = tmp_path / f"regenerated-{index}.mp4"
            segment.write_bytes(mp4_segment(frames[start:start + count], oracle.config.fps))
            expected.append(decode_video(segment))
            start += count
        np.testing.assert_array_equal(decode_video(mp4), np.concatenate(expected))
        client.close()
    finally:
        app.close()
        engine.shutdown()


def decode_video(path: Path) -> np.ndarray:
    with av.open(str(path)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(container.streams.video[0])])
