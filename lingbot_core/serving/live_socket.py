"""The page's low-latency player: a WebSocket on the app's own port that carries a world's frames to the page as
soon as they are made and its keys back, while the world's stream (serving/streaming.py) keeps its lifecycle,
its per-client limits and its recording.

    WebSocket /lingbot/live?ticket=T

Gradio's streaming video muxes each block into a segment, probes and remuxes it in two processes and serves it
over HLS, whose player waits for whole segments and keeps its own buffer: about two seconds from a key to the
screen. Here each frame travels as one JPEG the moment its block reaches the stream, and the page draws it on a
canvas from a small jitter buffer at the model's frame rate (page/player.js).

A ticket names one stream and is issued only to the Gradio session that owns it (`LiveService.ticket`, through
a private endpoint of the page), so the page's rules hold on the socket: the world obeys only its viewer, one
world a browser session, the per-address limit and the idle TTL (the stream's), and closing the tab frees the
seat (Gradio's unload). A browser page of another origin cannot connect.

Server to page: one binary message a frame, a 16-byte header (little-endian u32: block index, frame index in
its block, frames in the block, frames sent so far) then the JPEG; text messages {"type": "error" | "closed",
"text": ...}. Page to server, text JSON: {"event_id": n, "keys": [...]} (the keys now held, the page's own
ids) or {"playhead": seconds, "stalls": n} (what it presented, for the stream's pacing).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import struct
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from PIL import Image
from starlette.routing import BaseRoute, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from lingbot_core.serving.clients import origin_allowed
from lingbot_core.serving.streaming import LiveService, StreamError

log = logging.getLogger(__name__)

LIVE_PATH = "/lingbot/live"
HEADER = struct.Struct("<4I")
MAX_MESSAGE_CHARS = 4096  # a key state or a playhead report is tens of bytes
CLOSE_POLICY = 1008
JPEG_QUALITY = 85


def encode_frames(pixels: np.ndarray, block_index: int, first: int, frames_in_block: int, sent: int,
                  quality: int = JPEG_QUALITY) -> list[bytes]:
    """Uint8 frames [n, H, W, 3] of a block, from its frame `first` on, as the socket's messages: header + JPEG,
    one a frame."""
    out = []
    for index, frame in enumerate(pixels):
        buffer = io.BytesIO()
        Image.fromarray(frame).save(buffer, format="JPEG", quality=quality)
        out.append(HEADER.pack(block_index, first + index, frames_in_block, sent + index + 1) + buffer.getvalue())
    return out


class LiveSocket:
    """The WebSocket route of the page's player over one LiveService."""

    def __init__(self, service: LiveService, allowed_origins: tuple[str, ...] = (), workers: int = 2) -> None:
        self.service = service
        self.allowed_origins = allowed_origins
        # JPEG encoding: off the model thread and off the event loop, a frame at a time.
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lingbot-live")

    def routes(self) -> list[BaseRoute]:
        return [WebSocketRoute(LIVE_PATH, self.handle)]

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def handle(self, ws: WebSocket) -> None:
        if not origin_allowed(ws.headers.get("origin"), ws.headers.get("host"), self.allowed_origins):
            await ws.close(code=CLOSE_POLICY)  # before the handshake completes: an HTTP 403
            return
        try:
            channel = self.service.connect_player(ws.query_params.get("ticket", ""))
        except StreamError as exc:
            await ws.accept()
            await ws.send_text(json.dumps({"type": "error", "text": str(exc)}))
            await ws.close(code=CLOSE_POLICY)
            return
        await ws.accept()
        tasks = [asyncio.create_task(self._send(ws, channel)), asyncio.create_task(self._receive(ws, channel))]
        try:
            done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            for task in done:
                if task.exception() is not None and not isinstance(task.exception(), WebSocketDisconnect):
                    log.warning("live socket failed: %r", task.exception())
        finally:
            self.service.disconnect_player(channel)
            with contextlib.suppress(Exception):  # the page may be gone already
                await ws.close()

    async def _send(self, ws: WebSocket, channel) -> None:
        loop = asyncio.get_running_loop()
        sent = 0
        while True:
            item = await channel.queue.get()
            if item is None:  # the world ended: the stream says why on the page
                await ws.send_text(json.dumps({"type": "closed", "text": channel.ended or "the world ended"}))
                return
            block_index, first, frames_in_block, pixels = item
            messages = await loop.run_in_executor(self._executor, encode_frames, pixels, block_index, first,
                                                  frames_in_block, sent)
            for data in messages:
                await ws.send_bytes(data)
            sent += len(messages)

    async def _receive(self, ws: WebSocket, channel) -> None:
        loop = asyncio.get_running_loop()
        while True:
            text = await ws.receive_text()
            try:
                if len(text) > MAX_MESSAGE_CHARS:
                    raise StreamError(f"a player message is at most {MAX_MESSAGE_CHARS} characters")
                try:
                    message = json.loads(text)
                except json.JSONDecodeError:
                    raise StreamError("a player message must be JSON") from None
                if not isinstance(message, dict):
                    raise StreamError("a player message must be a JSON object")
                if "keys" in message:
                    await loop.run_in_executor(self._executor, self.service.act, channel.session_id,
                                               {"event_id": message.get("event_id"), "keys": message["keys"]},
                                               channel.viewer)
                elif "playhead" in message:
                    self.service.report_playhead(channel.session_id, message["playhead"], channel.viewer,
                                                 message.get("stalls"))
                else:
                    raise StreamError("a player message holds keys or a playhead")
            except StreamError as exc:  # refused with the reason; the world goes on
                await ws.send_text(json.dumps({"type": "error", "text": str(exc)}))

