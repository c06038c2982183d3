"""What the protocol servers (SGLang's and vLLM-Omni's, lingbot_core/protocols/*/server.py) share: what they allow
each client (the page's limits applied to the sockets, docs/hardening.md; one config for both, as both serve on
one port), and the thread pool on which their blocking engine calls run."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

from starlette.websockets import WebSocket

from lingbot_core.serving.clients import ClientGate, ClientLimits, origin_allowed
from lingbot_core.serving.contract import Backend

log = logging.getLogger(__name__)
CLOSE_POLICY = 1008

# SIGTERM ends the server within this: connections still open then (a client that never sends, a handshake
# still waiting) are cut rather than waited for.
SHUTDOWN_GRACE_S = 3.0


@dataclass(frozen=True)
class ServeConfig:
    poll_s: float = 0.5  # how long one engine wait lasts on its thread before the connection looks again
    workers: int = 64  # threads for engine calls and frame encoding, shared by every connection
    max_connections: int = 64  # connections open at once, every client together
    init_timeout_s: float = 10.0  # a connection without a valid init by then is closed (vLLM-Omni's 10 s to start)
    events_per_s: float = 50.0  # a connection's event rate (the web UI resends its state ten times a second)
    event_burst: int = 100  # events a connection may send at once above that rate
    # Origins of browser pages that may connect besides the server's own ("*": any). Clients that send no
    # Origin (scripts, other servers) are not browsers and are let in.
    allowed_origins: tuple[str, ...] = ()


class MessageRate:
    """A connection's message budget: `per_s` a second, bursts of `burst` (a token bucket). `take(now)` says whether
    this message may go on, and whether to tell the client that messages are being dropped (once a second)."""

    def __init__(self, per_s: float, burst: int) -> None:
        self.per_s, self.burst = per_s, float(burst)
        self._tokens, self._refilled, self._told = float(burst), None, float("-inf")

    def take(self, now: float) -> tuple[bool, bool]:
        if self._refilled is not None:
            self._tokens = min(self.burst, self._tokens + (now - self._refilled) * self.per_s)
        self._refilled = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True, False
        tell = now - self._told >= 1.0
        if tell:
            self._told = now
        return False, tell


async def within_rate(receive: Callable[[], Awaitable[Any]], config: ServeConfig,
                      tell_dropped: Callable[[], Awaitable[None]]) -> AsyncIterator[Any]:
    """A connection's messages until the client leaves (`receive` gives None), those past its rate dropped, with
    `tell_dropped` awaited once a second while they are."""
    rate = MessageRate(config.events_per_s, config.event_burst)
    while True:
        message = await receive()
        if message is None:
            return
        allowed, tell = rate.take(time.monotonic())
        if allowed:
            yield message
        elif tell:
            await tell_dropped()


class ProtocolServer:
    """A protocol over one engine: the engine, the per-client gate (shared with the page's streams when the app
    serves both), the connection count and a pool for the calls that block (engine locks, model-thread jobs,
    encoding and decoding), so none runs on the event loop."""

    def __init__(self, engine: Backend, config: ServeConfig, gate: ClientGate | None, thread_name: str) -> None:
        self.engine = engine
        self.config = config
        self.gate = gate or ClientGate(ClientLimits())
        self.open_connections = 0  # on the event loop only
        self._executor = ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix=thread_name)

    async def connect(self, websocket: WebSocket, run: Callable[[], Awaitable[None]],
                      refuse_full: Callable[[], Awaitable[None]]) -> None:
        """The connection rules both protocols keep before their own: a browser page of another origin is refused
        before the handshake (an HTTP 403); past max_connections the client is accepted, told (`refuse_full`) and
        closed; otherwise `run()` serves it, counted."""
        if not origin_allowed(websocket.headers.get("origin"), websocket.headers.get("host"),
                              self.config.allowed_origins):
            log.info("refused a connection from origin %r", websocket.headers.get("origin"))
            await websocket.close(code=CLOSE_POLICY)
            return
        if self.open_connections >= self.config.max_connections:
            await websocket.accept()
            with contextlib.suppress(Exception):
                await refuse_full()
            return
        self.open_connections += 1
        try:
            await run()
        finally:
            self.open_connections -= 1

    async def call(self, fn: Callable[..., Any], *args) -> Any:
        """A blocking call on the pool, off the event loop."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        except RuntimeError as exc:
            if "shutdown" not in str(exc):
                raise
            return fn(*args)  # the pool is closed (the server is going down): a last cleanup runs here

    def close(self) -> None:
        """Stop taking work on the pool; connections still open end when the engine or the socket does."""
        self._executor.shutdown(wait=False, cancel_futures=True)
