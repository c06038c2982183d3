"""The engine over a pool of remote realtime servers, whatever their protocol: a drop-in for serving/engine.py's
Engine. A protocol's backend (lingbot_core/protocols/sglang/backend.py, lingbot_core/protocols/vllm_omni/backend.py)
subclasses it with how to connect, start a world, send an event and read a chunk; everything else is here.

LiveService and app.py use it as they use the local engine: `admit` gives a Ticket, the session's outbox
(`next_message`) gives Waiting, NewWorld, Block, Failed and Closed in order, and `post_event`, `reset`,
`close`, `withdraw`, `pace`, `keep_alive`, `stats`, `session_status`, `replay`, `render` and `shutdown` do what
they do there. The differences, and why:

- Seats: upstream serves one session per server (SGLang and vLLM-Omni alike), so each server URL is one seat
  (lingbot_core/protocols/pool.py): `capacity` is the pool size and admission is by free servers, not bytes. The
  waiting line, its positions, the ticket TTL and the refusal of a full line are the local engine's.
- One thread per session: it waits for a seat, connects and starts the world (the protocol's start message: the
  start picture, prompt, seed, the model's size), then turns each received chunk into a Block. It stops reading
  while max_lead_blocks + 1 blocks wait unread, so TCP holds the server back: a viewer who stops watching costs
  the server nothing once its buffers fill.
- Server trouble: a refusal before the first chunk (a busy server) marks the server busy and the session
  quietly takes the next free seat. Anything else (unreachable, no message within receive_timeout_s, a drop, a
  broken protocol, the server's generation error, a refusal mid-world) marks it down (busy for a refusal) and
  the session gets a Failed message naming the server and what happened, goes back to the FRONT of the line and
  restarts its world from its start request on the next free seat (a NewWorld), at most max_restarts times in a
  row; then it closes with the reason. Busy and down servers are retried after a backoff that doubles per
  failure (pool.py).
- Events keep our ids (increasing per session, stale ones refused as the local session refuses them) and go
  out at once; events posted while the session has no connection wait and go after the next start. Which
  events a chunk applied, and the replay entry that records them, the protocol's backend works out from what
  its chunks say (`_chunk_block_locked`).
- A reset closes the WebSocket and opens a new one on the same seat; Stop, a closed tab, a disconnect and
  the idle TTL (no input, or a ping, for idle_ttl_s on the injected clock) close it and free the seat.
- Blocks carry no latents (the server keeps them) and name their server in `source`.
Nothing here touches PyTorch. Every socket operation has a timeout (RemoteConfig).

Locks: `_lock` guards the tables, the pool and every session's fields; each session's `send_lock` orders its
sends with its resets and (re)connections. Order: a session's send_lock before `_lock`. No socket is read or
written under `_lock`, except that closing one (which never waits on the peer for long) is done outside it too.
"""

from __future__ import annotations

import io
import logging
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from lingbot_core.config import ModelConfig
from lingbot_core.boundary.events import Event, EventError, accept_event
from lingbot_core.boundary.offline import RenderRequest
from lingbot_core.boundary.image import image_digest
from lingbot_core.boundary.requests import StartRequest
from lingbot_core.serving.contract import (Admission, AdmissionRefused, Block, CloseCause, Closed, ClosedSessions,
                                           EngineConfig, Failed, Message, NewWorld, RenderFailedError, RenderRefused,
                                           Ticket)
from lingbot_core.serving.line import post_positions, read_outbox
from lingbot_core.serving.renders import RenderProgress
from lingbot_core.serving.replay import Replay
from lingbot_core.serving.contract import SessionStatus
from lingbot_core.boundary.video import H264Writer
from lingbot_core.protocols.connection import Ended, Outcome, RemoteClosed, RemoteUnavailable
from lingbot_core.protocols.pool import Server, ServerPool, ServerState

log = logging.getLogger(__name__)


class RemoteRenderFailed(RenderFailedError):
    """An offline render's server failed or could not be reached (the message names it); no file is left."""


