"""SGLang's realtime video protocol served by our engine: `GET /v1/models` and `/v1/realtime_video/generate`.

`python -m lingbot_core.serve` (lingbot_core/serve.py) serves only the protocol (uvicorn), headless;
`python app.py` mounts the same routes beside its page (`RealtimeServer.routes()`), over the page's engine. The wire format is lingbot_core/protocols/sglang/protocol.py,
written from ../shared/reference/sglang-realtime-protocol.md; this module only connects it to the engine.

One WebSocket per session, as upstream, but several sessions per server under the engine's admission
by bytes (upstream refuses a second). A connection:
- waits for a valid `init` (an invalid one, or anything else, gets `error "invalid generate request"`
  with a `detail`, and the server waits for another). `first_frame` is image bytes or a base64
  `data:image/...` URL; this server fetches no URLs, so an http(s) URL is refused, as is no picture.
  The world is generated at the model's own size whatever `size` asks; every frame batch carries the
  true width and height (`realtime_preview_max_width` narrows webp/jpeg frames; raw ones are never
  scaled). guidance_scale, num_inference_steps, fps and the causal sink/window knobs are
  the model's own and are ignored. `condition_inputs.camera_actions` acts as a first event (queued with
  the admission, so chunk 0 applies it).
- is admitted by the engine, or waits in its line (nothing is sent meanwhile: upstream has no waiting
  message); a full line gets `error "CAPACITY_EXHAUSTED"` (the fork's reason) and close 1008.
- then runs two tasks: one receives events (remote/inbound.py turns them into engine events under ids
  of ours, fed to the engine as its queue has room; an invalid one gets `error "invalid event"` and the
  connection stays), one sends each block as frame batches (raw, webp or jpeg) and its `chunk_stats`;
  a chunk's `event_id` is the client's id of the last event its block applied (None: it applied none).
  When either ends, both end, and the engine session is closed (disconnect, shutdown, `max_chunks`:
  close 1000 "generation complete"). A failed block sends `error "error during generate loop: ..."`
  and the session goes on; the engine closing the session sends `error "session closed: <why>"` and
  closes 1000 (idle TTL, eviction), 1001 (the server shuts down) or 1011 (the world could not start).
Every engine call that may block runs on a thread pool, never on the event loop.

Limits (the page's, applied to the protocol; `ServeConfig` and `serving/clients.py`): a browser page of another
origin may not connect (same origin by default: a page on the open web must not take a local user's seats;
`--allow-origin`); at most `max_connections` connections are open, and one address holds at most as many
connections as it may hold worlds on the page (`--max-per-address`), counted together with its page streams;
a connection has `init_timeout_s` to send a valid init; its start picture is decoded in the page's decode
slots; its events are limited to `events_per_s` (bursts of `event_burst`), the rest dropped with one error a
second; a state map holds at most `MAX_TRANSITIONS` transitions. No exception text of ours crosses the wire.

chunk_stats: scheduler_forward_ms is the engine's block time; request_prepare_ms the init's picture
parse and admission (chunk 0) or the feeding of input since the last chunk; pace_wait_ms the wait that
`realtime_output_pacing` adds so chunks are not sent faster than they play; raw_payload_build_ms the
cutting (and image encoding) into batches; header_write_ms / raw_write_ms the writes of the batch maps /
of the bare payloads that follow a `frame_batch_header`; ws_write_ms all frame batch writes;
chunk_total_ms the block time plus everything from the block's arrival to its last write, plus prepare.
raw_bytes: the frame payload bytes; ws_payload_bytes: the WebSocket message bytes of the frame batches.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import BaseRoute, Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from lingbot_core.boundary.events import EventError
from lingbot_core.boundary.image import ImageError, data_url_bytes
from lingbot_core.protocols.sglang.batching import build_frame_batches
from lingbot_core.protocols.sglang.inbound import InboundEvents
from lingbot_core.protocols.sglang.protocol import (CLOSE_NORMAL, CLOSE_POLICY, GENERATE_LOOP_ERROR, GENERATE_PATH, GENERATION_COMPLETE,
                              INVALID_EVENT, INVALID_REQUEST, MODELS_PATH, ChunkStats, ErrorMessage, EventMessage,
                              FrameBatch, InitRequest, ProtocolError, decode_event, decode_init,
                              encode_server_message, error_message)
from lingbot_core.boundary.requests import StartRequest, parse_start
from lingbot_core.protocols.server_base import ProtocolServer, ServeConfig, within_rate
from lingbot_core.serving.clients import ClientGate, LimitReached
from lingbot_core.serving.contract import (Admission, AdmissionRefused, Backend, Block, CloseCause, Closed, Failed,
                                           UnknownSession, Waiting)

log = logging.getLogger(__name__)

CAPACITY_EXHAUSTED = "CAPACITY_EXHAUSTED"  # the fork's refusal reason, sent when the engine's line is full
CLOSE_GOING_AWAY = 1001  # the server shuts down
CLOSE_INTERNAL = 1011  # a fault of ours
CLOSE_TRY_AGAIN = 1013  # too many connections now


class RealtimeServer(ProtocolServer):
    """The protocol over one engine; `routes()` are Starlette routes for any Starlette or FastAPI app."""

    def __init__(self, engine: Backend, config: ServeConfig = ServeConfig(), model_id: str | None = None,
                 gate: ClientGate | None = None) -> None:
        """gate: what each client may hold, shared with the page's streams when the app serves both (None: a gate
        of this server's own, with the page's default limits)."""
        super().__init__(engine, config, gate, "lingbot-serve")
        model = engine.model_config
        # The id is the loaded model's config name (e.g. "tiny", the embedded model's name, or a checkpoint
        # folder's name): stable for one model, and what the page's header shows.
        self.model_id = model_id or model.name
        self.created = int(time.time())

    def routes(self) -> list[BaseRoute]:
        return [Route(MODELS_PATH, self.models, methods=["GET"]), WebSocketRoute(GENERATE_PATH, self.generate)]

    async def models(self, request: Request) -> JSONResponse:
        model = self.engine.model_config
        return JSONResponse({"object": "list", "data": [{
            "id": self.model_id, "object": "model", "created": self.created, "owned_by": "lingbot-world-demo",
            "root": self.model_id, "width": model.width, "height": model.height, "fps": model.fps}]})

    async def generate(self, websocket: WebSocket) -> None:
        async def refuse_full() -> None:
            (data,) = encode_server_message(ErrorMessage(
                CAPACITY_EXHAUSTED, f"{self.open_connections} connections are open, the most this server takes; "
                                    "try again in a minute"))
            await websocket.send_bytes(data)
            await websocket.close(CLOSE_TRY_AGAIN, "too many connections")

        await self.connect(websocket, _Connection(self, websocket).run, refuse_full)

    def close_later(self, session_id: str, reason: str) -> None:
        """Close a session or a place in line without waiting (it may wait for the model thread)."""
        try:
            self._executor.submit(self.engine.close, session_id, reason)
        except RuntimeError:  # the pool is closed: close it here
            self.engine.close(session_id, reason)


class _Ended(Exception):
    """The connection's session is over; how to close the socket."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


