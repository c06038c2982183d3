"""The one serving contract: what the page, the protocol servers and the commands may ask of a backend, and
what they hear back.

Two backends keep it: the local engine (serving/engine.py: one model, many sessions, admission by bytes) and
a pool of remote realtime servers (protocols/sglang/backend.py: one session a server). Their callers (the
page's stream, the protocol server, app.py, the benchmarks) type against `Backend` and never ask which one
they have. A session's consumer hears of it only through the tagged messages of its outbox (`next_message`):
Waiting, NewWorld, Block, Failed, Closed, in order; a Closed carries its cause, never a sentence to match.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol, TypeVar

import numpy as np
import torch

from lingbot_core.boundary.offline import RenderRequest
from lingbot_core.boundary.requests import StartRequest
from lingbot_core.config import ModelConfig
from lingbot_core.model.held_bytes import held_bytes
from lingbot_core.serving.renders import RenderLimits, RenderProgress
from lingbot_core.serving.replay import Replay

T = TypeVar("T")


class AdmissionRefused(RuntimeError):
    """The server cannot take another session now and its waiting line is full."""


class RenderRefused(ValueError):
    """An offline render this backend cannot take now (its line is full, its owner has one in it) or cannot do
    right (the remote backend: a trajectory, a prompt switch); the message says why."""


class RenderFailedError(RuntimeError):
    """An offline render's block failed (or the server went down); no file is left."""


class UnknownSession(KeyError):
    """No live session has this id (closed, evicted, or never existed)."""

    def __init__(self, session_id: str, reason: str | None = None) -> None:
        super().__init__(session_id)
        self.reason = reason

    def __str__(self) -> str:
        if self.reason is not None:
            return f"session {self.args[0]!r} is closed: {self.reason}"
        return f"no live session {self.args[0]!r}: it was closed, evicted after idling, or never existed"


@dataclass(frozen=True)
class EngineConfig:
    memory_budget_bytes: int | None = None  # None: memory_fraction of what the device has free at start
    # None: serving/memory.DEFAULT_MEMORY_FRACTION for the device (0.9 of a GPU, 0.5 of a CPU host).
    memory_fraction: float | None = None
    max_sessions: int | None = None  # an extra cap on top of the byte budget
    max_lead_blocks: int = 1  # blocks a session may run ahead of its consumer
    idle_ttl_s: float = 120.0  # no input (events or a reset) for this long closes a session (the one idle policy)
    evictable_after_s: float = 10.0  # idle this long: may be evicted (LRU) to admit a newcomer
    max_waiting: int = 8  # places in line before newcomers are refused
    ticket_ttl_s: float = 30.0  # a place in line whose outbox nobody reads for this long leaves the line
    max_queued_events: int = 64
    worker_poll_s: float = 0.5  # the idle worker wakes this often to apply the TTL
    remembered_closes: int = 256  # closed ids whose reason is still reported to late callers
    # Condition streams kept for start pictures no session is reading now (e.g. the example images), so a
    # later session from the same picture skips the encoder warm-up. None: room for 4 streams at their largest.
    condition_cache_bytes: int | None = None
    renders: RenderLimits = RenderLimits()  # offline renders: the line's bounds and their priority (serving/renders.py)

    def __post_init__(self) -> None:
        if self.max_lead_blocks < 1:
            raise ValueError(f"max_lead_blocks must be at least 1, got {self.max_lead_blocks}")
        if self.memory_fraction is not None and not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")


class Admission(enum.Enum):
    ADMITTED = "admitted"
    WAITING = "waiting"


@dataclass(frozen=True)
class Ticket:
    admission: Admission
    session_id: str  # the outbox to read (`next_message`): the session's, or while waiting its place in line's
    position: int | None = None  # when waiting: 1 = next in line (later places come as Waiting messages)


# ---------------------------------------------------------------------------------------------
# What a session's consumer receives, in order, from its outbox (`next_message`)


