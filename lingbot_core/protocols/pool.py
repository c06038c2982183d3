"""The seats of a remote backend: one per realtime server, each server up, busy or down.

Upstream serves one realtime session per server, so a pool of K server URLs is K seats. A server that
refuses a session (close 1008: "another realtime session is already active", e.g. someone else's client
holds it) is marked busy; one that cannot be reached, times out or drops a session is marked down. Either
is skipped until its retry time, which doubles with each failure in a row (backoff_s, 2 x backoff_s, ...
up to max_backoff_s) and resets once it delivers a chunk. The pool holds no lock of its own: its owner
(lingbot_core/protocols/remote_engine.py) calls it under its table lock, with its injected clock's `now`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from urllib.parse import urlsplit


def check_server_url(url: str) -> str:
    """A realtime server's address: ws://host:port or wss://host:port (a path, if any, is the protocol's)."""
    parts = urlsplit(url)
    if parts.scheme not in ("ws", "wss") or not parts.netloc:
        raise ValueError(f"a realtime server address is ws://host:port or wss://host:port, got {url!r}")
    return url


class ServerState(enum.Enum):
    UP = "up"
    BUSY = "busy"  # refused a session (someone else's session runs there)
    DOWN = "down"  # unreachable, timed out, dropped a session or broke the protocol


@dataclass
class Server:
    url: str
    state: ServerState = ServerState.UP
    holder: str | None = None  # the session (or offline render) seated here
    failures: int = 0  # failures in a row: the backoff's exponent
    retry_at: float = 0.0  # a busy or down server is tried again from this time on
    problem: str | None = None  # what happened last time, for the telemetry and the messages

    def free(self, now: float) -> bool:
        return self.holder is None and (self.state is ServerState.UP or now >= self.retry_at)


class ServerPool:
    def __init__(self, urls, backoff_s: float = 2.0, max_backoff_s: float = 60.0) -> None:
        urls = [str(url).strip() for url in urls if str(url).strip()]
        if not urls:
            raise ValueError("a remote backend needs at least one realtime server address (ws://host:port)")
        for url in urls:
            check_server_url(url)  # a ValueError naming the address if it is not ws:// or wss://
        duplicates = sorted({url for url in urls if urls.count(url) > 1})
        if duplicates:  # one server is one seat: listing it twice would seat two sessions on it
            raise ValueError(f"realtime server listed more than once: {', '.join(duplicates)}")
        if not 0 < backoff_s <= max_backoff_s:
            raise ValueError(f"need 0 < backoff_s <= max_backoff_s, got {backoff_s} and {max_backoff_s}")
        self.servers = [Server(url) for url in urls]
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s

    @property
    def capacity(self) -> int:
        return len(self.servers)

    def take(self, holder: str, now: float, avoid: str | None = None) -> Server | None:
        """Seat `holder` on a free server: one marked up first, then one whose retry time has come; `avoid`
        (a url) only when nothing else is free. None when every server is held or waiting out its backoff."""
        free = [s for s in self.servers if s.free(now)]
        free.sort(key=lambda s: (s.url == avoid, s.state is not ServerState.UP))
        if not free:
            return None
        server = free[0]
        server.holder = holder
        return server

    def release(self, server: Server, holder: str) -> None:
        if server.holder == holder:
            server.holder = None

    def mark_ok(self, server: Server) -> None:
        """It delivered a chunk: up, and its backoff starts over."""
        server.state, server.failures, server.problem = ServerState.UP, 0, None

    def mark(self, server: Server, state: ServerState, problem: str, now: float) -> float:
        """Busy or down: skipped until the returned retry time (the backoff doubles with each failure)."""
        server.failures += 1
        server.state, server.problem = state, problem
        server.retry_at = now + min(self.backoff_s * 2 ** (server.failures - 1), self.max_backoff_s)
        return server.retry_at

    def next_retry(self, now: float) -> float | None:
        """The earliest time a server now waiting out its backoff may be tried (None: none is)."""
        times = [s.retry_at for s in self.servers if s.holder is None and s.state is not ServerState.UP
                 and s.retry_at > now]
        return min(times) if times else None

    def counts(self) -> dict[str, int]:
        return {state.value: sum(s.state is state for s in self.servers) for state in ServerState}


def server_urls(urls, variable: str, environ) -> list[str]:
    """The servers named on the command line (repeatable), else the environment variable's (comma separated)."""
    given = [u.strip() for u in (urls or []) if u and u.strip()]
    if given:
        return given
    return [u.strip() for u in environ.get(variable, "").split(",") if u.strip()]
