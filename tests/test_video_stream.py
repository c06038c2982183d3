"""vLLM-Omni's realtime video protocol (`/v1/realtime/video`) on our server, played by a client written from the
reference alone (../shared/reference/vllm-omni-realtime-protocol.md): `websockets` and JSON, nothing of ours but
the fMP4 decoder under test elsewhere (tests/test_fmp4.py).

Oracles: the binary payloads are exactly the engine's own blocks muxed by the same writer (byte for byte), and
decode to as many frames as the metadata says; every world received regenerates offline from its replay, latent
for latent; the reference's malformed messages get its error strings and end the session or not as upstream.
"""

from __future__ import annotations

import base64
import io
import json
import threading
import time

import numpy as np
import pytest
import torch
import uvicorn
from PIL import Image
from starlette.applications import Starlette
from websockets.sync.client import connect

from lingbot_core.boundary.events import read_events
from lingbot_core.boundary.fmp4 import Fmp4Writer, decode_fmp4
from lingbot_core.boundary.offline import controls_from_events
from lingbot_core.serving.contract import Block, EngineConfig
from lingbot_core.serving.factory import create_engine
from lingbot_core.serving.replay import Replay
from lingbot_core.protocols.vllm_omni.server import VideoStreamServer
from test_serve import Served, free_port, png, wait_until  # noqa: E402 (the SGLang server tests' helpers)

PATH = "/v1/realtime/video"
WAIT_S = 120  # a bound so a bug fails instead of hanging; never asserted as a timing
START_TIMEOUT_S, STALL_TIMEOUT_S = 1.5, 3.0

pytestmark = pytest.mark.usefixtures("single_thread")


def data_url(seed: int = 0) -> str:
    """test_serve's start picture (random pixels, 40x70, as PNG) as a data URL."""
    return "data:image/png;base64," + base64.b64encode(png(seed)).decode()


@pytest.fixture(scope="module")
def served(single_thread):
    engine = create_engine(preset="tiny", engine_config=EngineConfig(max_sessions=2, max_waiting=1))
    result = Served("", engine)
    take = engine.next_message

    def spy(session_id, timeout=None):  # the oracle: what the engine handed the protocol server
        message = take(session_id, timeout)
        if isinstance(message, Block):
            result.blocks.setdefault(session_id, []).append(message)
        return message

    engine.next_message = spy
    server = VideoStreamServer(engine, start_timeout_s=START_TIMEOUT_S, stall_timeout_s=STALL_TIMEOUT_S)
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(Starlette(routes=server.routes()), host="127.0.0.1", port=port,
                                       log_level="warning", ws_per_message_deflate=False))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    wait_until(lambda: uv.started, "uvicorn to start")
    result.url = f"ws://127.0.0.1:{port}{PATH}"
    try:
        yield result
    finally:
        uv.should_exit = True
        thread.join(timeout=30)
        server.close()
        engine.shutdown()


@pytest.fixture
def fresh(served):
    wait_until(served.drained, "sessions of an earlier test to close")
    served.blocks.clear()
    yield served
    wait_until(served.drained, "every session to close and return its pages")