class _Connection:
    """One WebSocket: its init, its engine session and the two tasks that serve it."""

    def __init__(self, server: RealtimeServer, websocket: WebSocket) -> None:
        self.server = server
        self.engine = server.engine
        self.ws = websocket
        model = self.engine.model_config
        self.model = model
        self.inbound = InboundEvents(model.transformer.num_frames_per_block, model.text.max_prompt_chars,
                                     self.engine.config.max_queued_events)
        self.session_id: str | None = None
        self.seated = False  # the engine runs the session (not only a place in line)
        self.send_lock = asyncio.Lock()  # a frame_batch_header and its payload never have a message between
        self.feed_lock = asyncio.Lock()  # engine events are posted in order
        self.feed_ms = 0.0  # time spent feeding input since the last chunk (its request_prepare_ms)
        self.end_reason = "the connection ended"  # why the engine session is closed at the end

    # -- the connection's life

    async def run(self) -> None:
        await self.ws.accept()
        code, reason = CLOSE_NORMAL, ""
        tasks: list[asyncio.Task] = []
        claim = None
        try:
            client = self.ws.client
            try:  # a connection counts against its address from the start, as a page stream does
                claim = self.server.gate.claim(None, client.host if client is not None else None)
            except LimitReached as exc:
                await self._send_error(ErrorMessage(CAPACITY_EXHAUSTED, str(exc)))
                raise _Ended(CLOSE_POLICY, CAPACITY_EXHAUSTED) from None
            started = await self._handshake()
            if started is None:
                return
            init, request, prepare_ms = started
            ticket = await self._admit(request)
            self.session_id = ticket.session_id
            if ticket.admission is Admission.WAITING:
                log.info("session %s waits in the engine's line at position %s (nothing is sent while it waits)",
                         ticket.session_id, ticket.position)
            tasks = [asyncio.create_task(self._receive()),
                     asyncio.create_task(self._stream(init, ticket.admission is Admission.WAITING, prepare_ms))]
            done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            for task in done:
                task.result()  # an _Ended or a fault surfaces here
        except _Ended as ended:
            code, reason = ended.code, ended.reason
        except WebSocketDisconnect:  # a write found the client gone
            self.end_reason = "the client disconnected"
        except Exception as exc:  # a fault of ours: the client hears that it was ours (not its text), the server goes on
            log.exception("realtime connection failed")
            code, reason = CLOSE_INTERNAL, "internal error"
            self.end_reason = f"the server failed: {type(exc).__name__}"
            with contextlib.suppress(Exception):
                await self._send_error(ErrorMessage(f"{GENERATE_LOOP_ERROR}an internal error of the server"))
        finally:
            if claim is not None:
                self.server.gate.release(claim)
            for task in tasks:  # this handler itself cancelled (the server stopping): its tasks go too
                task.cancel()
            if self.session_id is not None:  # a session or a place in line; idempotent
                with contextlib.suppress(Exception):
                    await self.server.call(self.engine.close, self.session_id, self.end_reason)
            if self.ws.application_state is WebSocketState.CONNECTED and \
                    self.ws.client_state is WebSocketState.CONNECTED:
                with contextlib.suppress(Exception):  # a close reason is at most 123 bytes of UTF-8
                    await self.ws.close(code, reason.encode()[:123].decode(errors="ignore"))

    async def _handshake(self) -> tuple[InitRequest, StartRequest, float] | None:
        """Until a valid init: (it, its StartRequest, parse ms); None if the client left first. A client that
        sends none within init_timeout_s is told so and closed."""
        deadline = time.monotonic() + self.server.config.init_timeout_s
        while True:
            try:
                data = await asyncio.wait_for(self._next_message(), max(deadline - time.monotonic(), 0.0))
            except asyncio.TimeoutError:
                timeout = self.server.config.init_timeout_s
                await self._send_error(ErrorMessage(INVALID_REQUEST, f"no valid init within {timeout:g} s"))
                raise _Ended(CLOSE_POLICY, "no init") from None
            if data is None:
                return None
            started = time.perf_counter()
            try:
                init = decode_init(data)
                request = await self.server.call(self._start_request, init)
            except ProtocolError as exc:
                log.info("invalid init: %s", exc.detail)
                await self._send_error(error_message(exc))
                continue
            return init, request, 1000.0 * (time.perf_counter() - started)

    def _start_request(self, init: InitRequest) -> StartRequest:
        """The init's picture decoded and fitted, prompt and seed checked (a thread: decoding is costly)."""
        picture = init.first_frame
        if picture is None:
            raise ProtocolError(INVALID_REQUEST, "init needs a first_frame: image bytes or a data:image/ URL")
        if isinstance(picture, str):
            try:
                picture = data_url_bytes(picture, "first_frame")
            except ImageError as exc:
                raise ProtocolError(INVALID_REQUEST, str(exc)) from None
        try:  # in the decode slots the page's starts use: a burst of large pictures queues, never piles up
            request = self.server.gate.decode(parse_start, picture, init.prompt, init.seed, self.model)
        except ValueError as exc:  # ImageError, PromptError, RequestError: their messages name the problem
            raise ProtocolError(INVALID_REQUEST, str(exc)) from None
        camera = (init.condition_inputs or {}).get("camera_actions")
        if camera is not None:  # the init's camera actions act as its first event (no event_id to echo)
            try:
                self.inbound.add(EventMessage("camera_actions", camera, None))
            except ProtocolError as exc:
                raise ProtocolError(INVALID_REQUEST, f"condition_inputs.camera_actions: {exc.detail}") from None
        return request

    async def _admit(self, request: StartRequest):
        # The init's camera actions go in with the admission, so they apply to the very first chunk.
        first = tuple(self.inbound.take(self.engine.config.max_queued_events))
        future = asyncio.ensure_future(self.server.call(self.engine.admit, request, first))
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:  # the admission goes on in its thread: what it opens, nobody reads
            future.add_done_callback(self._close_orphan)
            raise
        except AdmissionRefused as exc:
            log.info("refused a session: %s", exc)
            await self._send_error(ErrorMessage(CAPACITY_EXHAUSTED, str(exc)))
            raise _Ended(CLOSE_POLICY, CAPACITY_EXHAUSTED) from None

    def _close_orphan(self, future: asyncio.Future) -> None:
        if not future.cancelled() and future.exception() is None:
            self.server.close_later(future.result().session_id, "the client left while it was admitted")

    # -- receiving

    async def _next_message(self) -> bytes | str | None:
        """The next client message (binary or text, judged by the decoder); None once the client has left."""
        message = await self.ws.receive()
        if message["type"] == "websocket.disconnect":
            self.end_reason = "the client disconnected"
            return None
        return message["bytes"] if message.get("bytes") is not None else message.get("text")

    async def _receive(self) -> None:
        """Events until the client leaves; an invalid one is answered and skipped, and events past the
        connection's rate are dropped, with one error a second saying so."""
        config = self.server.config

        async def tell_dropped() -> None:
            await self._send_error(ErrorMessage(INVALID_EVENT, f"too many events: at most {config.events_per_s:g} a "
                                                               "second; the events past it are dropped"))

        async for data in within_rate(self._next_message, config, tell_dropped):
            try:
                self.inbound.add(decode_event(data))
            except ProtocolError as exc:
                log.info("session %s: invalid event: %s", self.session_id, exc.detail)
                await self._send_error(error_message(exc))
                continue
            await self._feed()

    async def _feed(self) -> None:
        """Post queued engine events as far as the engine's event queue has room (the rest wait in ours)."""
        async with self.feed_lock:
            if not self.seated or not self.inbound.pending:
                return
            started = time.perf_counter()
            try:
                status = await self.server.call(self.engine.session_status, self.session_id)
            except UnknownSession:
                return  # closed: the sender hears why from the engine
            room = self.engine.config.max_queued_events - status.get("queued_events", 0)
            events = self.inbound.take(room)
            refused = await self.server.call(self._post, events)
            self.feed_ms += 1000.0 * (time.perf_counter() - started)
            for text in refused:
                await self._send_error(ErrorMessage(INVALID_EVENT, text))

    def _post(self, events) -> list[str]:
        refused = []
        for event in events:
            try:
                self.engine.post_event(self.session_id, event)
            except UnknownSession:
                break
            except EventError as exc:  # checked before queueing, so only a session that changed under us
                log.warning("session %s: engine refused event %d: %s", self.session_id, event.event_id, exc)
                refused.append(str(exc))
        return refused

    # -- sending

    async def _send(self, messages: list[bytes]) -> list[float]:
        """Send messages back to back (no other message between them); each one's write time in ms."""
        times = []
        async with self.send_lock:
            for data in messages:
                started = time.perf_counter()
                await self.ws.send_bytes(data)
                times.append(1000.0 * (time.perf_counter() - started))
        return times

    async def _send_error(self, message: ErrorMessage) -> None:
        (data,) = encode_server_message(message)
        await self._send([data])

    async def _wait_for_seat(self) -> None:
        while True:
            message = await self.server.call(self.engine.next_message, self.session_id, self.server.config.poll_s)
            if isinstance(message, Waiting):
                log.info("session %s is at position %d in line", self.session_id, message.position)
            elif isinstance(message, Closed):
                await self._closed(message)
            elif message is not None:  # NewWorld: seated
                return

    async def _closed(self, message: Closed) -> None:
        """The engine ended the session: shutdown (1001), a fault (a world that could not start: 1011), or its
        policy or anyone's request (idle TTL, eviction: 1000)."""
        self.end_reason = message.reason
        code = {CloseCause.SHUTDOWN: CLOSE_GOING_AWAY, CloseCause.FAILED: CLOSE_INTERNAL}.get(message.cause,
                                                                                             CLOSE_NORMAL)
        await self._send_error(ErrorMessage(f"session closed: {message.reason}"))
        raise _Ended(code, message.reason)

    async def _stream(self, init: InitRequest, waiting: bool, prepare_ms: float) -> None:
        """Each block as frame batches and chunk_stats, until max_chunks or the engine ends the session."""
        if waiting:
            await self._wait_for_seat()
        self.seated = True
        await self._feed()
        request_id = f"{self.session_id}_{uuid.uuid4().hex}"
        chunk_index = 0
        play_until: float | None = None  # pacing: when the chunks sent so far finish playing
        fps = self.model.fps
        while True:
            try:
                message = await self.server.call(self.engine.next_message, self.session_id,
                                                 self.server.config.poll_s)
            except UnknownSession:  # closed so long ago that the engine forgot why
                await self._closed(Closed("the session was closed"))
            if isinstance(message, Closed):
                await self._closed(message)
            if isinstance(message, Failed):
                await self._send_error(ErrorMessage(GENERATE_LOOP_ERROR + message.text))
                continue
            if not isinstance(message, Block):  # None (no block yet), NewWorld
                continue
            arrived = time.perf_counter()
            if chunk_index > 0:
                prepare_ms, self.feed_ms = self.feed_ms, 0.0
            event_id = self.inbound.chunk_done(message.event_ids)
            pace_wait_ms = 0.0
            if init.realtime_output_pacing and play_until is not None:
                wait = play_until - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                    pace_wait_ms = 1000.0 * wait
            built = time.perf_counter()
            batches, encoded = await self.server.call(self._build, message, init, request_id, chunk_index, event_id)
            build_ms = 1000.0 * (time.perf_counter() - built)
            header_ms = raw_ms = 0.0
            for messages in encoded:  # one batch: its map, or a frame_batch_header and its payload
                times = await self._send(messages)
                header_ms += times[0]
                raw_ms += sum(times[1:])
            frames = len(message.pixels)
            now = time.monotonic()
            play_until = max(play_until or now, now) + frames / fps
            stats = ChunkStats(
                session_id=self.session_id, request_id=request_id, chunk_index=chunk_index, event_id=event_id,
                request_prepare_ms=prepare_ms, scheduler_forward_ms=message.block_ms, pace_wait_ms=pace_wait_ms,
                header_write_ms=header_ms, raw_payload_build_ms=build_ms, raw_write_ms=raw_ms,
                ws_write_ms=header_ms + raw_ms,
                chunk_total_ms=prepare_ms + message.block_ms + 1000.0 * (time.perf_counter() - arrived),
                num_batches=len(batches), num_frames=frames, raw_bytes=sum(len(b.payload) for b in batches),
                ws_payload_bytes=sum(len(data) for messages in encoded for data in messages),
                content_type=batches[0].content_type)
            await self._send(encode_server_message(stats))
            chunk_index += 1
            if init.max_chunks is not None and chunk_index >= init.max_chunks:
                self.end_reason = GENERATION_COMPLETE
                await self.server.call(self.engine.close, self.session_id, GENERATION_COMPLETE, CloseCause.COMPLETE)
                raise _Ended(CLOSE_NORMAL, GENERATION_COMPLETE)
            await self._feed()

    @staticmethod
    def _build(block: Block, init: InitRequest, request_id: str, chunk_index: int,
               event_id: int | None) -> tuple[list[FrameBatch], list[list[bytes]]]:
        batches = build_frame_batches(block.pixels, request_id=request_id, chunk_index=chunk_index, event_id=event_id,
                                      output_format=init.realtime_output_format,
                                      preview_max_width=init.realtime_preview_max_width, quality=init.output_quality)
        return batches, [encode_server_message(batch) for batch in batches]


# ---------------------------------------------------------------------------------------------
# Headless: python -m lingbot_core.serve


def create_app(server: RealtimeServer):
    """A Starlette app serving only the protocol."""
    from starlette.applications import Starlette

    return Starlette(routes=server.routes())