@dataclass(frozen=True)
class Waiting:
    """The consumer's place in line (1 = next): once on joining, then whenever it changes. NewWorld follows
    when the engine seats it; Closed if it leaves the line (withdrawn, unread for ticket_ttl_s, shutdown)."""

    position: int


@dataclass(frozen=True)
class NewWorld:
    """A world starts: first in every outbox, and again after each reset. No block of an earlier world
    follows it. `replay` is the new world's replay header (no blocks yet): the consumer's copy to extend
    with each Block's `replay_entry`, so it never reads the session's own log."""

    replay: Replay


@dataclass
class Block:
    """One block: its pixels and latents, the figures the UI shows, and what it adds to the replay."""

    block_index: int
    pixels: np.ndarray  # [T, H, W, 3] uint8, ready to encode (converted on the model thread)
    latents: torch.Tensor | None  # [1, z, F, h, w] clean, normalised, on the CPU; None from a remote server
    stage_ms: dict[str, float]
    block_ms: float
    replay_entry: dict[str, Any]  # the replay log's record of this block (key sets, event ids, a new prompt)
    # The camera path the block was generated along (a few hundred bytes, not counted in nbytes): each latent
    # frame's pose [F, 4, 4] and the pose before the block [4, 4] (its Plücker anchor). A consumer can
    # render the true scene along it (lingbot_core/world/ground_truth.py).
    poses: np.ndarray | None = None
    start_pose: np.ndarray | None = None
    # A remote block's server and figures (lingbot_core/protocols/sglang/backend.py): server, forward_ms, total_ms, bytes.
    source: dict[str, Any] | None = None
    first_frame_ms: float | None = None  # from the block's start to its first decoded frame (early_frames)

    @property
    def event_ids(self) -> tuple[int, ...]:
        """The events this block applied."""
        return tuple(self.replay_entry["event_ids"])

    @property
    def nbytes(self) -> int:
        return self.pixels.nbytes + held_bytes(self.latents)


@dataclass
class Frames:
    """Some of a block's frames, as soon as they are decoded, before the block's own message: only for a session
    admitted with `early_frames` (the page's socket player shows them at once). The Block that follows carries
    every frame again, for consumers that take whole blocks (the recording, the HLS video)."""

    block_index: int
    first: int  # index of the first of these frames within the block
    frames_in_block: int
    pixels: np.ndarray  # [n, H, W, 3] uint8

    @property
    def nbytes(self) -> int:
        return self.pixels.nbytes


@dataclass(frozen=True)
class Failed:
    """A block failed; the session is intact and goes on (or waits for new input, if it had none)."""

    text: str
    waiting_for_input: bool = False  # the session runs no block until new input (or a reset) arrives


class SessionStatus(enum.Enum):
    """Where a session stands (Backend.session_status)."""

    ACTIVE = "active"
    FAILED = "failed"  # the last block raised; the state is intact and the next step may succeed
    CLOSED = "closed"


class CloseCause(enum.Enum):
    """Why a session (or a place in line) ended, for code to act on; `Closed.reason` says it to people."""

    USER = "user"  # its viewer stopped it, closed the tab, disconnected or left the line
    IDLE = "idle"  # no input for idle_ttl_s, or a place in line nobody waited on for ticket_ttl_s
    EVICTED = "evicted"  # idle, and closed to make room for a newcomer
    SHUTDOWN = "shutdown"  # the server is going down
    FAILED = "failed"  # the world could not start, or its remote server failed too often
    COMPLETE = "complete"  # it made the blocks it was asked for (a protocol client's max_chunks)


@dataclass(frozen=True)
class Closed:
    """The session is gone; last in its outbox, and the answer to every later `next_message`."""

    reason: str  # in words, for the viewer
    cause: CloseCause = CloseCause.USER

    @property
    def idle(self) -> bool:
        """Closed by the idle policy, not by anyone's request (the viewer may simply start again)."""
        return self.cause is CloseCause.IDLE


Message = Waiting | NewWorld | Frames | Block | Failed | Closed