class Client:
    """What the reference says a client does: JSON text out; JSON text and binary fMP4 payloads in."""

    def __init__(self, url: str):
        self.ws = connect(url, max_size=None, ping_interval=None, compression=None, open_timeout=30, legacy=True)
        self.payloads: list[bytes] = []
        self.metadata: list[dict] = []
        self.others: list[dict] = []  # pongs, acks and errors seen while reading chunks

    def send(self, **message) -> None:
        self.ws.send(json.dumps(message))

    def start(self, **fields) -> dict:
        fields.setdefault("prompt", "a forest path")
        fields.setdefault("image_reference", {"image_url": data_url()})
        fields.setdefault("fps", 16)
        fields.setdefault("seed", 5)
        self.send(type="session.start", **fields)
        started = self.message()
        assert started["type"] == "video.start", started
        return started

    def message(self) -> dict:
        value = self.ws.recv(timeout=WAIT_S)
        assert isinstance(value, str), "control messages are JSON text"
        return json.loads(value)

    def next(self) -> dict:
        """The next control message; a chunk_metadata's payload (the next binary frame) is kept."""
        message = self.message()
        if message["type"] == "video.chunk_metadata":
            payload = self.ws.recv(timeout=WAIT_S)
            assert isinstance(payload, bytes) and len(payload) == message["byte_length"]
            self.payloads.append(payload)
            self.metadata.append(message)
        return message

    def chunk(self) -> dict:
        while True:
            message = self.next()
            if message["type"] == "video.chunk_metadata":
                return message
            assert message["type"] in ("session.pong", "session.interaction.queued", "error"), message
            self.others.append(message)

    def until(self, kind: str) -> dict:
        while True:
            message = self.next()
            if message["type"] == kind:
                return message
            assert message["type"] in ("video.chunk_metadata", "session.pong", "session.interaction.queued",
                                       "error"), message
            self.others.append(message)

    def closed(self) -> bool:
        try:
            while True:
                value = self.ws.recv(timeout=WAIT_S)
                if isinstance(value, str):
                    self.others.append(json.loads(value))
        except Exception:  # ConnectionClosed: the server ended it
            return True

    def close(self) -> None:
        self.ws.close()


def regenerate(engine, blocks, prompt: str, seed: int, image: np.ndarray | None = None) -> list[torch.Tensor]:
    """Every block's latents regenerated offline from the replay the blocks carry (poses or keys), from `image`
    (default: the picture data_url() sends)."""
    replay = Replay(engine.pipeline.config.name, "", seed, prompt, [b.replay_entry for b in blocks])
    controls = controls_from_events(read_events(replay.to_events_jsonl(), engine.pipeline.config.transformer
                                                .num_frames_per_block), engine.pipeline.config)
    if image is None:
        image = np.array(Image.open(io.BytesIO(base64.b64decode(data_url().split(",")[1]))).convert("RGB"))
    return [o.latents for o in engine.pipeline.rollout(image, prompt, seed, controls)]


def test_a_client_from_the_reference_plays_start_chunks_interactions_ping_and_stop(fresh):
    client = Client(fresh.url)
    started = client.start()
    assert started["request_id"].startswith("video_stream-") and len(started["request_id"]) == 13 + 32
    assert started["format"] == "m4s" and started["config"]["prompt"] == "a forest path"
    assert started["config"]["fps"] == 16 and "type" not in started["config"]

    first = client.chunk()
    assert first["kind"] == "media" and first["transport_chunk_index"] == 0 and first["generation_chunk_index"] == 0
    assert first["num_frames"] == 9 and first["request_id"] == started["request_id"]
    assert client.payloads[0][4:8] == b"ftyp"  # the header rides in payload 0

    client.send(type="session.interaction", interaction={"event_id": "fwd-1", "event": {"multi_modal_data": {
        "camera": {"mode": "velocity", "data": {"translation": [0, 0, 0.05], "rotation": [0, 0, 0, 1]}}}}})
    ack = client.until("session.interaction.queued")
    assert ack == {"type": "session.interaction.queued", "request_id": started["request_id"], "event_id": "fwd-1"}
    chunk = client.chunk()
    while "fwd-1" not in chunk["started_event_ids"]:
        chunk = client.chunk()
    assert chunk["active_event_ids"] == ["fwd-1"] and chunk["num_frames"] == 12
    half_turn = [0.0, float(np.sin(np.radians(15))), 0.0, float(np.cos(np.radians(15)))]
    client.send(type="session.interaction", interaction={"event_id": "tgt-1", "transition_chunks": 1, "event": {
        "multi_modal_data": {"camera": {"mode": "target", "data": {"translation": [0, 0, 0.5], "rotation": half_turn}}}}})
    client.until("session.interaction.queued")
    chunk = client.chunk()
    while "tgt-1" not in chunk["started_event_ids"]:
        assert chunk["active_event_ids"] == ["fwd-1"]
        chunk = client.chunk()
    # the target supersedes the velocity, glides over one chunk (3 latent frames) and is reached in it
    assert "fwd-1" in chunk["completed_event_ids"] and "tgt-1" in chunk["completed_event_ids"]
    client.send(type="session.ping")
    client.until("session.pong")
    client.send(type="session.stop")
    done = client.until("session.done")
    assert done == {"type": "session.done", "request_id": started["request_id"], "chunks": len(client.payloads),
                    "stopped": True}
    assert [m["transport_chunk_index"] for m in client.metadata] == list(range(len(client.payloads)))
    assert client.closed()

    # The payloads are the engine's blocks muxed by the same writer, byte for byte, and decode to their frames.
    (session_id, blocks), = fresh.blocks.items()
    blocks = blocks[:len(client.payloads)]
    writer = Fmp4Writer(blocks[0].pixels.shape[2], blocks[0].pixels.shape[1], 16)
    assert [writer.add(b.pixels) for b in blocks] == client.payloads
    frames = decode_fmp4(b"".join(client.payloads))
    assert len(frames) == sum(m["num_frames"] for m in client.metadata) == sum(len(b.pixels) for b in blocks)
    # The world regenerates offline from its replay: the motion blocks were recorded as their poses.
    assert any("poses" in b.replay_entry for b in blocks)
    offline = regenerate(fresh.engine, blocks, "a forest path", 5)
    assert len(offline) == len(blocks)
    for index, block in enumerate(blocks):
        assert torch.equal(offline[index], block.latents), f"block {index}"
    client.close()


