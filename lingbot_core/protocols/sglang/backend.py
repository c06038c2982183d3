"""The engine over a pool of SGLang realtime servers (`app.py --backend sglang`): the remote engine
(lingbot_core/protocols/remote_engine.py: seats, the line, failures, restarts) speaking SGLang's protocol.

- The start: an `init` with the start picture as PNG, prompt, seed, the model's size, raw frames, and
  server-side pacing (realtime_output_pacing, so a world runs at most one chunk ahead of its viewer; `pace` is
  accepted and does nothing). A refusal before the first chunk ("another realtime session is already active",
  close 1008) is a busy server.
- Events go out as SGLang events under our ids (actions.event_to_message): held keys as a state map, a script as
  a script, a prompt alone as a prompt event. Poses and camera motion are refused: the protocol carries keys.
- A chunk applies the events up to its event_id; the replay entry records those ids and the key sets of its
  latent frames as the server applies them (actions.CameraInput, the server's rule).
- An offline render is one init whose condition_inputs.camera_actions hold the whole script and max_chunks its
  blocks.
"""

from __future__ import annotations

import os
from typing import Any

from lingbot_core.boundary.events import Event, EventError, KeyStateEvent, MotionEvent, PoseEvent, ScriptEvent
from lingbot_core.boundary.offline import RenderRequest
from lingbot_core.boundary.requests import StartRequest
from lingbot_core.protocols.pool import Server, server_urls
from lingbot_core.protocols.remote_engine import RemoteConfig, RemoteEngine, png_bytes
from lingbot_core.protocols.sglang.actions import CameraInput, script_payload, state_payload
from lingbot_core.protocols.sglang.client import RealtimeClient, ReceivedChunk
from lingbot_core.protocols.model_config import served_model_config
from lingbot_core.protocols.sglang.protocol import InitRequest
from lingbot_core.serving.contract import EngineConfig


class SglangEngine(RemoteEngine):
    protocol = "SGLang"

    def _init_request(self, request: StartRequest, **fields) -> InitRequest:
        config = self._model_config
        return InitRequest(prompt=request.prompt, first_frame=png_bytes(request.picture), seed=request.seed,
                           size=f"{config.width}x{config.height}", realtime_output_format="raw", **fields)

    def _connect(self, url: str) -> RealtimeClient:
        return RealtimeClient.connect(url, open_timeout=self.remote.open_timeout_s,
                                      receive_timeout=self.remote.receive_timeout_s,
                                      close_timeout=self.remote.close_timeout_s)

    def _start(self, client: RealtimeClient, request: StartRequest) -> None:
        client.init(self._init_request(request, realtime_output_pacing=self.remote.output_pacing))

    def _new_wire(self, request: StartRequest) -> CameraInput:
        return CameraInput()  # the keys as the server applies them, for the replay

    def _check_event(self, event: Event) -> None:
        if isinstance(event, (PoseEvent, MotionEvent)):
            raise EventError(f"event {event.event_id}: SGLang's realtime protocol carries camera keys only; poses and "
                             "camera motion cannot be sent to its servers")

    def _chunk_block_locked(self, session, server: Server, chunk: ReceivedChunk, waited_ms: float):
        # The events this chunk applied: every one sent up to its event_id, in order.
        applied = []
        while session.sent and chunk.event_id is not None and session.sent[0].event_id <= chunk.event_id:
            applied.append(session.sent.popleft())
        prompt = session.prompt
        for event in applied:
            if isinstance(event, (KeyStateEvent, ScriptEvent)):  # a PromptEvent leaves the camera as it is
                session.wire.apply(state_payload(event.keys) if isinstance(event, KeyStateEvent)
                                   else script_payload(event.frames))
            if event.prompt is not None:
                session.prompt = event.prompt
        frames = session.wire.next_block(self._model_config.transformer.num_frames_per_block)
        entry: dict[str, Any] = {"frames": [sorted(keys) for keys in frames],
                                 "event_ids": [event.event_id for event in applied]}
        if session.prompt != prompt:
            entry["prompt"] = session.prompt
        stats = chunk.stats
        if stats is not None:
            stage_ms = {"request_prepare": stats.request_prepare_ms, "forward": stats.scheduler_forward_ms,
                        "pace_wait": stats.pace_wait_ms, "header_write": stats.header_write_ms,
                        "raw_payload_build": stats.raw_payload_build_ms, "raw_write": stats.raw_write_ms,
                        "ws_write": stats.ws_write_ms, "chunk_total": stats.chunk_total_ms}
            block_ms = stats.scheduler_forward_ms or stats.chunk_total_ms
            source = {"server": server.url, "forward_ms": stats.scheduler_forward_ms,
                      "total_ms": stats.chunk_total_ms, "bytes": stats.ws_payload_bytes}
        else:  # the session ended between the chunk's frames and its stats: the time it took to arrive
            stage_ms, block_ms = {}, waited_ms
            source = {"server": server.url, "forward_ms": None, "total_ms": None, "bytes": chunk.frames.nbytes}
        return chunk.chunk_index, entry, stage_ms, block_ms, source

    def _render_start(self, client: RealtimeClient, request: RenderRequest) -> None:
        frames = [keys for control in request.controls for keys in control.actions]
        client.init(self._init_request(request.start, max_chunks=len(request.controls), realtime_output_pacing=False,
                                       condition_inputs={"camera_actions": script_payload(frames)}))


def sglang_urls(urls=None, environ=os.environ) -> list[str]:
    """The servers named on the command line (--sglang-url, repeatable), else $LINGBOT_SGLANG_URLS (comma
    separated)."""
    return server_urls(urls, "LINGBOT_SGLANG_URLS", environ)


def create_remote_engine(urls=None, model: str | None = None, config: EngineConfig = EngineConfig(),
                         remote: RemoteConfig = RemoteConfig(), environ=os.environ) -> SglangEngine:
    """The app's `--backend sglang`: an SglangEngine over the given servers (or $LINGBOT_SGLANG_URLS); the model
    config from `model`, $LINGBOT_MODEL or $LINGBOT_TEST_PRESET (tests), else the 14B preset
    (protocols/model_config.py). Loads no weights. ValueError names what is missing."""
    urls = sglang_urls(urls, environ)
    if not urls:
        raise ValueError("--backend sglang needs the realtime servers: --sglang-url ws://host:port (repeat it for "
                         "each server) or LINGBOT_SGLANG_URLS=ws://h1:30000,ws://h2:30000")
    return SglangEngine(urls, served_model_config(model, environ), config, remote)
