"""What one client may hold of a server, whichever door it comes in by: the page's streams and the realtime
protocols' connections count against the same limits.

- Worlds per viewer (a page or an API client's Gradio session; a protocol connection is a viewer of its own)
  and per address: a world running or a place in line is one claim, held until it ends.
- Start pictures decoded at once (`decode_slots`), whoever sends them: a 40 MP picture takes about 150 MiB
  and most of a core while it decodes, so a burst of them must queue, not decode side by side. After a
  large one the freed memory goes back to the system (allocator.release_freed_memory): the process keeps
  freed buffers for the model's reuse, and a picture's buffers are not the model's.

One `ClientGate` per server: `app.py` hands the page's to its protocol routes, the headless server has its own.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, TypeVar

from lingbot_core.process.allocator import release_freed_memory, resident_bytes

T = TypeVar("T")

# A decode that grew the process by more than this leaves its freed buffers to the system (a trim after it).
TRIM_AFTER_BYTES = 32 * 2**20


class LimitReached(ValueError):
    """A client already holds what it may; the message says what and what to do."""


@dataclass(frozen=True)
class ClientLimits:
    max_per_viewer: int = 1  # worlds or places in line per page / API client (Gradio session)
    max_per_address: int = 4  # the same per client IP address (app option --max-per-address)
    decode_slots: int = 2  # start pictures decoded at once, whoever sends them

    def __post_init__(self) -> None:
        if min(self.max_per_viewer, self.max_per_address, self.decode_slots) < 1:
            raise ValueError("max_per_viewer, max_per_address and decode_slots must be at least 1")


@dataclass
class Claim:
    """One world or place in line of a viewer at an address. `alive`, once set, says whether what it holds
    still runs (a stream's recording); until then, and until released, it counts."""

    viewer: str | None
    address: str | None
    alive: Callable[[], bool] | None = None
    released: bool = False

    @property
    def held(self) -> bool:
        return not self.released and (self.alive is None or self.alive())


@dataclass
class ClientGate:
    limits: ClientLimits = ClientLimits()
    _claims: list[Claim] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self._decoders = ThreadPoolExecutor(self.limits.decode_slots, thread_name_prefix="lingbot-decode")

    def claim(self, viewer: str | None, address: str | None) -> Claim:
        """Count one more world for this viewer and address; LimitReached when either has all it may hold."""
        limits = self.limits
        with self._lock:
            held = [c for c in self._claims if c.held]
            if viewer is not None and sum(c.viewer == viewer for c in held) >= limits.max_per_viewer:
                raise LimitReached("this page (or API client) already has a world running or waiting for a seat; "
                                   "press Stop first, or Reset for a new world in the same stream")
            if address is not None and sum(c.address == address for c in held) >= limits.max_per_address:
                raise LimitReached(f"your address already holds {limits.max_per_address} worlds or places in line, "
                                   "the most one address may hold; stop one first")
            claim = Claim(viewer, address)
            self._claims = held + [claim]
        return claim

    def release(self, claim: Claim) -> None:
        with self._lock:
            claim.released = True
            self._claims = [c for c in self._claims if c.held]

    def held_by(self, address: str | None) -> int:
        """Claims an address holds now (for the tests and /config-free diagnostics)."""
        with self._lock:
            return sum(c.held and c.address == address for c in self._claims)

    def decode(self, parse: Callable[..., T], *args) -> T:
        """`parse(*args)` (a start's picture decode and fit) on one of the gate's `decode_slots` decode threads;
        the caller waits for it (never call this on the event loop). Always the same few threads: the C
        allocator keeps what a thread freed in that thread's arena, so a burst of large pictures decoded on
        whichever request thread came along left hundreds of MiB behind in many arenas, while on these the
        freed buffers of one picture serve the next. When the process grew by more than TRIM_AFTER_BYTES
        during a decode, what it freed is trimmed."""
        return self._decoders.submit(self._decode_one, parse, args).result()

    @staticmethod
    def _decode_one(parse: Callable[..., T], args: tuple) -> T:
        before = resident_bytes()
        try:
            return parse(*args)
        finally:
            after = resident_bytes()
            if before is not None and after is not None and after - before > TRIM_AFTER_BYTES:
                release_freed_memory()


def origin_allowed(origin: str | None, host: str | None, allowed: tuple[str, ...]) -> bool:
    """Same origin, or one the server allows: a browser page of another site must not use a local server."""
    if origin is None or "*" in allowed or origin in allowed:
        return True
    netloc = origin.split("://", 1)[-1].rstrip("/")
    return host is not None and netloc.lower() == host.lower()
