"""The serving engine: one model, many sessions, bounded memory, one worker thread.

- Admission by bytes: every session is charged the peak bytes it can hold (its whole KV window, text
  K/V, condition and decoder state with their pending copies, per-block scratch), measured once on a
  probe rollout. A new session is admitted only if the charge fits the budget; otherwise it waits in
  line (a queue position) or, with the line full, is refused with a message.
- Scheduling: the worker advances sessions one block at a time, round-robin at block boundaries. A
  session runs at most `max_lead_blocks` ahead of its consumer, so an idle viewer costs no compute.
- Eviction: idle TTL (no input and no consumption), explicit close, and LRU eviction of idle sessions
  when a newcomer needs the room. Every path out returns every page through `Session.close`.

Consumers talk to the engine only through session ids and small messages; tensors never leave it
except as the frames of a finished block.
"""

from __future__ import annotations

import enum
import itertools
import os
import queue
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from ..kv_cache import KVPagePool
from .session import Session, SessionClosed, SessionStatus


class AdmissionRefused(RuntimeError):
    """The server cannot take another session now and its waiting line is full."""


class UnknownSession(KeyError):
    """No live session has this id (closed, evicted, or never existed)."""

    def __str__(self) -> str:
        return f"no live session {self.args[0]!r}: it was closed, evicted after idling, or never existed"


@dataclass(frozen=True)
class EngineConfig:
    memory_budget_bytes: int | None = None  # None: memory_fraction of what the device has free at start
    memory_fraction: float = 0.5
    max_sessions: int | None = None  # an extra cap on top of the byte budget
    max_lead_blocks: int = 1  # blocks a session may run ahead of its consumer
    idle_ttl_s: float = 120.0  # no input and no consumption for this long closes a session
    evictable_after_s: float = 10.0  # idle this long: may be evicted (LRU) to admit a newcomer
    max_waiting: int = 8  # tickets in line before newcomers are refused
    ticket_ttl_s: float = 30.0  # a waiting ticket not polled for this long leaves the line
    max_queued_events: int = 64


class Admission(enum.Enum):
    ADMITTED = "admitted"
    WAITING = "waiting"


@dataclass(frozen=True)
class Ticket:
    admission: Admission
    session_id: str | None = None  # set when admitted
    ticket_id: str | None = None  # set when waiting: poll `admit` again with it
    position: int | None = None  # 1 = next in line


@dataclass
class BlockMessage:
    """What a consumer receives for each block: frames plus the figures the UI shows."""

    block_index: int
    frames: torch.Tensor  # [1, 3, T, H, W] in [-1, 1], on the CPU
    latents: torch.Tensor
    stage_ms: dict[str, float]
    block_ms: float


@dataclass
class ErrorMessage:
    text: str
    fatal: bool  # True: the session is gone


