"""How a remote realtime session ends, whatever the protocol: the typed outcomes a protocol's client reports and
the remote engine (lingbot_core/protocols/remote_engine.py) acts on. COMPLETED (the length asked for), REFUSED (a
busy server), FAILED (the server's generation error), DROPPED (the connection lost mid-session), TIMEOUT (no
message within the receive timeout), PROTOCOL_ERROR (the server broke its protocol), CLOSED (we closed it)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Outcome(enum.Enum):
    COMPLETED = "completed"
    REFUSED = "refused"
    FAILED = "failed"
    DROPPED = "dropped"
    TIMEOUT = "timeout"
    PROTOCOL_ERROR = "protocol_error"
    CLOSED = "closed"


@dataclass(frozen=True)
class Ended:
    """How a session ended. code: the close code received (1006 when the connection was lost without one,
    None when no close happened, e.g. a timeout); last_error: the last error message's content, if any."""

    outcome: Outcome
    code: int | None
    reason: str
    last_error: str | None
    detail: str

    @property
    def message(self) -> str:
        return f"remote session {self.outcome.value}: {self.detail}"


class RemoteUnavailable(ConnectionError):
    """The server could not be reached, or did not accept the WebSocket (the url and the cause are named)."""


class RemoteClosed(RuntimeError):
    """Sending on a session that has ended; `ended` says how."""

    def __init__(self, ended: Ended | None):
        super().__init__(ended.message if ended else "the remote session is closed")
        self.ended = ended


def close_quietly(connection) -> None:
    """Close a client WebSocket whatever state it is in: closing a broken socket may raise anything, and the
    session is over either way."""
    try:
        connection.close()
    except Exception:  # noqa: BLE001
        pass