def test_a_finite_session_ends_with_the_trailer_and_done(fresh):
    client = Client(fresh.url)
    model = fresh.engine.pipeline.config
    started = client.start(num_frames=model.pixel_frames_for_blocks(2), extra_params={
        "camera_action_script": [[["w"], ["w"], ["w"]], [["j"], [], ["J"]]]})
    client.chunk()
    client.chunk()
    trailer = client.chunk()
    assert trailer["kind"] == "trailer" and trailer["generation_chunk_index"] is None and trailer["num_frames"] == 0
    done = client.until("session.done")
    assert done == {"type": "session.done", "request_id": started["request_id"], "chunks": 3, "stopped": False}
    assert client.closed()
    assert len(decode_fmp4(b"".join(client.payloads))) == model.pixel_frames_for_blocks(2)
    (blocks,) = fresh.blocks.values()
    assert [b.replay_entry["frames"] for b in blocks] == [[["w"]] * 3, [["j"], [], ["j"]]]


def test_start_errors_use_upstreams_words_and_end_the_session(fresh):
    cases = [
        ("not json", "Invalid JSON in session.start"),
        ("[1, 2]", "session.start must be a JSON object"),
        (json.dumps({"type": "session.ping"}), "Expected session.start, got: session.ping"),
        (json.dumps({"type": "session.start", "format": "mp4", "prompt": "p",
                     "image_reference": {"image_url": data_url()}}), "Invalid session.start format: expected 'm4s'."),
        ("x" * (4 * 1024 * 1024 + 1), "session.start message too large"),
    ]
    for text, message in cases:
        client = Client(fresh.url)
        client.ws.send(text)
        error = client.message()
        assert error["type"] == "error" and error["message"] == message, (text[:40], error)
        assert client.closed()
    client = Client(fresh.url)  # nothing within the start timeout
    assert client.message() == {"type": "error", "message": "Timeout waiting for session.start"}
    assert client.closed()


def test_what_fails_after_video_start_is_an_error_and_the_end(fresh):
    model = fresh.engine.pipeline.config
    cases = [
        ({"image_reference": {"image_url": "data:image/png;base64,@@@"}}, "not valid base64"),
        ({"image_reference": {"image_url": "https://example.com/a.png"}}, "fetches no URLs"),
        ({"width": model.width * 2, "height": model.height}, "width and height"),
        ({"num_frames": model.pixel_frames_for_blocks(1) + 1}, "num_frames must be"),
        ({"extra_params": {"action_path": "examples/00"}}, "action_path"),
        ({"extra_params": {"camera_action_script": [[["w"], [], []]] * 65}}, "at most 64"),
    ]
    for fields, text in cases:
        client = Client(fresh.url)
        client.start(**fields)
        error = client.message()
        assert error["type"] == "error" and text in error["message"], error
        assert client.closed() and not any(m.get("type") == "session.done" for m in client.others)


