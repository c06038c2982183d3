"""A threaded WebSocket client of SGLang's realtime video protocol.

    client = RealtimeClient.connect("ws://host:30000", receive_timeout=60)   # RemoteUnavailable if not
    client.init(InitRequest(prompt="...", first_frame=png_bytes, size="832x480"))
    client.send_keys({"w"}); client.send_prompt("at night")                     # event ids increase
    item = client.next_chunk()      # ReceivedChunk (frames uint8 [N, H, W, 3] + its ChunkStats) or Ended
    client.close()

One thread receives (`receive` / `next_chunk`); any thread may send meanwhile (the websockets sync
connection allows one receiver and concurrent senders). Every way a session ends is a typed `Ended`:
COMPLETED (close 1000 at max_chunks), REFUSED (1008: a busy server or the fork's admission), FAILED (the
server's "error during generate loop"), DROPPED (the connection lost, or any other close, mid-session),
TIMEOUT (no message within `receive_timeout`; the client closes the socket itself), PROTOCOL_ERROR (the
server broke the protocol) and CLOSED (we closed it). Nothing blocks longer than its timeout.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import numpy as np
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI
from websockets.sync.client import ClientConnection, connect

from lingbot_core.boundary.events import Event
from lingbot_core.protocols.connection import Ended, Outcome, RemoteClosed, RemoteUnavailable, close_quietly
from lingbot_core.protocols.sglang.actions import event_to_message, script_payload, state_payload
from lingbot_core.protocols.sglang.batching import AssembledChunk, ChunkAssembler
from lingbot_core.protocols.sglang.protocol import (CLOSE_NORMAL, CLOSE_POLICY, GENERATE_LOOP_ERROR, GENERATE_PATH, MODELS_PATH, ChunkStats,
                       EventMessage, ErrorMessage, FrameBatch, InitRequest, ProtocolError, ServerMessageReader,
                       encode_client_message, event_wire, init_wire, parse_event,
                       parse_init)


@dataclass(frozen=True)
class ReceivedChunk:
    chunk_index: int
    request_id: str
    event_id: int | None  # the last event the server applied to this chunk
    frames: np.ndarray  # uint8 [N, H, W, 3]
    stats: ChunkStats | None  # None only when the session ended between a chunk's frames and its stats


def generate_url(url: str) -> str:
    """A server address (ws://host:port, or already with the path) -> its realtime generate endpoint."""
    parts = urlsplit(url)
    if parts.scheme not in ("ws", "wss") or not parts.netloc:
        raise ValueError(f"a realtime server address is ws://host:port or wss://host:port, got {url!r}")
    path = parts.path.rstrip("/")
    if not path.endswith(GENERATE_PATH):
        path += GENERATE_PATH
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


def list_models(url: str, timeout: float = 5.0) -> list[str]:
    """GET /v1/models on the server at `url` (ws:// or http://): the ids it serves; RemoteUnavailable if not."""
    parts = urlsplit(url)
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme)
    target = urlunsplit((scheme, parts.netloc, MODELS_PATH, "", ""))
    try:
        with urllib.request.urlopen(target, timeout=timeout) as response:
            body = json.loads(response.read())
        return [str(item["id"]) for item in body["data"]]
    except (OSError, urllib.error.URLError) as exc:
        raise RemoteUnavailable(f"{target}: {exc}") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise RemoteUnavailable(f"{target} did not answer {{'data': [{{'id': ...}}]}} ({exc!r})") from None


