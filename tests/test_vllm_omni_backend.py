"""The vLLM-Omni backend (lingbot_core/protocols/vllm_omni/backend.py) against our own protocol server
(protocols/vllm_omni/server.py over the tiny engine), both in this process over real WebSockets.

Oracles: each Block's frames are the server engine's block for that chunk through the same fMP4 writer and reader
(exactly), the replay the backend builds equals the server's own (keys, poses, prompts, event ids), and a world
played over the wire regenerates offline from that replay, latent for latent. A busy server is skipped without a
word; a server that goes away mid-world is named to the viewer, and the world restarts on the next seat.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
import uvicorn
from starlette.applications import Starlette

from test_video_stream import free_port, regenerate, wait_until
from lingbot_core.boundary.events import KeyStateEvent, MotionEvent, PromptEvent, ScriptEvent
from lingbot_core.boundary.offline import RenderRequest
from lingbot_core.boundary.requests import BlockControl, parse_start
from lingbot_core.boundary.fmp4 import Fmp4Reader, Fmp4Writer
from lingbot_core.boundary.video import count_frames
from lingbot_core.serving.contract import Block, Closed, EngineConfig, Failed, NewWorld
from lingbot_core.serving.factory import create_engine
from lingbot_core.protocols.remote_engine import RemoteConfig
from lingbot_core.protocols.vllm_omni.backend import VllmOmniEngine, create_vllm_omni_engine
from lingbot_core.protocols.vllm_omni.server import VideoStreamServer
from lingbot_core.boundary.events import EventError

pytestmark = pytest.mark.usefixtures("single_thread")
WAIT_S = 120


class OurServer:
    """Our protocol server over its own tiny engine, its blocks recorded (the oracle), in a thread."""

    def __init__(self, max_sessions: int = 1, max_waiting: int = 0):
        self.engine = create_engine(preset="tiny", engine_config=EngineConfig(max_sessions=max_sessions,
                                                                              max_waiting=max_waiting))
        self.blocks: dict[str, list[Block]] = {}
        take = self.engine.next_message

        def spy(session_id, timeout=None):
            message = take(session_id, timeout)
            if isinstance(message, Block):
                self.blocks.setdefault(session_id, []).append(message)
            return message

        self.engine.next_message = spy
        self.server = VideoStreamServer(self.engine)
        port = free_port()
        self.uv = uvicorn.Server(uvicorn.Config(Starlette(routes=self.server.routes()), host="127.0.0.1", port=port,
                                                log_level="warning", ws_per_message_deflate=False))
        self.thread = threading.Thread(target=self.uv.run, daemon=True)
        self.thread.start()
        wait_until(lambda: self.uv.started, "uvicorn to start")
        self.url = f"ws://127.0.0.1:{port}"

    def stop(self) -> None:
        self.uv.should_exit = True
        self.thread.join(timeout=30)
        self.server.close()
        self.engine.shutdown()


def backend(*urls, **kwargs) -> VllmOmniEngine:
    from lingbot_core.protocols.model_config import remote_model_config
    return VllmOmniEngine(list(urls), remote_model_config("tiny"), EngineConfig(max_waiting=2),
                          RemoteConfig(receive_timeout_s=30, open_timeout_s=5, backoff_s=0.2, max_backoff_s=1), **kwargs)


def take(engine, session_id, kinds=(Block,)):
    while True:
        message = engine.next_message(session_id, timeout=WAIT_S)
        assert message is not None, "no message within the wait"
        if isinstance(message, kinds):
            return message
        assert not isinstance(message, Closed), message


@pytest.fixture
def request_for(start_image):
    from lingbot_core.protocols.model_config import remote_model_config
    return lambda prompt="a forest path", seed=5: parse_start(start_image, prompt, seed, remote_model_config("tiny"))


def test_a_world_over_our_server_is_the_servers_world(request_for, start_image):
    server = OurServer()
    engine = backend(server.url)
    try:
        start = request_for()
        ticket = engine.admit(start)
        assert isinstance(take(engine, ticket.session_id, (NewWorld,)), NewWorld)
        received = [take(engine, ticket.session_id)]
        engine.post_event(ticket.session_id, KeyStateEvent(1, frozenset({"w"})))
        while not received[-1].event_ids:
            received.append(take(engine, ticket.session_id))
        engine.post_event(ticket.session_id, PromptEvent(2, "a snowy forest"))
        engine.post_event(ticket.session_id, MotionEvent(3, "target", (0.2, 0.0, 0.3), (0.0, 0.2588, 0.0, 0.9659), 3))
        while 3 not in received[-1].event_ids:
            received.append(take(engine, ticket.session_id))
        received.append(take(engine, ticket.session_id))
        engine.post_event(ticket.session_id, KeyStateEvent(4, frozenset()))  # released: the zero velocity
        while 4 not in received[-1].event_ids:
            received.append(take(engine, ticket.session_id))
        with pytest.raises(EventError, match="start"):  # a live script: only in the start on this protocol
            engine.post_event(ticket.session_id, ScriptEvent(5, (frozenset({"w"}),) * 3))
        engine.close(ticket.session_id)
        (theirs,) = server.blocks.values()
        assert len(theirs) >= len(received)
        writer, reader = Fmp4Writer(64, 32, 16), Fmp4Reader()  # the server's stream, decoded as the backend does
        for ours, their in zip(received, theirs):
            # the server numbers the events it posts to its engine itself: the same events, other ids
            assert ours.block_index == their.block_index and len(ours.event_ids) == len(their.event_ids)
            assert np.array_equal(ours.pixels, np.stack(reader.feed(writer.add(their.pixels))))
            keys = {k: v for k, v in ours.replay_entry.items() if k not in ("poses", "event_ids")}
            assert keys == {k: v for k, v in their.replay_entry.items() if k not in ("poses", "event_ids")}
            if "poses" in their.replay_entry:
                assert np.allclose(ours.replay_entry["poses"], their.replay_entry["poses"], atol=1e-12)
        offline = regenerate(server.engine, received, "a forest path", 5, np.array(start.picture))
        for index, their in enumerate(theirs[:len(received)]):
            assert torch.equal(offline[index], their.latents), f"block {index}"
    finally:
        engine.shutdown()
        server.stop()


def test_a_busy_server_is_skipped_and_a_lost_one_is_named(request_for):
    busy, free = OurServer(), OurServer()
    engine = backend(busy.url, free.url)
    try:
        holder = engine.admit(request_for())
        take(engine, holder.session_id)
        first = engine.session_status(holder.session_id)["server"]
        other = free if first == busy.url else busy
        # someone else's client holds the other server: the next world is refused there, and waits for a seat
        from lingbot_core.protocols.vllm_omni.client import VideoStreamClient
        from lingbot_core.protocols.vllm_omni import messages as wire
        stranger = VideoStreamClient.connect(other.url)
        stranger.start(wire.start_message("x", "data:image/png;base64," + _png_b64(), fps=16))
        stranger.next_chunk()
        second = engine.admit(request_for(seed=6))
        stranger.close()
        take(engine, second.session_id)  # seated on the other server once the stranger left
        assert engine.session_status(second.session_id)["server"] == other.url
        # the holder's server goes away mid-world: its viewer is told which and why, and the world restarts
        (busy if first == busy.url else free).stop()
        failed = take(engine, holder.session_id, (Failed,))
        assert first in failed.text and "restarts" in failed.text
        engine.close(second.session_id)
        assert isinstance(take(engine, holder.session_id, (NewWorld,)), NewWorld)
    finally:
        engine.shutdown()
        for server in (busy, free):
            if server.thread.is_alive():
                server.stop()


def _png_b64() -> str:
    import base64
    import io
    from PIL import Image
    buffer = io.BytesIO()
    Image.fromarray(np.zeros((32, 64, 3), np.uint8)).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def test_an_offline_render_over_a_server(request_for, tmp_path):
    server = OurServer()
    engine = backend(server.url)
    try:
        controls = (BlockControl(actions=(frozenset({"w"}),) * 3), BlockControl(actions=(frozenset({"j"}),) * 3))
        out = tmp_path / "out.mp4"
        assert engine.render(RenderRequest(request_for(), controls), out) == 2
        assert count_frames(out)[0] == 9 + 12
        (blocks,) = server.blocks.values()
        assert [b.replay_entry["frames"] for b in blocks] == [[["w"]] * 3, [["j"]] * 3]
    finally:
        engine.shutdown()
        server.stop()


def test_the_vllm_omni_backend_needs_its_servers():
    with pytest.raises(ValueError, match="--vllm-omni-url"):
        create_vllm_omni_engine([], environ={})
    engine = create_vllm_omni_engine(None, environ={"LINGBOT_VLLM_OMNI_URLS": "ws://a:1, ws://b:1"})
    try:
        assert engine.urls == ["ws://a:1", "ws://b:1"] and "vLLM-Omni" in engine.describe()
    finally:
        engine.shutdown()


def drive_the_page(engine, tmp_path) -> None:
    """app.py over this engine, driven through gradio_client as over the local engine: Start, W held from the first
    segment, Stop after six, the download (MP4 and replay) and the offline tab."""
    import json

    import httpx
    from gradio_client import Client, handle_file

    import app as lingbot_app
    from app_driver import FOREST, free_port as app_port, stream_outputs
    from lingbot_core.serving.streaming import StreamConfig

    app = lingbot_app.build_demo(engine, stream_config=StreamConfig(), workdir=tmp_path / "work")
    try:
        assert f"{engine.capacity} remote vLLM-Omni realtime server" in lingbot_app._header(engine.model_config, engine)
        _, url, _ = app.launch(server_name="127.0.0.1", server_port=app_port(), prevent_thread_lock=True, quiet=True)
        client = Client(url, verbose=False, download_files=False)
        job = client.submit(handle_file(str(FOREST)), "a forest path", 7, api_name="/start")
        session_id, segments, telemetry, stopped = None, 0, [], False
        for video, text, sid in stream_outputs(job):
            telemetry.append(text)
            session_id = sid or session_id
            if isinstance(video, dict) and video.get("url"):
                segments += 1
                if segments == 1:
                    assert client.predict(session_id, json.dumps({"event_id": 1, "keys": ["w"]}),
                                          api_name="/act") == "queued 1 event(s)"
                if segments >= 6 and not stopped:
                    assert client.predict(session_id, api_name="/stop").startswith("stopped after")
                    stopped = True
        assert telemetry[-1].startswith("stopped after")
        mp4_data, replay_data = client.predict(session_id, api_name="/download")
        mp4 = tmp_path / "rollout.mp4"
        mp4.write_bytes(httpx.get(mp4_data["url"], timeout=30).content)
        replay = json.loads(httpx.get(replay_data["url"], timeout=30).text)
        assert count_frames(mp4)[0] == 9 + 12 * (segments - 1)
        assert len(replay["blocks"]) == segments and replay["seed"] == 7
        assert any(b["event_ids"] == [1] and "poses" in b for b in replay["blocks"])  # W held: a velocity

        script = '{"event_id": 0, "frames": [["w"], ["w"], ["w"]]}\n{"event_id": 1, "keys": ["l"]}\n'
        video, message = client.predict(handle_file(str(FOREST)), "a forest path", 3, script, None, None, None, None,
                                        api_name="/generate")
        out = tmp_path / "offline.mp4"
        out.write_bytes(httpx.get(video["video"]["url"] if "video" in video else video["url"], timeout=30).content)
        assert count_frames(out)[0] == 9 + 12
        client.close()
    finally:
        app.close()


def test_the_page_plays_over_the_vllm_omni_backend(tmp_path):
    server = OurServer()
    engine = create_vllm_omni_engine([server.url], environ={"LINGBOT_TEST_PRESET": "tiny"},
                                     remote=RemoteConfig(receive_timeout_s=30, open_timeout_s=5))
    try:
        drive_the_page(engine, tmp_path)
    finally:
        engine.shutdown()
        server.stop()


def test_the_client_takes_chunks_whose_frames_straddle_payloads():
    """An upstream muxer that does not flush sends a chunk's last frame with the next payload (the reference's
    muxer settings, no flush): each chunk is still given whole, with the frames its metadata announced."""
    import json

    from starlette.routing import WebSocketRoute

    from lingbot_core.protocols.vllm_omni.client import VideoStreamClient

    rng = np.random.default_rng(0)
    chunks = [rng.integers(0, 256, (n, 32, 64, 3), dtype=np.uint8) for n in (9, 12, 12)]
    writer = Fmp4Writer(64, 32, 16)
    stream = b"".join(writer.add(c) for c in chunks) + writer.close()
    cuts = [0, 9000, 14000, 21000, len(stream)]  # payloads that do not end where chunks end

    async def video(websocket):
        await websocket.accept()
        await websocket.receive_text()
        await websocket.send_text(json.dumps({"type": "video.start", "request_id": "video_stream-x", "format": "m4s",
                                              "config": {}}))
        for index, (a, b) in enumerate(zip(cuts, cuts[1:])):
            last = index == len(cuts) - 2
            await websocket.send_text(json.dumps({
                "type": "video.chunk_metadata", "request_id": "video_stream-x", "kind": "trailer" if last else "media",
                "transport_chunk_index": index, "generation_chunk_index": None if last else index,
                "num_frames": 0 if last else len(chunks[index]), "byte_length": b - a, "started_event_ids": [],
                "active_event_ids": [], "completed_event_ids": []}))
            await websocket.send_bytes(stream[a:b])
        await websocket.send_text(json.dumps({"type": "session.done", "request_id": "video_stream-x", "chunks": 4,
                                              "stopped": False}))
        await websocket.close()

    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(Starlette(routes=[WebSocketRoute("/v1/realtime/video", video)]),
                                       host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    wait_until(lambda: uv.started, "uvicorn to start")
    try:
        client = VideoStreamClient.connect(f"ws://127.0.0.1:{port}")
        client.start({"type": "session.start", "prompt": "p", "image_reference": {"image_url": "data:,"}})
        expected = np.stack(Fmp4Reader().feed(stream))
        got = [client.next_chunk() for _ in range(3)]
        assert [c.chunk_index for c in got] == [0, 1, 2] and [len(c.frames) for c in got] == [9, 12, 12]
        assert np.array_equal(np.concatenate([c.frames for c in got]), expected)
        ended = client.next_chunk()
        assert ended.outcome.value == "completed"
        client.close()
    finally:
        uv.should_exit = True
        thread.join(timeout=30)
