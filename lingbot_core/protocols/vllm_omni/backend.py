"""The engine over a pool of vLLM-Omni realtime servers (`app.py --backend vllm-omni`): the remote engine
(lingbot_core/protocols/remote_engine.py: seats, the line, failures, restarts) speaking vLLM-Omni's protocol
(`/v1/realtime/video`, lingbot_core/protocols/vllm_omni/client.py).

- The start: a `session.start` with the start picture as a PNG data URL, prompt, seed, the model's size and
  frame rate, and no `num_frames` (an open-ended world, as our own server takes it; `max_world_blocks` asks an
  upstream server, whose sessions are finite, for that many blocks). Live sessions are paced by the viewer:
  `streaming_buffer_seconds` on the start and a `session.playback` at the media time of each block the viewer
  takes, so the server stays about a block ahead of what is shown (an upstream server without pacing runs
  ahead until TCP holds it back, as the outbox stops being read).
- Events become interactions under our ids as text: held keys as upstream's client converts them (a velocity of
  0.05 a latent frame along W/A/S/D, 4 degrees of pitch for I/K and 6 of yaw for J/L; released keys: the zero
  motion that stops, keys.py), a camera motion as it is (a target's steps in whole chunks), a prompt as a prompt.
  A live script of keys or poses is refused (the protocol takes a script only in the start).
- A chunk applies the events its metadata lists (started or completed) and every earlier one sent; the replay
  entry records what the server did with them as our server does it (the last camera input wins; a motion in
  force gives the block's poses, model/camera_motion.advance; with none, a still block's empty key sets), so a
  world played over our server regenerates offline, latent for latent.
- The fMP4 payloads are decoded once, into each chunk's frames, for the page's player and the recording.
- An offline render is one `session.start` with the script as `camera_action_script` and `num_frames` its
  blocks.
"""

from __future__ import annotations

import base64
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lingbot_core.boundary.events import Event, EventError, KeyStateEvent, MotionEvent
from lingbot_core.boundary.offline import RenderRequest
from lingbot_core.boundary.requests import StartRequest
from lingbot_core.model.camera_motion import CameraMotion, advance
from lingbot_core.protocols.model_config import served_model_config
from lingbot_core.protocols.pool import Server, server_urls
from lingbot_core.protocols.remote_engine import RemoteConfig, RemoteEngine, png_bytes
from lingbot_core.protocols.vllm_omni import messages as wire
from lingbot_core.protocols.vllm_omni.client import VideoChunk, VideoStreamClient, interaction_for
from lingbot_core.protocols.vllm_omni.keys import script_from_blocks, velocity_delta
from lingbot_core.serving.contract import Block, EngineConfig


@dataclass
class _Wire:
    """One connection's camera as the server applies it, for the replay: the pose after the last block received
    and the motion in force (velocity or target; None: still)."""

    pose: np.ndarray = field(default_factory=lambda: np.eye(4))
    motion: CameraMotion | None = None
    consumed_s: float = 0.0  # media the viewer has taken: the playhead sent to the server


