"""What the protocol servers (SGLang's and vLLM-Omni's, lingbot_core/protocols/*/server.py) share: what they allow
each client (the page's limits applied to the sockets, docs/hardening.md; one config for both, as both serve on
one port), and the thread pool on which their blocking engine calls run."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from lingbot_core.serving.clients import ClientGate, ClientLimits
from lingbot_core.serving.contract import Backend

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