class ClosedSessions:
    """Why the most recently closed sessions ended (the newest `limit`), so a late reader or a late verb on
    a closed id learns the reason. Every backend keeps one; callers hold their own lock around it."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._reasons: OrderedDict[str, Closed] = OrderedDict()

    def remember(self, session_id: str, closed: Closed) -> None:
        self._reasons[session_id] = closed
        while len(self._reasons) > self.limit:
            self._reasons.popitem(last=False)

    def message(self, session_id: str) -> Closed:
        """Why it closed; UnknownSession for an id never seen or long forgotten."""
        closed = self._reasons.get(session_id)
        if closed is None:
            raise UnknownSession(session_id)
        return closed

    def find_open(self, sessions: dict[str, T], session_id: str) -> T:
        """`sessions[session_id]` (a backend's open sessions); for an id not open, UnknownSession with the
        reason it closed when that is remembered."""
        session = sessions.get(session_id)
        if session is None:
            closed = self._reasons.get(session_id)
            raise UnknownSession(session_id, closed.reason if closed is not None else None)
        return session


class Backend(Protocol):
    """The verbs every backend offers. Each may be called from any thread; none runs PyTorch work on its
    caller's thread (model work goes to the backend's own thread or server)."""

    config: EngineConfig  # the line, lead, idle, event and render limits (memory fields: the local engine's)

    @property
    def model_config(self) -> ModelConfig:
        """The served model's frame size, rate and block length."""

    @property
    def capacity(self) -> int:
        """Worlds it runs at once."""

    def describe(self) -> str:
        """Where its worlds are made, in a sentence for the page (precision, or the remote servers)."""

    def admit(self, request: StartRequest, first_events: tuple = (), early_frames: bool = False) -> Ticket:
        """A session, or a place in line (its outbox tells its position, then NewWorld); AdmissionRefused.
        early_frames: also post each block's frames as they are decoded (Frames), where the backend can."""

    def withdraw(self, session_id: str, reason: str = "left the line") -> bool:
        """Leave the line at once; whether the id was in it."""

    def post_event(self, session_id: str, raw: Any) -> None:
        """Queue one event for the session's next block; EventError names a bad one, UnknownSession a closed id."""

    def reset(self, session_id: str, request: StartRequest) -> None:
        """A new world in the same session."""

    def next_message(self, session_id: str, timeout: float | None = None) -> Message | None:
        """The consumer's next message; None on timeout; its Closed once closed."""

    def keep_alive(self, session_id: str) -> None:
        """The client is there without input (a ping): the idle clock starts again."""

    def pace(self, session_id: str, start_in_s: float) -> None:
        """Start the session's next block this many seconds from now (just in time for its viewer)."""

    def close(self, session_id: str, reason: str = "closed", cause: CloseCause = CloseCause.USER) -> None:
        """Close a session or its place in line; idempotent."""

    def session_status(self, session_id: str) -> dict[str, Any]:
        """A snapshot for status displays (queued_events, blocks_waiting, ...)."""

    def replay(self, session_id: str) -> Replay:
        """A copy of the session's replay log as it stands."""

    def render(self, request: RenderRequest, out_path: Path, owner: str | None = None,
               progress: Callable[[RenderProgress], None] | None = None) -> int:
        """An offline video written to out_path; its block count. RenderRefused, RenderFailedError."""

    def prewarm(self, pictures) -> None:
        """Encode these start pictures' condition streams while idle (a no-op where the servers do it)."""

    def prompt_notice(self, prompt: str) -> str | None:
        """What the model will not read of a cleaned prompt, in words; None when it reads all of it."""

    def stats(self) -> dict[str, Any]:
        """Sessions, line, capacity and bytes, for the page's telemetry."""

    def accounted_bytes(self) -> int:
        """Bytes the backend accounts for in this process."""

    def session_ids(self) -> list[str]:
        """Ids of the sessions running now (not the places in line)."""

    def shutdown(self) -> None:
        """Close every session and stop."""