class VllmOmniEngine(RemoteEngine):
    protocol = "vLLM-Omni"

    def __init__(self, urls, model_config, config: EngineConfig = EngineConfig(), remote: RemoteConfig = RemoteConfig(),
                 clock=time.monotonic, start_keeper: bool = True, max_world_blocks: int | None = None,
                 buffer_s: float | None = None) -> None:
        """max_world_blocks: a world's length to ask for (None: open-ended, as our server allows; an upstream
        server needs a number). buffer_s: how far a live world may run ahead of what its viewer took (None: the
        lead the engine config allows, max_lead_blocks + 1 blocks)."""
        super().__init__(urls, model_config, config, remote, clock, start_keeper)
        self.max_world_blocks = max_world_blocks
        block_s = model_config.pixel_frames_per_block / model_config.fps
        self.buffer_s = buffer_s if buffer_s is not None else (config.max_lead_blocks + 1) * block_s

    # -- the protocol

    def _connect(self, url: str) -> VideoStreamClient:
        return VideoStreamClient.connect(url, open_timeout=self.remote.open_timeout_s,
                                         receive_timeout=self.remote.receive_timeout_s,
                                         close_timeout=self.remote.close_timeout_s)

    def _start_message(self, request: StartRequest, **fields) -> dict:
        config = self._model_config
        image_url = "data:image/png;base64," + base64.b64encode(png_bytes(request.picture)).decode()
        return wire.start_message(request.prompt, image_url, width=config.width, height=config.height,
                                  fps=config.fps, seed=request.seed, **fields)

    def _start(self, client: VideoStreamClient, request: StartRequest) -> None:
        frames = (None if self.max_world_blocks is None
                  else self._model_config.pixel_frames_for_blocks(self.max_world_blocks))
        pacing = self.buffer_s if self.remote.output_pacing else None
        client.start(self._start_message(request, num_frames=frames, streaming_buffer_seconds=pacing))

    def _new_wire(self, request: StartRequest) -> _Wire:
        return _Wire()

    def _check_event(self, event: Event) -> None:
        try:
            interaction_for(event)
        except ValueError as exc:
            raise EventError(str(exc)) from None

    def _chunk_block_locked(self, session, server: Server, chunk: VideoChunk, waited_ms: float):
        named = {int(i) for i in chunk.started + chunk.completed if str(i).isdigit()}
        failed = {int(i) for i in session.client.failed_event_ids if i.isdigit()} if session.client else set()
        last = max(named, default=-1)
        applied = []
        while session.sent and session.sent[0].event_id <= last:
            event = session.sent.popleft()
            if event.event_id not in failed:
                applied.append(event)
        record = session.wire
        prompt, camera_input = session.prompt, None
        for event in applied:
            if event.prompt is not None:
                session.prompt = event.prompt
            if isinstance(event, (KeyStateEvent, MotionEvent)):
                camera_input = event  # the last camera input wins (a newer one cancels the one in force)
        if isinstance(camera_input, KeyStateEvent):
            record.motion = CameraMotion.velocity(*velocity_delta(camera_input.keys))
        elif isinstance(camera_input, MotionEvent):
            record.motion = (CameraMotion.velocity(camera_input.translation, camera_input.rotation)
                             if camera_input.mode == "velocity" else
                             CameraMotion.toward(record.pose, camera_input.translation, camera_input.rotation,
                                                 camera_input.steps))
        frames_per_block = self._model_config.transformer.num_frames_per_block
        entry: dict[str, Any]
        if record.motion is None:
            entry = {"frames": [[] for _ in range(frames_per_block)]}
        else:
            poses, record.motion = advance(record.motion, record.pose, frames_per_block)
            record.pose = poses[-1]
            entry = {"poses": [pose.tolist() for pose in poses]}
        entry["event_ids"] = [event.event_id for event in applied]
        if session.prompt != prompt:
            entry["prompt"] = session.prompt
        source = {"server": server.url, "forward_ms": None, "total_ms": waited_ms, "bytes": chunk.payload_bytes}
        return chunk.chunk_index, entry, {}, waited_ms, source

    def _consumed(self, client: VideoStreamClient, session, block: Block) -> None:
        if not self.remote.output_pacing or session.wire is None:
            return
        session.wire.consumed_s += len(block.pixels) / self._model_config.fps
        try:
            client.playback(session.wire.consumed_s)
        except Exception:  # noqa: BLE001 - the connection ended; its thread learns how
            pass

    def _render_start(self, client: VideoStreamClient, request: RenderRequest) -> None:
        blocks = [control.actions for control in request.controls]
        client.start(self._start_message(request.start,
                                         num_frames=self._model_config.pixel_frames_for_blocks(len(blocks)),
                                         camera_action_script=script_from_blocks(blocks)))


def vllm_omni_urls(urls=None, environ=os.environ) -> list[str]:
    """The servers named on the command line (--vllm-omni-url, repeatable), else $LINGBOT_VLLM_OMNI_URLS (comma
    separated)."""
    return server_urls(urls, "LINGBOT_VLLM_OMNI_URLS", environ)


def create_vllm_omni_engine(urls=None, model: str | None = None, config: EngineConfig = EngineConfig(),
                            remote: RemoteConfig = RemoteConfig(), environ=os.environ,
                            max_world_blocks: int | None = None) -> VllmOmniEngine:
    """The app's `--backend vllm-omni`: a VllmOmniEngine over the given servers (or $LINGBOT_VLLM_OMNI_URLS); the
    model config from `model`, $LINGBOT_MODEL or $LINGBOT_TEST_PRESET (tests), else the 14B preset
    (protocols/model_config.py). Loads no weights. ValueError names what is missing."""
    urls = vllm_omni_urls(urls, environ)
    if not urls:
        raise ValueError("--backend vllm-omni needs the realtime servers: --vllm-omni-url ws://host:port (repeat it "
                         "for more), or LINGBOT_VLLM_OMNI_URLS=ws://h1:8000,ws://h2:8000")
    return VllmOmniEngine(urls, served_model_config(model, environ), config, remote, max_world_blocks=max_world_blocks)