def test_bad_control_messages_are_answered_and_the_session_goes_on(fresh):
    client = Client(fresh.url)
    started = client.start()
    client.send(type="session.interaction", interaction={"event": {"prompt": "at night"}})
    failed = client.until("error")  # a prompt before the first chunk (upstream: prompt_update not allowed yet)
    assert failed["code"] == "interaction_failed" and failed["message"] == "Failed to apply interaction"
    client.chunk()
    cases = [
        ("{", {"message": "Invalid JSON message"}),
        ("[]", {"message": "WebSocket messages must be JSON objects"}),
        (json.dumps({"type": "session.dance"}), {"message": "Unknown message type: session.dance"}),
        ("x" * (128 * 1024 + 1), {"message": "control message too large"}),
        (json.dumps({"type": "session.interaction", "interaction": 3}),
         {"message": "session.interaction requires an interaction object"}),
        (json.dumps({"type": "session.interaction", "interaction": {"event_id": "k", "event": {"multi_modal_data": {
            "camera": {"mode": "velocity", "data": {"actions": ["w"]}}}}}}),
         {"code": "interaction_failed", "event_id": "k"}),
        (b"\x00binary", {"message": "WebSocket messages must be JSON objects"}),
    ]
    for text, expected in cases:
        client.ws.send(text)
        error = client.until("error")
        assert {k: error.get(k) for k in expected} == expected, (str(text)[:40], error)
    client.send(type="session.interaction", interaction={"event_id": "p-1", "event": {"prompt": "at night"}})
    client.until("session.interaction.queued")
    client.send(type="session.interaction", interaction={"event_id": "p-1", "event": {"prompt": "at dawn"}})
    conflict = client.until("error")
    assert conflict == {"type": "error", "message": "event_id_conflict", "code": "event_id_conflict",
                        "request_id": started["request_id"], "event_id": "p-1"}
    chunk = client.chunk()
    while "p-1" not in chunk["started_event_ids"]:
        chunk = client.chunk()
    assert "p-1" in chunk["completed_event_ids"]  # a prompt switches at once here (upstream lerps)
    client.send(type="session.stop")
    assert client.until("session.done")["stopped"] is True
    client.close()


def test_a_scripted_session_refuses_live_camera_and_a_paced_one_waits_for_the_playhead(fresh):
    client = Client(fresh.url)
    client.start(streaming_buffer_seconds=0.5, extra_params={"camera_action_script": [[["w"], ["w"], ["w"]]]})
    client.send(type="session.interaction", interaction={"event_id": "v", "event": {"multi_modal_data": {
        "camera": {"mode": "velocity", "data": {"translation": [0, 0, 0.05]}}}}})
    assert client.until("error")["code"] == "interaction_failed"
    client.chunk()  # 9 frames at 16 FPS: 0.56 s ahead of a playhead at 0, past the 0.5 s buffer
    client.send(type="session.ping")
    client.until("session.pong")
    time.sleep(1.0)  # not a timing assertion: long enough that an unpaced server would have sent more
    assert len(client.payloads) == 1
    client.send(type="session.playback", position_seconds=0.5)
    client.chunk()
    assert len(client.payloads) == 2
    client.send(type="session.stop")
    client.until("session.done")
    client.close()


def test_a_session_with_no_progress_stalls_out(fresh):
    """Two seats taken, the third connection waits in line: no chunk and no ping within the stall timeout."""
    holders = [Client(fresh.url) for _ in range(2)]
    for holder in holders:
        holder.start()
        holder.chunk()
    waiter = Client(fresh.url)
    started = waiter.start()
    error = waiter.until("error")
    assert error == {"type": "error", "message": "Stall timeout: no generation progress",
                     "request_id": started["request_id"]}
    assert waiter.until("session.done")["stopped"] is True
    for holder in holders:
        holder.send(type="session.stop")
        holder.until("session.done")
        holder.close()
