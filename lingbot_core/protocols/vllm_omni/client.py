"""A threaded WebSocket client of vLLM-Omni's realtime video protocol (`/v1/realtime/video`).

    client = VideoStreamClient.connect("ws://host:8000", receive_timeout=60)     # RemoteUnavailable if not
    client.start(messages.start_message(prompt, image_url, fps=16, seed=42))
    client.send_engine_event(KeyStateEvent(3, frozenset({"w"})))                 # a velocity interaction "3"
    item = client.next_chunk()   # VideoChunk (frames uint8 [N, H, W, 3] decoded from its fMP4 payload) or Ended
    client.close()

One thread receives (`next_chunk`); any thread may send meanwhile. The fMP4 payloads are decoded once, as they
arrive (lingbot_core/boundary/fmp4.py), into the frames of their chunk. While it waits for a chunk the client
pings every `ping_interval_s` (upstream's stall clock is refreshed by pings, not by interactions; its ComfyUI
player pings every 20 s). Every way a session ends is a typed `Ended` (lingbot_core/protocols/connection.py):
COMPLETED (`session.done` after the last chunk), REFUSED (our server's `server_busy` before the first chunk: a
busy seat), FAILED (an error, then the end), DROPPED (the connection lost without `session.done`), TIMEOUT,
PROTOCOL_ERROR (the server broke the protocol) and CLOSED (we stopped or closed it). `interaction_failed` errors
do not end a session: their event ids are kept in `failed_event_ids`.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import numpy as np
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI
from websockets.sync.client import ClientConnection, connect

from lingbot_core.boundary.events import Event, KeyStateEvent, MotionEvent, PromptEvent
from lingbot_core.boundary.fmp4 import Fmp4Error, Fmp4Reader
from lingbot_core.protocols.connection import Ended, Outcome, RemoteClosed, RemoteUnavailable, close_quietly
from lingbot_core.protocols.vllm_omni import messages as wire
from lingbot_core.protocols.vllm_omni.keys import velocity_payload

LATENT_FRAMES_PER_CHUNK = 3


@dataclass(frozen=True)
class VideoChunk:
    chunk_index: int  # generation_chunk_index
    frames: np.ndarray  # uint8 [N, H, W, 3]
    started: tuple[str, ...]
    active: tuple[str, ...]
    completed: tuple[str, ...]
    payload_bytes: int


def video_url(url: str) -> str:
    """A server address (ws://host:port, or already with the path) -> its realtime video endpoint."""
    parts = urlsplit(url)
    if parts.scheme not in ("ws", "wss") or not parts.netloc:
        raise ValueError(f"a realtime server address is ws://host:port or wss://host:port, got {url!r}")
    path = parts.path.rstrip("/")
    if not path.endswith(wire.PATH):
        path += wire.PATH
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


def interaction_for(event: Event) -> dict:
    """One of our events as one `session.interaction` whose event_id is our id as text: held keys as upstream's
    client converts them (a velocity; no keys: the zero motion that stops), a camera motion as it is, a prompt.
    ValueError for what the protocol cannot carry live (a script of keys or poses)."""
    prompt, camera, transition = event.prompt, None, None
    if isinstance(event, KeyStateEvent):
        camera = velocity_payload(event.keys)
    elif isinstance(event, MotionEvent):
        camera = wire.camera_payload(event.mode, event.translation, event.rotation)
        if event.mode == "target":
            if event.steps % LATENT_FRAMES_PER_CHUNK:
                raise ValueError(f"event {event.event_id}: a target's steps must be whole chunks "
                                 f"({LATENT_FRAMES_PER_CHUNK} latent frames) on this protocol, got {event.steps}")
            transition = event.steps // LATENT_FRAMES_PER_CHUNK
    elif not isinstance(event, PromptEvent):
        raise ValueError(f"event {event.event_id}: vLLM-Omni's protocol takes held keys, camera motion and prompts "
                         "live; a script of keys goes in the start (camera_action_script)")
    return wire.interaction_message(str(event.event_id), prompt=prompt, camera=camera, transition_chunks=transition)


class VideoStreamClient:
    def __init__(self, connection: ClientConnection, url: str, receive_timeout: float, ping_interval_s: float):
        self._ws = connection
        self.url = url
        self.receive_timeout = receive_timeout
        self.ping_interval_s = ping_interval_s
        self._reader = Fmp4Reader()
        self._send_lock = threading.Lock()
        self._ready: deque = deque()
        self._announced: deque[dict] = deque()  # media chunks' metadata whose frames are not all decoded yet
        self._frames: list[np.ndarray] = []  # decoded frames not yet given to a chunk
        self._last_sent = time.monotonic()
        self._stopping = False
        self.request_id: str | None = None
        self.chunks = 0
        self.errors: list[dict] = []
        self.failed_event_ids: list[str] = []
        self.ended: Ended | None = None

    @classmethod
    def connect(cls, url: str, *, open_timeout: float = 10.0, receive_timeout: float = 60.0,
                close_timeout: float = 2.0, ping_interval_s: float = 20.0) -> VideoStreamClient:
        target = video_url(url)
        try:
            # legacy=True: websockets' documented way to hold the connection past one `with` block.
            connection = connect(target, open_timeout=open_timeout, close_timeout=close_timeout, max_size=None,
                                 ping_interval=None, compression=None, proxy=None, legacy=True)
        except (OSError, TimeoutError, InvalidHandshake, InvalidURI) as exc:
            raise RemoteUnavailable(f"{target}: {exc}") from None
        return cls(connection, target, receive_timeout, ping_interval_s)

    # -- sending

    def _send(self, message: dict) -> None:
        if self.ended is not None:
            raise RemoteClosed(self.ended)
        try:
            with self._send_lock:
                self._ws.send(json.dumps(message))
                self._last_sent = time.monotonic()
        except ConnectionClosed:
            raise RemoteClosed(self.ended) from None

    def start(self, message: dict) -> None:
        self._send(message)

    def send_engine_event(self, event: Event) -> str:
        message = interaction_for(event)
        self._send(message)
        return message["interaction"]["event_id"]

    def playback(self, position_seconds: float) -> None:
        self._send(wire.playback_message(position_seconds))

    def stop(self) -> None:
        self._stopping = True
        self._send(wire.stop_message())

    # -- receiving

    def _end(self, outcome: Outcome, code: int | None, detail: str) -> Ended:
        if self.ended is None:
            last = self.errors[-1]["message"] if self.errors else None
            self.ended = Ended(outcome, code, "", last, detail)
        return self.ended

    def _protocol_error(self, detail: str) -> None:
        self._end(Outcome.PROTOCOL_ERROR, None, detail)
        self._close_socket()

    def _take_text(self, text: str) -> None:
        try:
            message = json.loads(text)
        except ValueError:
            return self._protocol_error(f"a text message that is not JSON: {text[:80]!r}")
        kind = message.get("type") if isinstance(message, dict) else None
        if kind == "video.start":
            self.request_id = message.get("request_id")
        elif kind == "video.chunk_metadata":
            try:
                payload = self._ws.recv(timeout=self.receive_timeout)
            except (TimeoutError, ConnectionClosed):
                return self._protocol_error("a chunk's metadata without its payload")
            if not isinstance(payload, bytes) or len(payload) != message.get("byte_length"):
                return self._protocol_error("a chunk's payload is not the binary frame its metadata announced")
            try:
                self._frames.extend(self._reader.feed(payload))
            except Fmp4Error as exc:
                return self._protocol_error(f"a chunk's fMP4 could not be read: {exc}")
            self.chunks += 1
            if message.get("kind") == "media":
                self._announced.append(message)
            self._take_frames()
        elif kind == "error":
            self.errors.append(message)
            if message.get("code") == wire.INTERACTION_FAILED:
                self.failed_event_ids.append(str(message.get("event_id")))
            elif message.get("code") == wire.SERVER_BUSY and self.chunks == 0:
                self._end(Outcome.REFUSED, None, f"the server refused the session: {message.get('message')}")
        elif kind == "session.done":
            try:
                self._frames.extend(self._reader.close())  # what the trailer completed
            except Fmp4Error:
                pass
            self._take_frames()
            if message.get("stopped") is False:
                self._end(Outcome.COMPLETED, None, "generation complete")
            elif self._stopping:
                self._end(Outcome.CLOSED, None, "stopped by this client")
            else:
                why = self.errors[-1]["message"] if self.errors else "no reason given"
                self._end(Outcome.FAILED, None, f"the server stopped the session: {why}")
        elif kind not in ("session.pong", "session.interaction.queued"):
            self._protocol_error(f"an unknown server message {kind!r}")

    def _take_frames(self) -> None:
        """Chunks whose announced frames have all been decoded. A payload need not hold all of its chunk's frames:
        an upstream muxer that does not flush writes a chunk's last frame with the next payload (our server's
        flushes), so a chunk is ready once its frames are in, whichever payloads brought them."""
        while self._announced and len(self._frames) >= int(self._announced[0].get("num_frames") or 0):
            message = self._announced.popleft()
            count = int(message.get("num_frames") or 0)
            frames, self._frames = self._frames[:count], self._frames[count:]
            if not frames:
                continue
            self._ready.append(VideoChunk(int(message["generation_chunk_index"]), np.stack(frames),
                                          tuple(message.get("started_event_ids", ())),
                                          tuple(message.get("active_event_ids", ())),
                                          tuple(message.get("completed_event_ids", ())),
                                          int(message.get("byte_length") or 0)))

    def next_chunk(self, timeout: float | None = None) -> VideoChunk | Ended:
        """The next chunk's frames, or how the session ended (once ended, the same Ended at once)."""
        limit = self.receive_timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        while not self._ready:
            if self.ended is not None:
                return self.ended
            now = time.monotonic()
            if now >= deadline:
                self._end(Outcome.TIMEOUT, None, f"no message from {self.url} within {limit:g} s")
                self._close_socket()
                continue
            if now - self._last_sent >= self.ping_interval_s:
                try:
                    self._send(wire.ping_message())
                except RemoteClosed:
                    pass  # the receive below learns how it ended
            wait = min(deadline, self._last_sent + self.ping_interval_s) - now
            try:
                data = self._ws.recv(timeout=max(wait, 0.0))
            except TimeoutError:
                continue
            except ConnectionClosed as exc:
                if self.errors and self.chunks == 0:
                    self._end(Outcome.FAILED, exc.rcvd.code if exc.rcvd else 1006,
                              f"the server ended the session: {self.errors[-1].get('message')}")
                elif self.errors:
                    self._end(Outcome.FAILED, exc.rcvd.code if exc.rcvd else 1006,
                              f"the server failed: {self.errors[-1].get('message')}")
                else:
                    self._end(Outcome.DROPPED, exc.rcvd.code if exc.rcvd else 1006,
                              f"the connection ended without session.done after {self.chunks} chunk(s)")
                continue
            if isinstance(data, bytes):
                self._protocol_error("a binary frame without its chunk_metadata")
                continue
            self._take_text(data)
        return self._ready.popleft()

    # -- closing

    def _close_socket(self) -> None:
        close_quietly(self._ws)

    def close(self) -> Ended:
        """Close the session (Stop, tab close, idle TTL); how it ended (CLOSED unless it had ended)."""
        if self.ended is None:
            self._close_socket()
            self._end(Outcome.CLOSED, 1000, "closed by this client")
        return self.ended

    def describe(self) -> dict[str, Any]:
        return {"url": self.url, "request_id": self.request_id, "chunks": self.chunks}
