"""app.py with --backend sglang's engine (a SglangEngine) over an upstream-like fake server: the same Gradio API
(/start /act /stop /download) as with the local engine, and the page says where its worlds are played.
Driven with gradio_client, as tests/test_app.py drives the local app."""

from __future__ import annotations

import json

import httpx
import pytest

from app_driver import FOREST, free_port, stream_outputs
import app as lingbot_app
from fake_upstream import FakeUpstream
from gradio_client import Client, handle_file
from lingbot_core.protocols.sglang.backend import RemoteConfig, SglangEngine, create_remote_engine
from lingbot_core.serving.contract import EngineConfig
from lingbot_core.serving.streaming import StreamConfig
from lingbot_core.boundary.video import count_frames


def test_the_app_plays_a_remote_world_with_keys_stop_and_download(tmp_path):
    server = FakeUpstream(width=64, height=32)
    engine = create_remote_engine([server.url], environ={"LINGBOT_TEST_PRESET": "tiny"},
                                  remote=RemoteConfig(receive_timeout_s=10, open_timeout_s=5))
    assert isinstance(engine, SglangEngine) and engine.model_config.name == "tiny"
    app = lingbot_app.build_demo(engine, stream_config=StreamConfig(), workdir=tmp_path / "work")
    try:
        assert "1 remote SGLang realtime server" in lingbot_app._header(engine.model_config, engine)
        _, url, _ = app.launch(server_name="127.0.0.1", server_port=free_port(), prevent_thread_lock=True, quiet=True)
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
                # Stop once the stream has shown the block that applied the event (the fake runs ahead of
                # realtime, so chunks made before the event arrived may still be on their way).
                with server.lock:
                    applied = [index for index, event_id, _ in server.chunks[0] if event_id == 1]
                if applied and segments >= applied[0] + 2 and not stopped:
                    assert client.predict(session_id, api_name="/stop").startswith("stopped after")
                    stopped = True
        assert telemetry[-1].startswith("stopped after") and telemetry[-1].endswith("can be downloaded")
        assert any("remote servers up" in t and f"from {server.url}" in t for t in telemetry)
        assert server.events[0][0]["event_id"] == 1 and server.events[0][0]["kind"] == "camera_actions"

        mp4_data, replay_data = client.predict(session_id, api_name="/download")
        mp4 = tmp_path / "rollout.mp4"
        mp4.write_bytes(httpx.get(mp4_data["url"], timeout=30).content)
        replay = json.loads(httpx.get(replay_data["url"], timeout=30).text)
        assert count_frames(mp4)[0] == 9 + 12 * (segments - 1)  # the frames received, as the fake sent them
        assert len(replay["blocks"]) == segments and replay["seed"] == 7
        assert any(b["event_ids"] == [1] and b["frames"] == [["w"]] * 3 for b in replay["blocks"])
        client.close()
    finally:
        app.close()
        engine.shutdown()
        server.stop()
    assert server.open_connections() == 0


def test_the_sglang_backend_needs_its_servers():
    with pytest.raises(ValueError, match="--sglang-url"):
        create_remote_engine([], environ={})
    engine = create_remote_engine(None, environ={"LINGBOT_SGLANG_URLS": "ws://a:1, ws://b:1"},
                                  config=EngineConfig())
    try:
        assert engine.urls == ["ws://a:1", "ws://b:1"] and engine.capacity == 2
        assert (engine.model_config.name, engine.model_config.width, engine.model_config.height) == \
            ("lingbot-world-v2-14b", 832, 480)
    finally:
        engine.shutdown()