@dataclass(frozen=True)
class RemoteConfig:
    open_timeout_s: float = 10.0  # connecting and the WebSocket handshake
    receive_timeout_s: float = 60.0  # no message for this long: the server is down (the 14B's first chunk ~3 s)
    close_timeout_s: float = 2.0  # the closing handshake
    backoff_s: float = 2.0  # a busy or down server is retried after this, doubling per failure in a row ...
    max_backoff_s: float = 60.0  # ... up to this
    max_restarts: int = 3  # server failures in a row one world survives (each restarts it on another seat)
    # The server sends chunks no faster than they play (realtime_output_pacing): the live default, so a world
    # runs at most one chunk ahead of its viewer. Off: as fast as the server makes them (benchmarks).
    output_pacing: bool = True

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be at least 0, got {self.max_restarts}")


def png_bytes(picture) -> bytes:
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return buffer.getvalue()


class _Remote:
    """One session: its request, its outbox and, while seated, its server and connection."""

    def __init__(self, session_id: str, request: StartRequest, replay: Replay, now: float) -> None:
        self.session_id = session_id
        self.request = request
        self.replay = replay  # this world's replay: the header, then one entry per block received
        self.outbox: deque[Message] = deque()
        self.position = 0  # the last position posted in line (0: none since it last joined)
        self.in_line = False
        self.seen = now  # last read of the outbox: a place in line nobody reads leaves it (ticket_ttl_s)
        self.readers = 0
        self.server: Server | None = None
        self.client: Any = None  # the protocol's client of the current connection
        self.generation = 0  # bumped by each reset and by the close: a connection of an older one stops
        self.started = False  # a chunk of this connection arrived (its NewWorld is posted)
        self.closed = False
        self.restarts = 0  # server failures in a row (a delivered chunk resets it)
        self.last_input = self.last_consumed = now
        self.last_event_id = -1  # ids increase across resets and restarts, as in the local session
        self.pending: deque[Event] = deque()  # posted while not connected: sent after the next init
        self.sent: deque[Event] = deque()  # sent on this connection, not yet applied by a chunk
        self.wire: Any = None  # the protocol's record of one connection's input (what its chunks applied)
        self.prompt = request.prompt
        self.last_error: str | None = None
        self.send_lock = threading.Lock()
        self.thread: threading.Thread | None = None

    @property
    def blocks_waiting(self) -> int:
        return sum(isinstance(m, Block) for m in self.outbox)

    @property
    def outbox_bytes(self) -> int:
        return sum(m.pixels.nbytes for m in self.outbox if isinstance(m, Block))


