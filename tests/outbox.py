"""Reading an engine's outbox in tests (the local Engine and the RemoteEngine have the same one)."""

from __future__ import annotations

import time

from lingbot_core.serving.contract import Block, NewWorld, Waiting


def take(engine, session_id, kind=Block, skip=(Waiting, NewWorld), wait_s: float = 60.0):
    """The next message of `kind`, skipping the kinds in `skip`; anything else fails the test. `wait_s` only
    bounds the wait so a bug fails instead of hanging; it is no speed figure."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        message = engine.next_message(session_id, timeout=0.5)
        if message is None or (isinstance(message, skip) and not isinstance(message, kind)):
            continue
        assert isinstance(message, kind), f"expected {kind.__name__}, got {message!r}"
        return message
    raise AssertionError(f"no {kind.__name__} within {wait_s} s")
