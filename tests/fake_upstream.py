"""An upstream-like SGLang realtime server for the remote backend's tests, written from the reference
(../shared/reference/sglang-realtime-protocol.md) with plain msgpack maps, not with our codec.

Like upstream it serves ONE session at a time: a second connection waits up to 1 s, then gets the error
"another realtime session is already active" and close 1008. A session is continuous (no max_chunks) unless
the init asks for max_chunks: chunk 0 has 9 frames (inline payload), later chunks 12 (73 KB: the
frame_batch_header + payload form), one every `interval_s`. Each chunk carries the id of the last event
received before it. Frames are seeded random pixels; every chunk sent is recorded (`chunks`) so a test
can check that each Block's pixels are exactly what was sent. `kill()` cuts every connection without a
close frame and stops listening, as a dying process does; `busy=True` refuses every session (someone
else's client holds the server).
"""

from __future__ import annotations

import threading
import time
import uuid

import msgpack
import numpy as np
from websockets.exceptions import ConnectionClosed
from websockets.sync.server import serve

BUSY_TEXT = "another realtime session is already active"


class FakeUpstream:
    def __init__(self, width: int = 64, height: int = 32, interval_s: float = 0.05, busy: bool = False,
                 name: str = "fake"):
        self.width, self.height, self.interval_s, self.busy, self.name = width, height, interval_s, busy, name
        self.lock = threading.Lock()
        self.active: object | None = None  # the connection holding the one session
        self.connections: list = []
        self.inits: list[dict] = []  # every accepted init
        self.events: list[list[dict]] = []  # per accepted session: the events received, in order
        self.chunks: list[list[tuple[int, int | None, np.ndarray]]] = []  # per session: (index, event_id, frames)
        self.refused = 0
        self.ended = threading.Event()
        self.server = serve(self._handle, "127.0.0.1", 0, max_size=None, ping_interval=None, compression=None)
        self.url = f"ws://127.0.0.1:{self.server.socket.getsockname()[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    # -- control -----------------------------------------------------------------------------------

    def kill(self) -> None:
        """The process dies: every connection is cut (no close frame) and nothing listens any more."""
        with self.lock:
            connections = list(self.connections)
        self.server.shutdown()  # stop accepting first
        for ws in connections:
            try:
                ws.close_socket()
            except OSError:
                pass
        self.thread.join(timeout=10)

    def stop(self) -> None:
        self.server.shutdown()
        self.thread.join(timeout=10)

    def open_connections(self) -> int:
        with self.lock:
            return sum(ws.state.name == "OPEN" for ws in self.connections)

    # -- serving -----------------------------------------------------------------------------------

    def _send(self, ws, message: dict) -> None:
        ws.send(msgpack.packb(message, use_bin_type=True))

    def _handle(self, ws) -> None:
        with self.lock:
            self.connections.append(ws)
        try:
            init = msgpack.unpackb(ws.recv(timeout=10), raw=False)
            deadline = time.monotonic() + 1.0  # upstream waits about a second for the other session to end
            while True:
                with self.lock:
                    refuse = self.busy or self.active is not None
                    if not refuse:
                        self.active = ws
                        self.inits.append(init)
                        self.events.append([])
                        self.chunks.append([])
                        number = len(self.inits) - 1
                if not refuse or time.monotonic() > deadline:
                    break
                time.sleep(0.02)
            if refuse:
                self.refused += 1
                self._send(ws, {"type": "error", "content": BUSY_TEXT})
                ws.close(1008, BUSY_TEXT)
                return
            try:
                self._session(ws, init, number)
            finally:
                with self.lock:
                    if self.active is ws:
                        self.active = None
        except (ConnectionClosed, TimeoutError, OSError):
            pass
        finally:
            self.ended.set()

    def _read_events(self, ws, number: int, gone: threading.Event) -> None:
        try:
            while True:
                message = msgpack.unpackb(ws.recv(), raw=False)
                with self.lock:
                    self.events[number].append(message)
        except (ConnectionClosed, OSError):
            gone.set()

    def _session(self, ws, init: dict, number: int) -> None:
        gone = threading.Event()
        reader = threading.Thread(target=self._read_events, args=(ws, number, gone), daemon=True)
        reader.start()
        seed = init.get("seed", 42)
        request_id = f"{self.name}_{uuid.uuid4().hex}"
        chunk = 0
        while init.get("max_chunks") is None or chunk < init["max_chunks"]:
            if gone.wait(self.interval_s if chunk else 0):
                return
            with self.lock:
                ids = [e.get("event_id") for e in self.events[number] if e.get("event_id") is not None]
            event_id = ids[-1] if ids else None
            count = 9 if chunk == 0 else 12
            frames = np.random.default_rng([seed, number, chunk]).integers(
                0, 256, (count, self.height, self.width, 3), dtype=np.uint8)
            payload = frames.tobytes()
            header = {"type": "frame_batch", "request_id": request_id, "chunk_index": chunk,
                      "content_type": "application/x-raw-rgb", "num_frames": count, "total_size": len(payload),
                      "frame_batch_index": 0, "num_frame_batches": 1, "is_final_frame_batch": True,
                      "format": "rgb24", "width": self.width, "height": self.height, "channels": 3,
                      "bytes_per_frame": self.width * self.height * 3, "raw_size": len(payload),
                      "encoding": "raw"}
            if event_id is not None:
                header["event_id"] = event_id
            with self.lock:
                self.chunks[number].append((chunk, event_id, frames))
            if len(payload) >= 64 * 1024:
                header["type"] = "frame_batch_header"
                self._send(ws, header)
                ws.send(payload)
            else:
                self._send(ws, header | {"payload": payload})
            self._send(ws, {"type": "chunk_stats", "session_id": self.name, "request_id": request_id,
                            "chunk_index": chunk, "event_id": event_id, "request_prepare_ms": 0.5,
                            "scheduler_forward_ms": 600.0 + chunk, "pace_wait_ms": 0.0, "header_write_ms": 0.1,
                            "raw_payload_build_ms": 0.2, "raw_write_ms": 0.3, "ws_write_ms": 0.4,
                            "chunk_total_ms": 650.0 + chunk, "num_batches": 1, "num_frames": count,
                            "raw_bytes": len(payload), "ws_payload_bytes": len(payload) + 300,
                            "content_type": "application/x-raw-rgb"})
            chunk += 1
        ws.close(1000, "generation complete")