class _Live:
    """The engine's bookkeeping around one session."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.outbox: queue.Queue = queue.Queue()
        self.in_outbox = 0  # blocks produced and not yet taken by the consumer
        self.waiting_for_input = False  # after a failure: do not retry until something changes


def available_memory_bytes(device: torch.device) -> int:
    """Free memory where the session state lives: GPU memory on CUDA, physical RAM otherwise."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class Engine:
    def __init__(self, pipeline, config: EngineConfig = EngineConfig(), clock=time.monotonic,
                 start_worker: bool = True) -> None:
        self.pipeline = pipeline
        self.config = config
        self.clock = clock
        self.session_charge = self._measure_session_charge()
        budget = config.memory_budget_bytes
        if budget is None:
            budget = int(available_memory_bytes(pipeline.device) * config.memory_fraction)
        self.memory_budget = budget
        capacity = budget // self.session_charge
        if config.max_sessions is not None:
            capacity = min(capacity, config.max_sessions)
        if capacity < 1:
            raise ValueError(f"a memory budget of {budget / 2**20:.0f} MiB holds no session "
                             f"(one needs {self.session_charge / 2**20:.1f} MiB)")
        self.capacity = int(capacity)
        self.pool = pipeline.new_pool(self.capacity * KVPagePool.pages_per_rollout(pipeline.config))
        self._sessions: OrderedDict[str, _Live] = OrderedDict()  # round-robin order
        self._waiting: OrderedDict[str, float] = OrderedDict()  # ticket id -> last poll time
        self._lock = threading.RLock()  # guards the tables above and every session's state
        self._model_lock = threading.Lock()  # one block or one session start at a time
        self._wake = threading.Condition(self._lock)
        self._stopped = False
        self._rr = itertools.count()
        self._worker = None
        if start_worker:
            self._worker = threading.Thread(target=self._run, name="lingbot-engine", daemon=True)
            self._worker.start()

    # -- admission ---------------------------------------------------------------------------------

    def _measure_session_charge(self) -> int:
        """Peak bytes of one session, measured on a probe rollout of two blocks (the largest states)."""
        pipe = self.pipeline
        pool = pipe.new_pool()
        probe = pipe.start(torch.zeros(pipe.config.height, pipe.config.width, 3, dtype=torch.uint8).numpy(),
                           "probe", 0)
        peak = {"condition": probe.condition.nbytes(), "decoder": probe.decoder.nbytes()}
        state = probe
        try:
            for _ in range(2):
                output, state = pipe.step(pool, state, _idle_control(pipe))
                peak["condition"] = max(peak["condition"], state.condition.nbytes())
                peak["decoder"] = max(peak["decoder"], state.decoder.nbytes())
                scratch = output.latents.nbytes + output.frames.nbytes
        finally:
            pool.allocator.free(state.kv.pages())
        text = _tensor_bytes(state.text_kv)
        kv = KVPagePool.pages_per_rollout(pipe.config) * KVPagePool.page_nbytes(pipe.config, pipe.dtype)
        # committed + pending copies of the encoder and decoder state exist while a block runs
        return kv + text + 2 * peak["condition"] + 2 * peak["decoder"] + 2 * scratch

    def admit(self, image, prompt: str, seed: int, ticket_id: str | None = None) -> Ticket:
        """Open a session if it fits; otherwise a place in line (poll again with the ticket id)."""
        with self._lock:
            self._expire_tickets()
            if ticket_id is not None and ticket_id not in self._waiting:
                ticket_id = None  # expired: join the line again
            ahead = list(self._waiting).index(ticket_id) if ticket_id else len(self._waiting)
            if ahead == 0 and (len(self._sessions) < self.capacity or self._evict_lru_idle()):
                self._waiting.pop(ticket_id, None)
                session_id = uuid.uuid4().hex
                reserved = _Live(None)  # hold the seat while the session starts outside the lock
                self._sessions[session_id] = reserved
            else:
                if ticket_id is None:
                    if len(self._waiting) >= self.config.max_waiting:
                        raise AdmissionRefused(f"the server is full ({len(self._sessions)} worlds running, "
                                               f"{len(self._waiting)} waiting); try again in a minute")
                    ticket_id = uuid.uuid4().hex
                self._waiting[ticket_id] = self.clock()
                return Ticket(Admission.WAITING, ticket_id=ticket_id, position=list(self._waiting).index(ticket_id) + 1)
        try:
            with self._model_lock:
                session = Session(session_id, self.pipeline, self.pool, image, prompt, seed,
                                  self.config.max_queued_events, self.clock)
        except BaseException:
            with self._lock:
                self._sessions.pop(session_id, None)
            raise
        with self._lock:
            reserved.session = session
            self._wake.notify_all()
        return Ticket(Admission.ADMITTED, session_id=session_id)

    def _evict_lru_idle(self) -> bool:
        """Close the least recently used idle session to make room; False if none is idle enough."""
        now = self.clock()
        idle = [(max(live.session.last_input, live.session.last_consumed), sid)
                for sid, live in self._sessions.items() if live.session is not None
                and now - max(live.session.last_input, live.session.last_consumed) >= self.config.evictable_after_s]
        if not idle:
            return False
        _, victim = min(idle)
        self._close_locked(victim, "evicted to make room for a new session after idling")
        return True

    def _expire_tickets(self) -> None:
        now = self.clock()
        for ticket_id, seen in list(self._waiting.items()):
            if now - seen > self.config.ticket_ttl_s:
                del self._waiting[ticket_id]

    # -- per-session verbs -------------------------------------------------------------------------

    def _live(self, session_id: str) -> _Live:
        live = self._sessions.get(session_id)
        if live is None or live.session is None:
            raise UnknownSession(session_id)
        return live

    def post_event(self, session_id: str, raw: dict) -> None:
        with self._lock:
            live = self._live(session_id)
            live.session.post_event(raw)
            live.waiting_for_input = False
            self._wake.notify_all()

    def reset(self, session_id: str, image, prompt: str, seed: int) -> None:
        with self._lock:
            live = self._live(session_id)
        with self._model_lock, self._lock:
            live.session.reset(image, prompt, seed)
            _drain(live)
            live.waiting_for_input = False
            self._wake.notify_all()

    def next_message(self, session_id: str, timeout: float | None = None) -> BlockMessage | ErrorMessage | None:
        """The next block (or error) for this session's consumer; None on timeout."""
        with self._lock:
            live = self._live(session_id)
            live.session.last_consumed = self.clock()  # waiting for video counts as watching
        try:
            message = live.outbox.get(timeout=timeout)
        except queue.Empty:
            return None
        with self._lock:
            if isinstance(message, BlockMessage):
                live.in_outbox -= 1
            if live.session is not None:
                live.session.last_consumed = self.clock()
            self._wake.notify_all()
        return message

    def close(self, session_id: str, reason: str = "closed") -> None:
        with self._lock:
            self._close_locked(session_id, reason)

    def _close_locked(self, session_id: str, reason: str) -> None:
        live = self._sessions.pop(session_id, None)
        if live is None or live.session is None:
            return
        with self._model_lock if threading.current_thread() is not self._worker else _nothing():
            live.session.close()
        live.outbox.put(ErrorMessage(f"session closed: {reason}", fatal=True))

    def session_status(self, session_id: str) -> dict[str, Any]:
        with self._lock:
            live = self._live(session_id)
            s = live.session
            return {"block_index": s.block_index, "status": s.status.value, "last_error": s.last_error,
                    "bytes": sum(s.nbytes().values()), "queued_events": len(s.queue)}

    def replay(self, session_id: str):
        with self._lock:
            return self._live(session_id).session.replay

    # -- telemetry and accounting ------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"active_sessions": sum(1 for l in self._sessions.values() if l.session is not None),
                    "waiting": len(self._waiting), "capacity": self.capacity,
                    "pages_in_use": self.pool.allocator.num_in_use, "pages_total": self.pool.allocator.num_pages,
                    "accounted_bytes": self.accounted_bytes(), "memory_budget": self.memory_budget}

    def accounted_bytes(self) -> int:
        with self._lock:
            return sum(sum(l.session.nbytes().values()) for l in self._sessions.values() if l.session is not None)

    def session_ids(self) -> list[str]:
        with self._lock:
            return [sid for sid, l in self._sessions.items() if l.session is not None]

    # -- the worker --------------------------------------------------------------------------------

    def _pick(self) -> tuple[str, _Live] | None:
        """The next session that may run, round-robin: moves it to the back of the order."""
        for session_id, live in list(self._sessions.items()):
            s = live.session
            if (s is not None and s.status is not SessionStatus.CLOSED and not live.waiting_for_input
                    and live.in_outbox < self.config.max_lead_blocks):
                self._sessions.move_to_end(session_id)
                return session_id, live
        return None

    def _expire_idle(self) -> None:
        now = self.clock()
        for session_id, live in list(self._sessions.items()):
            s = live.session
            if s is not None and now - max(s.last_input, s.last_consumed) > self.config.idle_ttl_s:
                self._close_locked(session_id, f"idle for over {self.config.idle_ttl_s:.0f} s")

    def run_once(self) -> bool:
        """Advance one runnable session by one block; False if none could run. The worker loops on this."""
        with self._lock:
            self._expire_idle()
            picked = self._pick()
            if picked is None:
                return False
            session_id, live = picked
        with self._model_lock:
            if live.session.status is SessionStatus.CLOSED:
                return True
            started = time.perf_counter()
            try:
                output = live.session.step()
            except SessionClosed:
                return True
            except Exception as exc:  # the session is intact; tell its consumer and wait for new input
                with self._lock:
                    live.waiting_for_input = True
                    live.outbox.put(ErrorMessage(f"block {live.session.block_index} failed: {exc}", fatal=False))
                return True
            block_ms = 1000.0 * (time.perf_counter() - started)
        with self._lock:
            live.in_outbox += 1
            live.outbox.put(BlockMessage(output.block_index, output.frames.cpu(), output.latents.cpu(),
                                         output.stage_ms, block_ms))
        return True

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._stopped:
                    return
            if not self.run_once():
                with self._lock:
                    if not self._stopped:
                        self._wake.wait(timeout=0.5)

    def shutdown(self) -> None:
        with self._lock:
            self._stopped = True
            self._wake.notify_all()
        if self._worker is not None:
            self._worker.join(timeout=60)
        with self._lock:
            for session_id in list(self._sessions):
                self._close_locked(session_id, "server shutting down")


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _drain(live: _Live) -> None:
    while True:
        try:
            live.outbox.get_nowait()
        except queue.Empty:
            break
    live.in_outbox = 0


def _idle_control(pipeline):
    from ..rollout import BlockControl
    return BlockControl(actions=(frozenset(),) * pipeline.config.transformer.num_frames_per_block)


def _tensor_bytes(value) -> int:
    from .session import _tensor_bytes as count
    return count(value)
