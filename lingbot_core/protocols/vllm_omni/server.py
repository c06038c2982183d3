"""vLLM-Omni's realtime video protocol served by our engine: `WS /v1/realtime/video`.

The wire format is lingbot_core/protocols/vllm_omni/messages.py, written from
../shared/reference/vllm-omni-realtime-protocol.md; this module connects it to the engine (any Backend), beside
SGLang's route on the same port (`python -m lingbot_core.serve`, `python app.py`). One WebSocket is one session,
as upstream; unlike upstream (one session a replica), a server holds several, under the engine's admission by
bytes, and a session past the seats waits in the engine's line (nothing is sent while it waits, as upstream has no
waiting message; a full line gets `error` and the socket closes).

A connection, in upstream's order:
- `session.start` within START_TIMEOUT_S, at most 4 MiB; a bad one gets upstream's error and the socket closes.
- `video.start` at once, before the picture is decoded (as upstream); what fails after it (the picture, the size,
  `num_frames`, `action_path`) gets `error` and the socket closes with no `session.done` (a generation error).
- each block: `video.chunk_metadata` then its binary fMP4 payload (lingbot_core/boundary/fmp4.py; payload 0 holds
  the header), back to back under one send lock; the ids lists say which interactions a chunk started, carried
  (a velocity held, a target still gliding) and completed (a target reached, a command superseded, a prompt).
- `session.interaction` (≤ 128 KiB): a camera command (velocity or target, SE(3)) becomes a MotionEvent and a
  prompt a PromptEvent (or both), applied at the next block boundary; acked with `session.interaction.queued`;
  a refused one gets `error` code `interaction_failed` and the session goes on; an id reused gets
  `event_id_conflict`. `session.ping` → `session.pong` (and the engine's idle clock starts again);
  `session.playback` moves the playhead of a paced session; `session.stop` → `session.done{stopped:true}`.
- the end: after `num_frames` the trailer payload and `session.done{stopped:false}`; with no `num_frames` the
  world runs until stop, disconnect, the stall timeout or the engine's idle TTL (our worlds have no length limit).

What the reference leaves open, decided here (README Conventions): the world's size is the model's (`width`/
`height`, when given, must equal it); `num_frames` must be a whole number of blocks (9 + 12k on the shipped
models) or omitted for an open-ended world; the seed defaults to 42 (upstream's examples); `fps` sets the MP4's
clock as upstream (default 24) while the model makes its own frames; `num_inference_steps` and `flow_shift` are
the model's own and ignored; a prompt switch is hard (upstream lerps the text over `transition_chunks`); only
data: URLs are taken (this server fetches no URLs); `action_path` is refused (no trusted root here); a binary
client message gets "WebSocket messages must be JSON objects". A paced session (`streaming_buffer_seconds`)
stops reading blocks while its media is that far ahead of the playhead, so the engine's backpressure holds the
world back. Limits shared with SGLang's route and the page: protocols/server_base.py and serving/clients.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass, field

from starlette.routing import BaseRoute, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from lingbot_core.boundary.events import EventError, MotionEvent, PromptEvent, ScriptEvent
from lingbot_core.boundary.fmp4 import Fmp4Writer
from lingbot_core.boundary.image import data_url_bytes
from lingbot_core.boundary.requests import StartRequest, parse_start
from lingbot_core.protocols.server_base import ProtocolServer, ServeConfig, within_rate
from lingbot_core.protocols.vllm_omni import messages as wire
from lingbot_core.serving.clients import ClientGate, LimitReached
from lingbot_core.serving.contract import (Admission, AdmissionRefused, Backend, Block, CloseCause, Closed, Failed,
                                           UnknownSession, Waiting)

log = logging.getLogger(__name__)

DEFAULT_SEED = 42  # upstream's default is not found; its examples and validation use 42
CODEC_OPTION_KEYS = {"preset", "crf", "tune", "g", "profile"}  # what a client may set of the encoder
FAST_PRESETS = ("ultrafast", "superfast", "veryfast", "faster", "fast", "medium")


class _Ended(Exception):
    """The session is over (the socket closes)."""


@dataclass
class _Command:
    """A client interaction as the engine took it: its client id and, for a camera target, when it arrives."""

    client_id: str
    camera: str | None  # "velocity" | "target" | None (a prompt only)
    steps: int = 0  # a target's latent steps
    started_block: int | None = None


@dataclass
class _Chunks:
    """What each chunk's metadata says of the interactions (started, active, completed)."""

    latent_frames: int
    commands: dict[int, _Command] = field(default_factory=dict)  # engine id -> command, until completed
    camera: int | None = None  # the engine id of the camera command in force
    pending_completed: list[str] = field(default_factory=list)  # superseded before they applied, etc.

    def lists(self, block: Block) -> tuple[list[str], list[str], list[str]]:
        started, completed = [], list(self.pending_completed)
        self.pending_completed.clear()
        for engine_id in block.event_ids:
            command = self.commands.get(engine_id)
            if command is None:
                continue
            started.append(command.client_id)
            command.started_block = block.block_index
            if command.camera is not None:
                if self.camera is not None and self.camera in self.commands:  # a newer camera event supersedes
                    completed.append(self.commands.pop(self.camera).client_id)
                self.camera = engine_id
            else:
                completed.append(self.commands.pop(engine_id).client_id)  # a prompt: switched at this block
        active = []
        current = self.commands.get(self.camera) if self.camera is not None else None
        if current is not None:
            active.append(current.client_id)
            blocks_needed = max(1, -(-current.steps // self.latent_frames))
            if current.camera == "target" and block.block_index - current.started_block + 1 >= blocks_needed:
                completed.append(self.commands.pop(self.camera).client_id)  # reached in this chunk
                self.camera = None
        return started, active, completed


class VideoStreamServer(ProtocolServer):
    """The protocol over one engine; `routes()` are Starlette routes for any Starlette or FastAPI app."""

    def __init__(self, engine: Backend, config: ServeConfig = ServeConfig(), model_id: str | None = None,
                 gate: ClientGate | None = None, start_timeout_s: float = wire.START_TIMEOUT_S,
                 stall_timeout_s: float = wire.STALL_TIMEOUT_S) -> None:
        super().__init__(engine, config, gate, "lingbot-video")
        self.model_id = model_id or engine.model_config.name
        self.start_timeout_s = start_timeout_s
        self.stall_timeout_s = stall_timeout_s

    def routes(self) -> list[BaseRoute]:
        return [WebSocketRoute(wire.PATH, self.video)]

    async def video(self, websocket: WebSocket) -> None:
        async def refuse_full() -> None:
            await websocket.send_text(json.dumps(wire.error(
                f"{self.open_connections} connections are open, the most this server takes; try again later",
                code=wire.SERVER_BUSY)))
            await websocket.close()

        await self.connect(websocket, _Connection(self, websocket).run, refuse_full)


class _Connection:
    def __init__(self, server: VideoStreamServer, websocket: WebSocket) -> None:
        self.server = server
        self.engine = server.engine
        self.model = server.engine.model_config
        self.ws = websocket
        self.request_id = wire.new_request_id()
        self.session_id: str | None = None
        self.start: wire.SessionStart | None = None
        self.send_lock = asyncio.Lock()  # a chunk's metadata and its payload are never split
        self.next_engine_id = 0
        self.used_ids: set[str] = set()  # client event ids accepted in this session
        self.chunks = _Chunks(self.model.transformer.num_frames_per_block)
        self.codec_options: dict[str, str] | None = None  # checked with the start (_prepare)
        self.scripted = False  # a camera_action_script drives the camera: live camera commands are refused
        self.blocks_sent = 0
        self.payloads = 0
        self.progress = time.monotonic()  # the stall clock: video.start, each chunk sent, each ping
        self.playhead_s = 0.0
        self.media_s = 0.0
        self.end_reason = "the client disconnected"

    # -- the connection's life

    async def run(self) -> None:
        await self.ws.accept()
        claim = None
        tasks: list[asyncio.Task] = []
        try:
            client = self.ws.client
            try:
                claim = self.server.gate.claim(None, client.host if client is not None else None)
            except LimitReached as exc:
                await self._send(wire.error(str(exc), code=wire.SERVER_BUSY))
                return
            start = await self._session_start()
            if start is None:
                return
            self.start = start
            await self._send(wire.video_start(self.request_id, start.config))
            self.progress = time.monotonic()
            try:
                request, first = await self.server.call(self._prepare, start)
                ticket = await self.server.call(self.engine.admit, request, first)
            except (ValueError, wire.ProtocolError) as exc:  # the picture, the size, num_frames, action_path
                await self._send(wire.error(getattr(exc, "message", None) or str(exc)))
                return
            except AdmissionRefused as exc:
                await self._send(wire.error(str(exc), code=wire.SERVER_BUSY, request_id=self.request_id))
                return
            self.session_id = ticket.session_id
            if ticket.admission is Admission.WAITING:
                log.info("session %s waits in line at position %s", ticket.session_id, ticket.position)
            tasks = [asyncio.create_task(self._receive()), asyncio.create_task(self._stream()),
                     asyncio.create_task(self._watch_stall())]
            done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            for task in done:
                with contextlib.suppress(_Ended):
                    task.result()
        except WebSocketDisconnect:
            self.end_reason = "the client disconnected"
        except Exception:  # a fault of ours: said without its text, the server goes on
            log.exception("video stream connection failed")
            self.end_reason = "the server failed"
            with contextlib.suppress(Exception):
                await self._send(wire.error("internal server error", request_id=self.request_id))
        finally:
            for task in tasks:
                task.cancel()
            if claim is not None:
                self.server.gate.release(claim)
            if self.session_id is not None:
                with contextlib.suppress(Exception):
                    await self.server.call(self.engine.close, self.session_id, self.end_reason)
            if self.ws.application_state is WebSocketState.CONNECTED and \
                    self.ws.client_state is WebSocketState.CONNECTED:
                with contextlib.suppress(Exception):
                    await self.ws.close()

    async def _session_start(self) -> wire.SessionStart | None:
        try:
            text = await asyncio.wait_for(self._next_text(), self.server.start_timeout_s)
        except asyncio.TimeoutError:
            await self._send(wire.error(wire.START_TIMEOUT))
            return None
        if text is None:
            return None
        try:
            return wire.parse_start(text, self.server.model_id)
        except wire.ProtocolError as exc:
            log.info("refused a session.start: %s", exc)
            await self._send(exc.wire())
            return None

    def _prepare(self, start: wire.SessionStart) -> tuple[StartRequest, tuple]:
        """The start's picture decoded (in the page's decode slots) and checked against this model; the camera
        script as the first events. Raises ValueError (or ProtocolError) naming the problem."""
        model = self.model
        if (start.width is not None and start.width != model.width) or \
                (start.height is not None and start.height != model.height):
            raise ValueError(f"this server's model makes {model.width}x{model.height} video; "
                             f"width and height must be those or omitted, got {start.width}x{start.height}")
        if start.num_frames is not None and self._blocks_for(start.num_frames) is None:
            first, later = model.pixel_frames_for_blocks(1), model.pixel_frames_for_blocks(2) - model.pixel_frames_for_blocks(1)
            raise ValueError(f"num_frames must be {first} + {later}k frames (whole blocks), got {start.num_frames}")
        if start.action_path is not None:
            raise ValueError("action_path is not supported by this server (no trusted action root): send "
                             "extra_params.camera_action_script or camera interactions")
        self.codec_options = _codec_options(start.codec_options)
        picture = data_url_bytes(start.image_url, "image_reference.image_url")
        seed = start.seed if start.seed is not None else DEFAULT_SEED
        request = self.server.gate.decode(parse_start, picture, start.prompt, seed, model)
        first = []
        if start.camera_action_script is not None:
            limit = self.engine.config.max_queued_events  # the engine's queue holds the whole script at once
            if len(start.camera_action_script) > limit:
                raise ValueError(f"camera_action_script holds {len(start.camera_action_script)} chunks; this server "
                                 f"takes at most {limit} in one session")
            self.scripted = True
            for chunk in start.camera_action_script:
                first.append(ScriptEvent(self._engine_id(), tuple(chunk)))
        return request, tuple(first)

    def _blocks_for(self, num_frames: int) -> int | None:
        """How many whole blocks make `num_frames` (12N - 3 on the shipped models), or None if none do."""
        model = self.model
        blocks, extra = divmod(num_frames + model.vae_temporal_factor - 1, model.pixel_frames_per_block)
        return blocks if blocks >= 1 and extra == 0 else None

    def _engine_id(self) -> int:
        self.next_engine_id += 1
        return self.next_engine_id - 1

    # -- receiving

    async def _next_text(self) -> str | None:
        """The next client message as text (a binary one as None-text marker b''); None once the client left."""
        message = await self.ws.receive()
        if message["type"] == "websocket.disconnect":
            self.end_reason = "the client disconnected"
            return None
        if message.get("text") is not None:
            return message["text"]
        return ""  # a binary frame: not JSON text (the parsers refuse it with upstream's words)

    async def _receive(self) -> None:
        config = self.server.config

        async def tell_dropped() -> None:
            await self._send(wire.error(f"too many messages: at most {config.events_per_s:g} a second; the messages "
                                        "past it are dropped", request_id=self.request_id))

        async for text in within_rate(self._next_text, config, tell_dropped):
            try:
                message = wire.parse_control(text) if text else _binary()
            except wire.ProtocolError as exc:
                log.info("session %s: refused a message: %s", self.session_id, exc)
                await self._send(exc.wire(self.request_id))
                continue
            if isinstance(message, wire.Ping):
                self.progress = time.monotonic()
                await self.server.call(self.engine.keep_alive, self.session_id)
                await self._send(wire.pong())
            elif isinstance(message, wire.Stop):
                self.end_reason = "the client stopped the session"
                await self.server.call(self.engine.close, self.session_id, self.end_reason)
                await self._send(wire.done(self.request_id, self.payloads, True))
                raise _Ended()
            elif isinstance(message, wire.Playback):
                self.playhead_s = max(self.playhead_s, min(message.position_seconds, self.media_s))
            else:
                await self._interaction(message)

    async def _interaction(self, interaction: wire.Interaction) -> None:
        client_id = interaction.event_id or wire.new_event_id()
        if client_id in self.used_ids:
            await self._send(wire.error(wire.EVENT_ID_CONFLICT, code=wire.EVENT_ID_CONFLICT,
                                        request_id=self.request_id, event_id=client_id))
            return
        problem = None
        if interaction.other_modalities:
            problem = f"modality {interaction.other_modalities[0]!r} is not supported"
        elif interaction.camera is not None and self.scripted:
            problem = "Cannot use mid-generation camera interaction together with camera_action_script"
        elif interaction.prompt is not None and self.blocks_sent == 0:
            problem = "prompt_update is not allowed before initial generation has started"
        event = None
        if problem is None:
            engine_id = self._engine_id()
            camera = interaction.camera
            if camera is not None:
                transition = (interaction.transition_chunks if interaction.transition_chunks is not None
                              else wire.CAMERA_TRANSITION_CHUNKS_DEFAULT)
                steps = round(transition * self.chunks.latent_frames) if camera.mode == "target" else 0
                event = MotionEvent(engine_id, camera.mode, tuple(camera.translation), tuple(camera.rotation),
                                    steps, interaction.prompt)
                command = _Command(client_id, camera.mode, steps)
            else:
                event = PromptEvent(engine_id, interaction.prompt)
                command = _Command(client_id, None)
            self.used_ids.add(client_id)
            self.chunks.commands[engine_id] = command
            try:
                await self.server.call(self.engine.post_event, self.session_id, event)
            except (EventError, UnknownSession) as exc:
                self.used_ids.discard(client_id)  # a failed id is released (upstream)
                self.chunks.commands.pop(engine_id, None)
                log.info("session %s: interaction %s refused: %s", self.session_id, client_id, exc)
                problem = "refused"
        if problem is not None:
            log.info("session %s: interaction %s failed: %s", self.session_id, client_id, problem)
            await self._send(wire.error(wire.INTERACTION_FAILED_MESSAGE, code=wire.INTERACTION_FAILED,
                                        request_id=self.request_id, event_id=client_id))
            return
        await self._send(wire.interaction_queued(self.request_id, client_id))

    # -- sending

    async def _send(self, message: dict, payload: bytes | None = None) -> None:
        async with self.send_lock:
            await self.ws.send_text(json.dumps(message))
            if payload is not None:
                await self.ws.send_bytes(payload)

    async def _watch_stall(self) -> None:
        """Upstream's stall timeout: no progress (a chunk sent, a ping) for stall_timeout_s ends the session."""
        while True:
            await asyncio.sleep(min(1.0, self.server.stall_timeout_s / 4))
            if time.monotonic() - self.progress > self.server.stall_timeout_s:
                self.end_reason = "no generation progress"
                await self._send(wire.error(wire.STALL_TIMEOUT, request_id=self.request_id))
                await self.server.call(self.engine.close, self.session_id, self.end_reason)
                await self._send(wire.done(self.request_id, self.payloads, True))
                raise _Ended()

    async def _stream(self) -> None:
        start = self.start
        total = None if start.num_frames is None else self._blocks_for(start.num_frames)
        writer = await self.server.call(Fmp4Writer, self.model.width, self.model.height, start.fps,
                                        self.codec_options)
        buffer_s = start.streaming_buffer_seconds
        while True:
            if buffer_s is not None and self.media_s - self.playhead_s >= buffer_s:
                await asyncio.sleep(0.05)  # paced: far enough ahead of the playhead; the engine waits too
                continue
            try:
                message = await self.server.call(self.engine.next_message, self.session_id,
                                                 self.server.config.poll_s)
            except UnknownSession:
                message = Closed("the session was closed")
            if isinstance(message, Closed):
                self.end_reason = message.reason
                await self._send(wire.error(f"session closed: {message.reason}", request_id=self.request_id))
                await self._send(wire.done(self.request_id, self.payloads, True))
                raise _Ended()
            if isinstance(message, Failed):  # the engine's session goes on: so does ours (upstream would end)
                await self._send(wire.error(f"generation failed: {message.text}", request_id=self.request_id))
                continue
            if isinstance(message, Waiting) or not isinstance(message, Block):
                continue
            payload = await self.server.call(writer.add, message.pixels)
            started, active, completed = self.chunks.lists(message)
            frames = len(message.pixels)
            await self._send(wire.chunk_metadata(self.request_id, "media", self.payloads, self.blocks_sent, frames,
                                                 len(payload), started, active, completed), payload)
            self.payloads += 1
            self.blocks_sent += 1
            self.media_s += frames / start.fps
            self.progress = time.monotonic()
            if total is not None and self.blocks_sent >= total:
                trailer = await self.server.call(writer.close)
                await self._send(wire.chunk_metadata(self.request_id, "trailer", self.payloads, None, 0, len(trailer),
                                                     [], [], []), trailer)
                self.payloads += 1
                self.end_reason = "generation complete"
                await self.server.call(self.engine.close, self.session_id, self.end_reason, CloseCause.COMPLETE)
                await self._send(wire.done(self.request_id, self.payloads, False))
                raise _Ended()


def _binary():
    raise wire.ProtocolError(wire.NOT_OBJECT, fatal=False)


def _codec_options(options: dict[str, str] | None) -> dict[str, str] | None:
    """The encoder options a client may set: fast presets, a crf, a tune, a GOP; nothing that costs the server
    more than `medium` (upstream passes them through; a shared server cannot)."""
    if options is None:
        return None
    unknown = set(options) - CODEC_OPTION_KEYS
    if unknown:
        raise ValueError(f"video_codec_options may set {', '.join(sorted(CODEC_OPTION_KEYS))}; "
                         f"not {', '.join(sorted(unknown))}")
    if "preset" in options and options["preset"] not in FAST_PRESETS:
        raise ValueError(f"video_codec_options preset must be one of {', '.join(FAST_PRESETS)}")
    for key in ("crf", "g"):
        if key in options and not (str(options[key]).isdigit() and 0 <= int(options[key]) <= 250):
            raise ValueError(f"video_codec_options {key} must be a whole number from 0 to 250")
    return {key: str(value) for key, value in options.items()}  # they replace the defaults wholesale, as upstream