class RemoteEngine:
    protocol = "remote"  # the protocol's name, in messages

    def __init__(self, urls, model_config: ModelConfig, config: EngineConfig = EngineConfig(),
                 remote: RemoteConfig = RemoteConfig(), clock: Callable[[], float] = time.monotonic,
                 start_keeper: bool = True) -> None:
        """urls: one realtime server (ws://host:port) per seat. model_config: the served model's
        (remote/model_config.py), for frame size, rate and block length. config: the local engine's line,
        lead, idle and event limits (memory fields are unused). start_keeper: a thread that applies the idle
        TTL and the ticket TTL and retries backed-off servers every worker_poll_s (tests call housekeeping)."""
        self.config = config
        self.remote = remote
        self.clock = clock
        self.pool = ServerPool(urls, remote.backoff_s, remote.max_backoff_s)
        self._model_config = model_config
        self._sessions: dict[str, _Remote] = {}  # every open session, seated or in line
        self._line: deque[_Remote] = deque()
        self._closed = ClosedSessions(self.config.remembered_closes)
        self._threads: list[threading.Thread] = []
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._stopped = False
        self._keeper: threading.Thread | None = None
        if start_keeper:
            self._keeper = threading.Thread(target=self._keep, name="lingbot-remote-keeper", daemon=True)
            self._keeper.start()

    @property
    def model_config(self) -> ModelConfig:
        return self._model_config

    def describe(self) -> str:
        """Where this backend's worlds are made, for the page."""
        return (f"Plays from **{self.capacity} remote {self.protocol} realtime server(s)**, one world per server "
                f"({', '.join(self.urls)}).")

    def prompt_notice(self, prompt: str) -> str | None:
        """None: the remote server holds the tokenizer, and cuts a prompt past its limit as upstream does."""
        return None

    @property
    def capacity(self) -> int:
        return self.pool.capacity

    @property
    def urls(self) -> list[str]:
        return [server.url for server in self.pool.servers]

    # -- admission and the line --------------------------------------------------------------------

    def admit(self, request: StartRequest, first_events: tuple[Event, ...] = (), early_frames: bool = False) -> Ticket:
        """A free server and nobody ahead: ADMITTED (the session's thread connects; NewWorld comes with the
        first chunk). Otherwise a place in line (Waiting messages, then NewWorld). AdmissionRefused when the
        line is full."""
        with self._lock:
            if self._stopped:
                raise AdmissionRefused("the server is shutting down")
            self._expire_locked()
            now = self.clock()
            session = _Remote(uuid.uuid4().hex, request, self._header(request), now)
            server = None if self._line else self.pool.take(session.session_id, now)
            if server is None and len(self._line) >= self.config.max_waiting:
                raise AdmissionRefused(f"every remote server is taken ({self._seated_locked()} worlds on "
                                       f"{self.capacity} servers, {len(self._line)} waiting); try again in a minute")
            for event in first_events:  # sent right after the init, so its first chunk applies them
                session.pending.append(event)
                session.last_event_id = event.event_id
            self._sessions[session.session_id] = session
            if server is not None:
                session.server = server
            else:
                session.in_line = True
                self._line.append(session)
                self._post_positions_locked()
            self._start_thread_locked(session)
            if server is not None:
                return Ticket(Admission.ADMITTED, session.session_id)
            return Ticket(Admission.WAITING, session.session_id, position=len(self._line))

    def _start_thread_locked(self, session: _Remote) -> None:
        thread = threading.Thread(target=self._drive, args=(session,), daemon=True,
                                  name=f"lingbot-remote-{session.session_id[:8]}")
        session.thread = thread
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def _seated_locked(self) -> int:
        return sum(s.server is not None for s in self._sessions.values())

    def _dispatch_locked(self) -> None:
        """Seat the line, first first, on free servers."""
        now = self.clock()
        while self._line and not self._stopped:
            session = self._line[0]
            server = self.pool.take(session.session_id, now)
            if server is None:
                break
            self._line.popleft()
            session.in_line, session.position, session.server = False, 0, server
            session.last_input = now  # the idle TTL counts from the seat, as a new local session's does
        self._post_positions_locked()

    def _post_positions_locked(self) -> None:
        post_positions(self._line)
        self._changed.notify_all()

    def withdraw(self, session_id: str, reason: str = "left the line", cause: CloseCause = CloseCause.USER) -> bool:
        """Leave the line at once; whether it was in it."""
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None or not session.in_line:
                return False
            client = self._close_locked(session, reason, cause)
        self._close_client(client)
        return True

    # -- the session's thread ----------------------------------------------------------------------

    def _drive(self, session: _Remote) -> None:
        """Wait for a seat, play on it until the connection ends, and again, until the session closes."""
        while True:
            with self._lock:
                while not session.closed and session.server is None:
                    self._changed.wait(self.config.worker_poll_s)
                if session.closed:
                    return
                server, generation, request = session.server, session.generation, session.request
            try:
                self._play(session, server, generation, request)
            except Exception as exc:  # a bug, not a server's failure: end this session clearly, not silently
                log.exception("remote session %s failed", session.session_id)
                with self._lock:
                    client = self._close_locked(session, f"internal error: {type(exc).__name__}", CloseCause.FAILED)
                self._close_client(client)
                return

    # -- what a protocol's backend provides --------------------------------------------------------

    def _connect(self, url: str) -> Any:
        """A connected client of the protocol (RemoteUnavailable if not): `send_engine_event(event)`,
        `next_chunk() -> chunk | Ended` (a chunk has `frames`, uint8 [N, H, W, 3]) and `close()`."""
        raise NotImplementedError

    def _start(self, client: Any, request: StartRequest) -> None:
        """Send the protocol's start of a live world (RemoteClosed if the connection ended)."""
        raise NotImplementedError

    def _new_wire(self, request: StartRequest) -> Any:
        """A fresh record of a connection's input, for `_chunk_block_locked`."""
        return None

    def _check_event(self, event: Event) -> None:
        """EventError for an event this protocol cannot carry."""

    def _chunk_block_locked(self, session: _Remote, server: Server, chunk: Any,
                            waited_ms: float) -> tuple[int, dict[str, Any], dict[str, float], float, dict[str, Any]]:
        """A received chunk as a block: (block index, replay entry, stage ms, block ms, source). It takes the
        events the chunk applied off `session.sent` and records them in the entry, as the server applied them."""
        raise NotImplementedError

    def _render_start(self, client: Any, request: RenderRequest) -> None:
        """Send the start of an offline render of these controls (the server ends it after the last block);
        RenderRefused for what the protocol cannot carry (checked before a server is taken: `_render_check`)."""
        raise NotImplementedError

    def _render_check(self, request: RenderRequest) -> None:
        """RenderRefused for a render this protocol cannot carry."""

    def _play(self, session: _Remote, server: Server, generation: int, request: StartRequest) -> None:
        try:
            client = self._connect(server.url)
        except RemoteUnavailable as exc:
            with self._lock:
                if session.generation == generation and not session.closed:
                    self._lost_locked(session, server, ServerState.DOWN, f"could not be reached ({exc})")
            return
        try:
            self._start(client, request)
        except RemoteClosed as exc:
            client.close()
            with self._lock:
                if session.generation == generation and not session.closed:
                    self._lost_locked(session, server, ServerState.DOWN, f"closed before the init ({exc})")
            return
        with session.send_lock:
            with self._lock:
                current = session.generation == generation and not session.closed
                if current:
                    session.client, session.started = client, False
                    session.sent.clear()
                    session.wire, session.prompt = self._new_wire(request), request.prompt
                    pending = list(session.pending)
                    session.pending.clear()
                    session.sent.extend(pending)
            if not current:  # reset or closed while connecting
                client.close()
                return
            for event in pending:
                try:
                    client.send_engine_event(event)
                except RemoteClosed:
                    break  # the receive below learns how it ended
        try:
            self._receive(session, server, generation, client)
        finally:
            client.close()
            with self._lock:
                if session.client is client:
                    session.client = None

    def _receive(self, session: _Remote, server: Server, generation: int, client: Any) -> None:
        lead = self.config.max_lead_blocks
        last = time.monotonic()
        while True:
            with self._lock:
                # Backpressure: stop reading while lead + 1 blocks wait unread; TCP then holds the server back.
                while session.generation == generation and not session.closed and session.blocks_waiting > lead:
                    self._changed.wait(self.config.worker_poll_s)
                if session.generation != generation or session.closed:
                    return
            item = client.next_chunk()
            with self._lock:
                if session.generation != generation or session.closed:
                    return  # a reset or a close ended this connection (item is our own CLOSED)
                config = self._model_config
                if not isinstance(item, Ended) and item.frames.shape[1:3] != (config.height, config.width):
                    # Another model or size than this app plays: its frames cannot join this stream.
                    self._lost_locked(session, server, ServerState.DOWN,
                                      f"it sent {item.frames.shape[2]}x{item.frames.shape[1]} frames, this app plays "
                                      f"{config.width}x{config.height} (does --model name the model it serves?)")
                    return
                if not isinstance(item, Ended):
                    now = time.monotonic()
                    self._take_chunk_locked(session, server, item, 1000.0 * (now - last))
                    last = now
                    continue
                self._ended_locked(session, server, item)
                return

    def _take_chunk_locked(self, session: _Remote, server: Server, chunk: Any, waited_ms: float) -> None:
        if not session.started:
            session.started = True
            self.pool.mark_ok(server)
            session.replay = self._header(session.request)
            session.outbox.append(NewWorld(session.replay.copy()))
        session.restarts = 0
        index, entry, stage_ms, block_ms, source = self._chunk_block_locked(session, server, chunk, waited_ms)
        session.replay.blocks.append(dict(entry))
        session.outbox.append(Block(index, chunk.frames, None, stage_ms, block_ms, entry, source=source))
        self._changed.notify_all()

    def _ended_locked(self, session: _Remote, server: Server, ended: Ended) -> None:
        if ended.outcome is Outcome.REFUSED and not session.started:
            # Someone else's session holds this server: no world was shown, so take the next seat quietly.
            self.pool.mark(server, ServerState.BUSY, ended.message, self.clock())
            self.pool.release(server, session.session_id)
            session.server = None
            self._requeue_locked(session)
            return
        state = {Outcome.REFUSED: ServerState.BUSY, Outcome.COMPLETED: None}.get(ended.outcome, ServerState.DOWN)
        self._lost_locked(session, server, state, ended.detail)

    def _lost_locked(self, session: _Remote, server: Server, state: ServerState | None, what: str) -> None:
        """The seat failed (`state`: how to mark the server, None: it is fine): tell the viewer, free the
        seat, and restart the world at the front of the line (or close, after max_restarts in a row)."""
        if state is not None:
            self.pool.mark(server, state, what, self.clock())
        self.pool.release(server, session.session_id)
        session.server = None
        session.restarts += 1
        limit = self.remote.max_restarts
        text = f"the server {server.url} failed: {what}"
        session.last_error = text
        if session.restarts > limit:
            self._close_locked(session, f"{text}; gave up after {limit} restart(s) in a row", CloseCause.FAILED)
            return
        session.outbox.append(Failed(f"{text}; your world restarts from its start picture on the next free "
                                     f"server (restart {session.restarts} of {limit})"))
        self._requeue_locked(session)

    def _requeue_locked(self, session: _Remote) -> None:
        """Back to the front of the line: the world restarts from its start request when seated."""
        session.client = None
        session.sent.clear()  # input for the lost connection's world
        session.in_line, session.position = True, 0
        self._line.appendleft(session)
        self._dispatch_locked()

    # -- per-session verbs -------------------------------------------------------------------------

    def _open_locked(self, session_id: str) -> _Remote:
        return self._closed.find_open(self._sessions, session_id)

    def post_event(self, session_id: str, raw: dict | Event) -> None:
        """Send one event now (or after the next init, while the session has no connection); EventError (a
        ValueError) names what is wrong, UnknownSession when it is closed."""
        config = self._model_config  # the local session's checks, so a bad event is refused the same way
        event = accept_event(raw, config.transformer.num_frames_per_block, config.text.max_prompt_chars)
        self._check_event(event)
        with self._lock:
            session = self._open_locked(session_id)
        with session.send_lock:
            with self._lock:
                self._open_locked(session_id)
                if event.event_id <= session.last_event_id:
                    raise EventError(f"event_id {event.event_id} is stale or a duplicate; "
                                     f"the next id must exceed {session.last_event_id}")
                client = session.client
                waiting = session.sent if client is not None else session.pending
                if len(waiting) >= self.config.max_queued_events:
                    raise EventError(f"the event queue is full ({self.config.max_queued_events} events); "
                                     "wait for the next block")
                waiting.append(event)
                session.last_event_id = event.event_id
                session.last_input = self.clock()
            if client is not None:
                try:
                    client.send_engine_event(event)
                except RemoteClosed:
                    pass  # the connection just ended: its thread restarts the world (this input went with it)

    def reset(self, session_id: str, request: StartRequest) -> None:
        """A new world: the WebSocket closes and a new one opens on the same seat (blocks of the old world
        not yet taken are dropped; NewWorld comes with the new world's first chunk)."""
        with self._lock:
            session = self._open_locked(session_id)
        with session.send_lock:
            with self._lock:
                self._open_locked(session_id)
                session.request = request
                session.generation += 1
                session.replay = self._header(request)
                session.started = False
                session.restarts = 0
                session.pending.clear()
                session.sent.clear()
                session.outbox = deque(m for m in session.outbox if not isinstance(m, (Block, NewWorld)))
                session.last_input = self.clock()
                client, session.client = session.client, None
                self._changed.notify_all()
        self._close_client(client)

    def keep_alive(self, session_id: str) -> None:
        """A ping from the viewer's client: the idle clock starts again."""
        with self._lock:
            session = self._sessions.get(session_id)
            if session is not None:
                session.last_input = self.clock()

    def prewarm(self, pictures) -> None:
        """As Engine.prewarm, with nothing to do here: each server encodes its own condition streams."""

    def pace(self, session_id: str, start_in_s: float) -> None:
        """Accepted for the stream's sake; the server paces itself (realtime_output_pacing) and the outbox
        bound holds it back. UnknownSession when closed."""
        with self._lock:
            self._open_locked(session_id)

    def next_message(self, session_id: str, timeout: float | None = None) -> Message | None:
        """As Engine.next_message: the next message, None on timeout, Closed once closed."""

        def holder():
            session = self._sessions.get(session_id)
            if session is not None:
                session.last_consumed = self.clock()
            return session

        with self._lock:
            message = read_outbox(self._changed, holder, lambda: self._closed.message(session_id), self.clock,
                                  timeout)
            session = self._sessions.get(session_id) if isinstance(message, Block) else None
            client = session.client if session is not None else None
        if client is not None:
            self._consumed(client, session, message)  # outside the lock: it may write to the socket
        return message

    def _consumed(self, client: Any, session: _Remote, block: Block) -> None:
        """The viewer took this block (a protocol that paces by the playhead tells its server)."""

    def close(self, session_id: str, reason: str = "closed", cause: CloseCause = CloseCause.USER) -> None:
        """Close the session or its place in line (idempotent): the WebSocket closes, the seat frees and the
        first in line takes it."""
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                return
            client = self._close_locked(session, reason, cause)
        self._close_client(client)

    def _close_locked(self, session: _Remote, reason: str, cause: CloseCause = CloseCause.USER
                      ) -> Any:
        """Returns the connection to close (outside the lock)."""
        if session.closed:
            return None
        session.closed = True
        session.generation += 1
        if session.in_line:
            self._line.remove(session)
            session.in_line = False
        if session.server is not None:
            self.pool.release(session.server, session.session_id)
            session.server = None
        session.outbox.clear()
        session.pending.clear()
        session.sent.clear()
        del self._sessions[session.session_id]
        self._closed.remember(session.session_id, Closed(reason, cause))
        client, session.client = session.client, None
        self._dispatch_locked()
        return client

    @staticmethod
    def _close_client(client: Any) -> None:
        if client is not None:
            client.close()

    def _header(self, request: StartRequest) -> Replay:
        return Replay(self._model_config.name, image_digest(request.picture), request.seed, request.prompt)

    def replay(self, session_id: str) -> Replay:
        with self._lock:
            return self._open_locked(session_id).replay.copy()

    def session_status(self, session_id: str) -> dict[str, Any]:
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                return {"status": SessionStatus.CLOSED.value, "closed_reason": self._closed.message(session_id).reason}
            blocks = session.replay.blocks
            return {"status": "waiting" if session.in_line else SessionStatus.ACTIVE.value,
                    "block_index": len(blocks) - 1 if blocks else None, "bytes": session.outbox_bytes,
                    "blocks_waiting": session.blocks_waiting,
                    "queued_events": len(session.sent) + len(session.pending),
                    "server": session.server.url if session.server is not None else None,
                    "restarts": session.restarts, "last_error": session.last_error,
                    "prompt": session.prompt, "waiting_for_input": False}

    def stats(self) -> dict[str, Any]:
        with self._lock:
            counts = self.pool.counts()
            return {"active_sessions": self._seated_locked(), "waiting": len(self._line), "capacity": self.capacity,
                    "accounted_bytes": sum(s.outbox_bytes for s in self._sessions.values()),
                    "servers_total": self.capacity, "servers_up": counts["up"], "servers_busy": counts["busy"],
                    "servers_down": counts["down"]}

    def accounted_bytes(self) -> int:
        """Frames waiting in the outboxes (the servers hold everything else)."""
        return self.stats()["accounted_bytes"]

    def session_ids(self) -> list[str]:
        with self._lock:
            return [sid for sid, s in self._sessions.items() if not s.in_line]

    # -- offline render ----------------------------------------------------------------------------

    def render(self, request: RenderRequest, out_path: Path, owner: str | None = None, progress=None) -> int:
        """An offline video over one free server: the whole script in the protocol's start (`_render_start`), the
        server making exactly its blocks, frames written as they come.

        Refused (RenderRefused) for a camera trajectory (both protocols carry keys, not poses), for a script
        that switches the prompt (a prompt event applies at whichever chunk boundary it reaches, so it cannot
        be tied to a block), for what else the protocol cannot carry (`_render_check`) and when no server is
        free. `owner` is not needed: a render holds a server of its own, never a live world's; `progress` hears
        each block written."""
        if request.start_camera is not None or any(c.poses is not None for c in request.controls):
            raise RenderRefused("the remote servers take keys, not camera trajectories: use an action script, "
                                "or run the app with the local backend for poses.npy + intrinsics.npy")
        if any(c.prompt is not None and c.prompt != request.start.prompt for c in request.controls):
            raise RenderRefused("an action script that switches the prompt cannot be rendered remotely (a prompt "
                                "event cannot be tied to a block there); remove the prompts from the script")
        self._render_check(request)
        holder = f"render-{uuid.uuid4().hex}"
        with self._lock:
            server = None if self._stopped else self.pool.take(holder, self.clock())
        if server is None:
            raise RenderRefused(f"every remote server is taken ({self.capacity}); try again when a world ends")
        config = self._model_config
        written, finished, client, item = 0, False, None, None
        try:
            client = self._connect(server.url)
            self._render_start(client, request)
            writer = H264Writer(out_path, width=config.width, height=config.height, fps=config.fps)
            try:
                while True:
                    item = client.next_chunk()
                    if isinstance(item, Ended):
                        break
                    if item.frames.shape[1:] != (config.height, config.width, 3):
                        raise RemoteRenderFailed(f"{server.url} sent {item.frames.shape[2]}x{item.frames.shape[1]} "
                                           f"frames; this app plays {config.width}x{config.height}")
                    writer.write(item.frames)
                    written += 1
                    if progress is not None:
                        progress(RenderProgress(0, written, len(request.controls)))
            finally:
                writer.close()
            if item.outcome is not Outcome.COMPLETED or written != len(request.controls):
                raise RemoteRenderFailed(f"{server.url}: {item.message} after {written} of "
                                         f"{len(request.controls)} blocks")
            finished = True
        except RemoteUnavailable as exc:
            raise RemoteRenderFailed(f"{server.url} could not be reached: {exc}") from None
        finally:
            if client is not None:
                client.close()
            if not finished:  # no truncated video behind a failed render
                Path(out_path).unlink(missing_ok=True)
            with self._lock:
                self.pool.release(server, holder)
                self._dispatch_locked()
        return written

    # -- housekeeping and shutdown -----------------------------------------------------------------

    def _expire_locked(self) -> list[Any]:
        now = self.clock()
        clients = []
        for session in list(self._sessions.values()):
            if session.in_line:
                if session.readers == 0 and now - session.seen > self.config.ticket_ttl_s:
                    clients.append(self._close_locked(
                        session, f"left the line: nobody waited for {self.config.ticket_ttl_s:.0f} s", CloseCause.IDLE))
            elif now - session.last_input > self.config.idle_ttl_s:
                clients.append(self._close_locked(session, f"no input for {self.config.idle_ttl_s:.0f} s",
                                                  CloseCause.IDLE))
        return clients

    def housekeeping(self) -> None:
        """The idle TTL (seated sessions), the ticket TTL (places in line), and seating the line on servers
        whose backoff ran out. The keeper thread calls this every worker_poll_s."""
        with self._lock:
            clients = self._expire_locked()
            self._dispatch_locked()
        for client in clients:
            self._close_client(client)

    def _keep(self) -> None:
        while True:
            with self._lock:
                if self._stopped:
                    return
            try:
                self.housekeeping()
            except Exception:  # a bug: keep the others served
                log.exception("remote engine housekeeping failed")
            with self._lock:
                if not self._stopped:
                    self._changed.wait(self.config.worker_poll_s)

    def shutdown(self, join_timeout_s: float = 10.0) -> None:
        """Close every session and its WebSocket, and wait for their threads."""
        with self._lock:
            self._stopped = True
            clients = [self._close_locked(s, "server shutting down", CloseCause.SHUTDOWN)
                       for s in list(self._sessions.values())]
            threads = list(self._threads) + ([self._keeper] if self._keeper is not None else [])
            self._changed.notify_all()
        for client in clients:
            self._close_client(client)
        deadline = time.monotonic() + join_timeout_s
        for thread in threads:
            thread.join(max(deadline - time.monotonic(), 0.0))

    def __enter__(self) -> "RemoteEngine":
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()
