"""What both backends share about waiting: places in line told their position, places nobody reads leaving
the line, and a consumer's read of its outbox.

A place (the local engine's queued start, a remote session waiting for a free server) and a seated session
both have an `outbox` of messages (serving/contract.py), `seen` (when its consumer last read or waited on
it) and `readers` (consumers waiting on it now: a place being watched never expires). Callers hold their
backend's table lock around every function here; `changed` is that lock's condition.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Iterable, Protocol, Sequence

from lingbot_core.serving.contract import Message, Waiting


class Holder(Protocol):
    outbox: object  # a deque of Message
    position: int  # the last position posted (0: none since it last joined)
    seen: float
    readers: int


def post_positions(places: Iterable[Holder]) -> None:
    """Tell each place in line whose position changed (or was never told) where it stands now, first = 1."""
    for position, place in enumerate(places, start=1):
        if place.position != position:
            place.position = position
            place.outbox.append(Waiting(position))


def unwatched(places: Sequence[Holder], now: float, ttl_s: float) -> list[Holder]:
    """The places nobody has read or waited on for ttl_s: they leave the line."""
    return [place for place in places if place.readers == 0 and now - place.seen > ttl_s]


def read_outbox(changed: threading.Condition, holder_of: Callable[[], Holder | None],
                closed: Callable[[], Message], clock: Callable[[], float], timeout: float | None,
                taken: Callable[[Holder, Message], None] | None = None) -> Message | None:
    """A consumer's next message from the outbox `holder_of()` names now (a place in line, then its session):
    None on timeout (0: do not wait); `closed()` once nothing holds it. While it waits the holder counts as
    watched; `taken(holder, message)` sees each message taken. The caller holds `changed`'s lock."""
    deadline = None if timeout is None else time.monotonic() + timeout
    reading: Holder | None = None
    try:
        while True:
            holder = holder_of()
            if holder is not reading and reading is not None:  # seated or gone: no longer that place's reader
                reading.readers -= 1
                reading = None
            if holder is None:
                return closed()
            holder.seen = clock()
            if reading is None:
                reading = holder
                holder.readers += 1
            if holder.outbox:
                message = holder.outbox.popleft()
                if taken is not None:
                    taken(holder, message)
                changed.notify_all()  # room in the outbox: whoever fills it may go on
                return message
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return None
            changed.wait(remaining)
    finally:
        if reading is not None:
            reading.readers -= 1
            reading.seen = clock()