class RealtimeClient:
    def __init__(self, connection: ClientConnection, url: str, receive_timeout: float):
        self._ws = connection
        self.url = url
        self.receive_timeout = receive_timeout
        self._reader = ServerMessageReader()
        self._assembler = ChunkAssembler()
        self._complete: AssembledChunk | None = None  # a chunk whose frames are in, awaiting its chunk_stats
        self._ready: deque = deque()
        self._send_lock = threading.Lock()
        self._end_lock = threading.Lock()  # close() from a sender thread races the receiver's own ending
        self._closing = False
        self._initialised = False
        self.last_event_id: int | None = None
        self.last_error: str | None = None
        self.errors: list[str] = []  # every error message's content, in order (next_chunk skips them)
        self.ended: Ended | None = None

    @classmethod
    def connect(cls, url: str, *, open_timeout: float = 10.0, receive_timeout: float = 60.0,
                close_timeout: float = 2.0) -> RealtimeClient:
        target = generate_url(url)
        try:
            # No size limit and no pings, as the reference's clients connect: a raw 832x480 chunk is ~14 MB,
            # and a server busy in a forward pass may answer pings late. No compression: frames do not shrink.
            # legacy=True: websockets' documented way to hold the connection past one `with` block.
            connection = connect(target, open_timeout=open_timeout, close_timeout=close_timeout, max_size=None,
                                 ping_interval=None, compression=None, proxy=None, legacy=True)
        except InvalidURI as exc:
            raise ValueError(f"not a WebSocket address: {target!r} ({exc})") from None
        except (OSError, TimeoutError, InvalidHandshake) as exc:
            raise RemoteUnavailable(f"{target}: {type(exc).__name__}: {exc}") from None
        return cls(connection, target, receive_timeout)

    def __enter__(self) -> RealtimeClient:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # ------------------------------------------------------------ sending

    def _send(self, data: bytes) -> None:
        """Callers hold _send_lock (one message at a time, and event ids assigned in sending order)."""
        if self.ended is not None or self._closing:
            raise RemoteClosed(self.ended)
        try:
            self._ws.send(data)
        except ConnectionClosed:
            raise RemoteClosed(self.ended) from None

    def init(self, request: InitRequest) -> None:
        """Send the session's init; a field the protocol would refuse raises ProtocolError here instead."""
        if self._initialised:
            raise RuntimeError("init was already sent on this connection")
        parse_init(init_wire(request))  # the server's own checks, run before anything is sent
        with self._send_lock:
            self._send(encode_client_message(request))
            self._initialised = True

    def send(self, event: EventMessage) -> int | None:
        """Send one event; its id must exceed the last one sent (None: the next id is assigned). An event the
        protocol would refuse raises ProtocolError here instead."""
        parse_event(event_wire(event))  # the server's own checks, run before anything is sent
        with self._send_lock:
            if not self._initialised:
                raise RuntimeError("send init before any event (the protocol's first message is init)")
            event_id = event.event_id
            if event.kind == "heartbeat" and event_id is None:
                pass  # a keep-alive is no input: it takes no id
            elif event_id is None:
                event_id = 0 if self.last_event_id is None else self.last_event_id + 1
                event = EventMessage(event.kind, event.payload, event_id)
            elif self.last_event_id is not None and event_id <= self.last_event_id:
                raise ValueError(f"event_id {event_id} does not increase (last sent {self.last_event_id})")
            self._send(encode_client_message(event))
            if event_id is not None:
                self.last_event_id = event_id
            return event_id

    def send_keys(self, keys, event_id: int | None = None) -> int | None:
        """The held keys now (level-triggered: they stay held until the next call)."""
        return self.send(EventMessage("camera_actions", state_payload(keys), event_id))

    def send_script(self, frames, event_id: int | None = None) -> int | None:
        """Key sets for the next latent frames, queued by the server."""
        return self.send(EventMessage("camera_actions", script_payload(frames), event_id))

    def send_prompt(self, prompt: str, event_id: int | None = None) -> int | None:
        """A new prompt from the next chunk on."""
        return self.send(EventMessage("prompt", prompt, event_id))

    def send_engine_event(self, event: Event) -> int | None:
        """One of our engine's events (lingbot_core.boundary.events), under its own event_id."""
        return self.send(event_to_message(event))

    # ------------------------------------------------------------ receiving

    def _end(self, outcome: Outcome, code: int | None, reason: str, detail: str) -> Ended:
        with self._end_lock:  # the first ending wins
            if self.ended is None:
                self.ended = Ended(outcome, code, reason, self.last_error, detail)
            return self.ended

    def _ended_by_close(self, exc: ConnectionClosed) -> Ended:
        code = exc.rcvd.code if exc.rcvd is not None else 1006
        reason = exc.rcvd.reason if exc.rcvd is not None else ""
        where = self._position()
        if self._closing:
            return self._end(Outcome.CLOSED, code, reason, "closed by this client")
        if self.last_error is not None and self.last_error.startswith(GENERATE_LOOP_ERROR):
            return self._end(Outcome.FAILED, code, reason, f"{self.last_error} ({where})")
        if code == CLOSE_POLICY:
            why = self.last_error or reason or "policy violation"
            return self._end(Outcome.REFUSED, code, reason, f"the server refused the session: {why}")
        if code == CLOSE_NORMAL and self._assembler.in_progress is None and not self._reader.awaiting_payload:
            return self._end(Outcome.COMPLETED, code, reason, reason or "generation complete")
        how = "without a close frame" if exc.rcvd is None else f"with code {code} {reason!r}".rstrip()
        return self._end(Outcome.DROPPED, code, reason, f"the connection ended {how} {where}")

    def _position(self) -> str:
        if self._assembler.in_progress is not None or self._reader.awaiting_payload:
            chunk = self._assembler.in_progress
            return f"in the middle of chunk {chunk if chunk is not None else '(first batch)'}"
        last = self._assembler.last_chunk_index
        return "before the first chunk" if last is None else f"after chunk {last}"

    def _flush_complete(self) -> None:
        """A complete chunk whose stats will not come (a new chunk began, or the session ended)."""
        if self._complete is not None:
            self._ready.append(self._chunk(self._complete, None))
            self._complete = None

    @staticmethod
    def _chunk(chunk: AssembledChunk, stats: ChunkStats | None) -> ReceivedChunk:
        return ReceivedChunk(chunk.chunk_index, chunk.request_id, chunk.event_id, chunk.frames, stats)

    def _take(self, message) -> None:
        if isinstance(message, ErrorMessage):
            self.last_error = message.content
            self.errors.append(message.content)
            self._ready.append(message)
        elif isinstance(message, FrameBatch):
            if self._complete is not None and message.chunk_index != self._complete.chunk_index:
                self._flush_complete()
            chunk = self._assembler.add(message)
            if chunk is not None:
                self._complete = chunk
        elif isinstance(message, ChunkStats):
            if self._complete is None or message.chunk_index != self._complete.chunk_index:
                raise ProtocolError("invalid server message", f"chunk_stats for chunk {message.chunk_index} "
                                                              f"did not follow that chunk's final frame batch")
            self._ready.append(self._chunk(self._complete, message))
            self._complete = None

    def receive(self, timeout: float | None = None) -> ReceivedChunk | ErrorMessage | Ended:
        """The next whole chunk (with its stats), error message, or the way the session ended. Once ended,
        every call returns the same Ended at once."""
        deadline = time.monotonic() + (self.receive_timeout if timeout is None else timeout)
        while not self._ready:
            if self.ended is not None:
                return self.ended
            try:
                data = self._ws.recv(timeout=max(deadline - time.monotonic(), 0.0))
            except TimeoutError:
                self._flush_complete()
                self._end(Outcome.TIMEOUT, None, "", f"no message from {self.url} within "
                                                     f"{self.receive_timeout if timeout is None else timeout:g} s "
                                                     f"({self._position()})")
                self._close_socket()
                continue
            except ConnectionClosed as exc:
                self._flush_complete()
                self._ended_by_close(exc)
                continue
            try:
                message = self._reader.feed(data)
                if message is not None:
                    self._take(message)
            except ProtocolError as exc:
                self._flush_complete()
                self._end(Outcome.PROTOCOL_ERROR, None, "", exc.detail)
                self._close_socket()
        return self._ready.popleft()

    def next_chunk(self, timeout: float | None = None) -> ReceivedChunk | Ended:
        """Like receive, skipping error messages (they stay in `errors`; `last_error` is the latest)."""
        while True:
            item = self.receive(timeout)
            if not isinstance(item, ErrorMessage):
                return item

    # ------------------------------------------------------------ closing

    def _close_socket(self) -> None:
        self._closing = True
        close_quietly(self._ws)

    def close(self) -> Ended:
        """Close the session (Stop, tab close, idle TTL); returns how it ended (CLOSED unless it had ended)."""
        if self.ended is None:
            self._close_socket()
            self._end(Outcome.CLOSED, CLOSE_NORMAL, "", "closed by this client")
        return self.ended
