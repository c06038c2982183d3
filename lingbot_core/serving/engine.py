"""The serving engine: one model, many sessions, bounded memory, one worker.

- Admission by bytes: one probe (serving/memory.py: no model block, the VAE streamed on a small frame and
  scaled) measures a session's peak committed bytes (its KV window, text
  K/V, condition encoder and decoder state, finished blocks waiting for the consumer) and the bytes one
  running block adds (its pages, the pending encoder/decoder/text state, scratch). A newcomer is
  admitted only if   block reserve + condition reserve + (sessions + 1) x session bytes <= budget;
  otherwise it gets a place in line or, with the line full, a clear refusal. A place in line is an outbox
  under the id the session will have: it receives Waiting(position) on joining and whenever its place
  changes, and the engine itself seats the first in line (on the model thread) once room frees, so the
  next message is the session's NewWorld. Nobody polls. The KV page pool is sized from the same sum, so an admitted session never runs out of pages.
- Condition streams, once per picture: sessions that start from the same pixels read one shared
  condition stream (lingbot_core/blocks/condition_cache.py), so its encoder warm-up runs once per process.
  Each session is still charged a stream of its own; streams kept for pictures no session reads now
  stay within the condition reserve (`condition_cache_bytes`).
- One owner: the engine holds every session's state; its consumer learns of it only from the tagged
  messages of the session's outbox (Waiting, NewWorld, Block, Failed, Closed), in order, and keeps nothing else.
- Scheduling: one worker advances sessions one block at a time, round-robin at block boundaries. A
  session runs at most `max_lead_blocks` blocks ahead of its consumer, so an idle viewer costs no
  compute; a consumer that paces its session (`pace`) has each block started just in time instead.
  Input is applied at the next block boundary, so to the earliest block not started.
- Eviction: the one idle policy (no input for idle_ttl_s, on the injected clock; the app's --idle-ttl),
  explicit close (also on consumer disconnect), reset, and LRU eviction of sessions nobody drove or
  watched for evictable_after_s when a newcomer needs the room.
  Every path out goes through `Session.close`, which returns every page.

One model thread: the worker runs every piece of PyTorch work of the engine, the blocks and also the
admissions, resets and closes that other threads ask for (queued ahead of its next block, so they go
first at the block boundary), the loading of the model when the engine is given a loader, and the
conversion of each block to uint8 pixels. PyTorch's CPU kernels run on OpenMP (libgomp) teams, one
team per calling thread; once more team threads exist than cores, libgomp stops spinning between
parallel regions and parks its threads on futexes: on 2 cores a rollout on a second thread spent
0.08-0.09 s of system time a block against under 0.01 s on one (benchmarks/bench_threads.py). Viewer
and request threads therefore never call PyTorch kernels.

Locks: `_step_lock` serialises everything that touches the model or the page pool; with a worker only
the worker takes it, without one (tests, scripts calling `run_once`) the callers do. `_lock` guards the
tables, outboxes and the job queue and is never held during model work. Order: `_step_lock` before
`_lock`, never the other way.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict, deque
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable, TypeVar

import numpy as np

from lingbot_core.blocks.condition_cache import ConditionCache
from lingbot_core.boundary.events import Event
from lingbot_core.boundary.offline import RenderRequest
from lingbot_core.blocks.pipeline import Pipeline
from lingbot_core.boundary.requests import StartRequest
from lingbot_core.process.startup import StartupLog, maybe_stage
from lingbot_core.boundary.video import H264Writer, frames_to_uint8
from lingbot_core.blocks.pages import PageAllocator
from lingbot_core.serving.contract import (Admission, AdmissionRefused, Block, CloseCause, Closed, ClosedSessions,
                                           EngineConfig, Failed, Frames, Message, NewWorld, RenderFailedError,
                                           RenderRefused, Ticket)
from lingbot_core.serving.line import post_positions, read_outbox, unwatched
from lingbot_core.serving.memory import plan_memory
from lingbot_core.serving.renders import (RenderDone, RenderFailed, RenderJob, RenderLine, RenderProgress,
                                          RenderRefusedError)
from lingbot_core.serving.replay import Replay
from lingbot_core.serving.scheduler import Scheduler
from lingbot_core.serving.contract import SessionStatus
from lingbot_core.serving.session import Session

log = logging.getLogger(__name__)

T = TypeVar("T")


class _Queued:
    """A place in line: the parsed request the engine will open a session from, and the outbox its consumer
    reads meanwhile (under the id the session will have)."""

    def __init__(self, request: StartRequest, now: float, first_events: tuple[Event, ...] = (),
                 early_frames: bool = False) -> None:
        self.request = request
        self.first_events = first_events
        self.early_frames = early_frames
        self.outbox: deque[Message] = deque()
        self.position = 0  # the last position posted (0: none yet)
        self.seen = now  # last time its consumer read (or waited on) the outbox: the line's TTL
        self.readers = 0  # consumers waiting in next_message now: a place being watched never expires


class _Live:
    """The engine's bookkeeping around one session."""

    def __init__(self, session: Session, unread: deque[Message] | None = None, early_frames: bool = False) -> None:
        self.session = session
        self.early_frames = early_frames  # post each block's frames as they are decoded (Frames)
        # Waiting messages its consumer has not read yet come first, then the world.
        self.outbox: deque[Message] = deque(unread or ())
        self.outbox.append(NewWorld(session.replay))
        self.waiting_for_input = False  # after a failure: do not retry until something changes
        # Just in time (`pace`): once its consumer paces it, a session's next block starts no earlier than
        # this (engine clock), and a taken block holds the next one back until the consumer says when.
        self.paced = False
        self.start_at = 0.0
        self.position = 0  # the line's fields, so its consumer reads it as it read its place (serving/line.py)
        self.seen = 0.0
        self.readers = 0

    @property
    def blocks_waiting(self) -> int:
        return sum(isinstance(m, Block) for m in self.outbox)


class _EarlyFrames:
    """Posts a block's frames as Frames messages as they are decoded (model thread), for an early_frames session."""

    def __init__(self, engine: "Engine", live: _Live, started: float) -> None:
        config, block = engine.model_config, live.session.block_index
        self.engine, self.live, self.started, self.block_index = engine, live, started, block
        self.total = config.pixel_frames_for_blocks(block + 1) - (config.pixel_frames_for_blocks(block) if block else 0)
        self.done = 0
        self.first_frame_ms: float | None = None

    def post(self, frames) -> None:
        if self.first_frame_ms is None:
            self.first_frame_ms = 1000.0 * (time.perf_counter() - self.started)
        pixels = frames_to_uint8(frames)
        with self.engine._lock:
            self.live.outbox.append(Frames(self.block_index, self.done, self.total, pixels))
            self.engine._changed.notify_all()
        self.done += len(pixels)


class Engine:
    def __init__(self, pipeline: Pipeline | Callable[[], Pipeline], config: EngineConfig = EngineConfig(),
                 clock: Callable[[], float] = time.monotonic, start_worker: bool = True,
                 log: StartupLog | None = None) -> None:
        """`pipeline` may be a loader (called once, on the model thread) so the main thread runs no kernels.

        log: prints the start-up stages (the loader's own, then the memory probe) with their times."""
        self.config = config
        self._log = log
        self.clock = clock
        self._sessions: OrderedDict[str, _Live] = OrderedDict()  # round-robin order
        self._waiting: OrderedDict[str, _Queued] = OrderedDict()  # the line, first first, by future session id
        self._closed = ClosedSessions(config.remembered_closes)
        self._step_lock = threading.Lock()
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)  # outboxes, input, jobs
        self._jobs: deque[tuple[Callable[[], Any], Future]] = deque()  # model work for the worker, in order
        self._prewarm: deque[Any] = deque()  # SharedCondition streams to encode while no session needs the model
        self._renders = RenderLine(config.renders, clock)  # offline renders, a block at a time below live worlds
        self._scheduler = Scheduler(lambda: self.config, clock)  # which block runs next (serving/scheduler.py)
        self._stopped = False
        self._worker_running = False  # set and cleared under _lock: whether queued jobs will be run
        self._worker: threading.Thread | None = None
        if start_worker:
            self._worker_running = True
            self._worker = threading.Thread(target=self._run, name="lingbot-engine", daemon=True)
            self._worker.start()
        try:
            self._on_model_thread(lambda: self._setup(pipeline))
        except BaseException:
            self._stop_worker()
            raise

    def _setup(self, pipeline: Pipeline | Callable[[], Pipeline]) -> None:
        """Load (if given a loader), then the one memory probe and plan (serving/memory.py): the budget, the
        capacity, the page pool's tensors and their bookkeeping (the allocator), which the engine owns and admits by."""
        self.pipeline = pipeline if isinstance(pipeline, Pipeline) else pipeline()
        config = self.config
        with maybe_stage(self._log, "memory probe") as details:
            self.memory = plan_memory(self.pipeline, budget_bytes=config.memory_budget_bytes,
                                      fraction=config.memory_fraction, max_sessions=config.max_sessions,
                                      max_lead_blocks=config.max_lead_blocks,
                                      condition_cache_bytes=config.condition_cache_bytes)
            details.append(f"{self.footprint.committed / 2**20:.1f} MiB a session between blocks, "
                           f"{self.block_reserve / 2**20:.1f} MiB for the running block")
        self.conditions = ConditionCache(self.memory.condition_reserve)
        self.pages = PageAllocator(self.memory.pool_pages)
        self.pool = self.pipeline.new_pool(self.memory.pool_pages)

    @property
    def model_config(self):
        """The model's config (frame size, rate, block length), as every backend gives it."""
        return self.pipeline.config

    def describe(self) -> str:
        """Where this backend's worlds are made, for the page: the precision and why."""
        precision = self.pipeline.precision
        if precision is None:
            return ""
        return f"Precision **{precision.name}**: {precision.reason}."

    def prompt_notice(self, prompt: str) -> str | None:
        """What the model will not read of a cleaned prompt (past its token limit), in words; None when it reads
        all of it. Tokenizer work, no PyTorch kernel: any thread may ask."""
        return self.pipeline.prompt_notice(prompt)

    # The plan's figures, by their names in stats() and the tests.
    footprint = property(lambda self: self.memory.footprint)
    block_reserve = property(lambda self: self.memory.block_reserve)
    reserved_bytes = property(lambda self: self.memory.reserved_bytes)
    session_bytes = property(lambda self: self.memory.session_bytes)
    memory_budget = property(lambda self: self.memory.budget)
    capacity = property(lambda self: self.memory.capacity)

    def _on_model_thread(self, work: Callable[[], T]) -> T:
        """Run `work` under the step lock on the worker, ahead of its next block, and return its result.

        On the worker itself, or without a running worker (tests and scripts that call `run_once`, or after
        shutdown), it runs in the caller's thread instead.
        """
        future: Future = Future()
        with self._lock:
            # A worker that is not alive here is one of a parent process (a ZeroGPU call runs in a fork).
            queued = (self._worker_running and threading.current_thread() is not self._worker
                      and self._worker is not None and self._worker.is_alive())
            if queued:
                self._jobs.append((work, future))
                self._changed.notify_all()
        if not queued:
            with self._step_lock:
                return work()
        return future.result()

    # -- admission ---------------------------------------------------------------------------------

    def _fits_locked(self) -> bool:
        """Room for one more session: its bytes in the plan, and its window of pages in the pool beside the
        windows the live sessions may still fill and the running block's pages."""
        sessions = list(self._sessions.values())
        plan = self.memory
        held = sum(live.session.held_pages for live in sessions)
        still_to_fill = len(sessions) * plan.pages_per_session - held
        running_block = self.pages.num_in_use - held  # pages a block in progress has taken already
        return plan.fits(len(sessions) + 1) and self.pages.can_allocate(
            still_to_fill + plan.pages_per_session + max(plan.block_pages - running_block, 0))

    def admit(self, request: StartRequest, first_events: tuple[Event, ...] = (), early_frames: bool = False) -> Ticket:
        """Open a session if it fits and nobody is ahead in line; otherwise a place in line, whose outbox
        (`next_message` with the ticket's session_id) tells its position and then the new world.

        `request` was parsed at the boundary (lingbot_core/boundary/requests.py: picture fitted, prompt cleaned), on
        the caller's thread, never the model thread. `first_events` are queued before the session can run,
        so they apply to its first block (a protocol init's camera actions). early_frames: its outbox also gets
        each block's frames as they are decoded (Frames), ahead of the Block. Raises AdmissionRefused when
        the line is full.
        """
        with self._lock:
            if self._stopped:
                raise AdmissionRefused("the server is shutting down")
            self._expire_tickets_locked()
            if self._waiting or not self._room_locked():
                return self._join_line_locked(request, first_events, early_frames)
        return self._on_model_thread(lambda: self._open_session(request, first_events, early_frames))

    def _open_session(self, request: StartRequest, first_events: tuple[Event, ...], early_frames: bool) -> Ticket:
        """The admission's model work; runs under the step lock, so no block or other admission interleaves."""
        with self._lock:
            # Another admission may have taken the room while this one waited for the model thread.
            if self._waiting or not self._room_locked():
                return self._join_line_locked(request, first_events, early_frames)
        session_id = uuid.uuid4().hex
        self._seat(session_id, request, None, first_events, early_frames)
        return Ticket(Admission.ADMITTED, session_id=session_id)

    def _seat(self, session_id: str, request: StartRequest, queued: _Queued | None,
              first_events: tuple[Event, ...] = (), early_frames: bool = False) -> None:
        """Open a session (model work: step lock held, table lock not), evicting the LRU idle one if the
        room is only there once it goes. A place in line stays in the line (its consumer reads it there)
        until its session is in the table, so the id always names one or the other."""
        with self._lock:
            if not self._fits_locked():
                self._evict_lru_idle_locked()
        session = Session(session_id, self.pipeline, self.pool, self.pages, request, self.config.max_queued_events,
                          self.clock, self.footprint, self.conditions)
        try:  # not yet in the table: nothing runs it before they are queued
            for event in (queued.first_events if queued is not None else first_events):
                session.post_event(event)
        except BaseException:
            session.close()  # its pages go back
            raise
        with self._lock:
            if queued is not None:
                if self._waiting.get(session_id) is not queued:  # it left the line meanwhile
                    session.close()
                    return
                del self._waiting[session_id]
                self._post_positions_locked()
            early = queued.early_frames if queued is not None else early_frames
            self._sessions[session_id] = _Live(session, queued.outbox if queued is not None else None, early)
            self._changed.notify_all()

    def _seat_waiting(self) -> None:
        """Seat the line, first first, while there is room (model thread, step lock held): after a close, an
        expiry or an eviction made some, and before each block."""
        while True:
            with self._lock:
                self._expire_tickets_locked()
                if self._stopped or not self._waiting or not self._room_locked():
                    return
                session_id, queued = next(iter(self._waiting.items()))
            try:
                self._seat(session_id, queued.request, queued)
            except Exception as exc:  # this request cannot start (e.g. out of memory); the line goes on
                log.warning("session %s could not start: %s", session_id, repr(exc))
                self.withdraw(session_id, f"the world could not start: {type(exc).__name__}: {str(exc)[:300]}",
                              CloseCause.FAILED)

    def withdraw(self, session_id: str, reason: str = "left the line", cause: CloseCause = CloseCause.USER) -> bool:
        """Leave the line at once (the viewer went away), rather than after ticket_ttl_s; whether it was in it."""
        with self._lock:
            if self._waiting.pop(session_id, None) is None:
                return False
            self._remember_closed_locked(session_id, Closed(reason, cause))
            self._post_positions_locked()
            return True

    def _room_locked(self) -> bool:
        return self._fits_locked() or self._scheduler.evictable(self._sessions) is not None

    def _join_line_locked(self, request: StartRequest, first_events: tuple[Event, ...] = (),
                          early_frames: bool = False) -> Ticket:
        if len(self._waiting) >= self.config.max_waiting:
            raise AdmissionRefused(f"the server is full ({len(self._sessions)} worlds running, "
                                   f"{len(self._waiting)} waiting); try again in a minute")
        session_id = uuid.uuid4().hex
        self._waiting[session_id] = _Queued(request, self.clock(), first_events, early_frames)
        self._post_positions_locked()
        return Ticket(Admission.WAITING, session_id=session_id, position=len(self._waiting))

    def _post_positions_locked(self) -> None:
        post_positions(self._waiting.values())
        self._changed.notify_all()

    def _evict_lru_idle_locked(self) -> bool:
        victim = self._scheduler.evictable(self._sessions)
        if victim is None:
            return False
        self._close_locked(victim, "evicted after idling to make room for a new session", CloseCause.EVICTED)
        return True

    def _expire_tickets_locked(self) -> None:
        """A place in line whose outbox nobody has read or waited on for ticket_ttl_s leaves the line."""
        ttl = self.config.ticket_ttl_s
        gone = {id(place) for place in unwatched(list(self._waiting.values()), self.clock(), ttl)}
        expired = [session_id for session_id, place in self._waiting.items() if id(place) in gone]
        for session_id in expired:
            del self._waiting[session_id]
            self._remember_closed_locked(session_id, Closed(f"left the line: nobody waited for {ttl:.0f} s",
                                                            CloseCause.IDLE))
        if expired:
            self._post_positions_locked()

    # -- per-session verbs -------------------------------------------------------------------------

    def _live_locked(self, session_id: str) -> _Live:
        return self._closed.find_open(self._sessions, session_id)

    def post_event(self, session_id: str, raw: dict | Event) -> None:
        """Queue one event for the session's next block; EventError (a ValueError) names what is wrong."""
        with self._lock:
            live = self._live_locked(session_id)
            live.session.post_event(raw)
            live.waiting_for_input = False
            self._changed.notify_all()

    def reset(self, session_id: str, request: StartRequest) -> None:
        """A new world in the same session: blocks of the old world not yet taken are dropped."""

        def work() -> None:
            with self._lock:
                live = self._live_locked(session_id)
            live.session.reset(request)  # model work: outside the table lock
            with self._lock:
                # Blocks of the old world nobody took are dropped; the consumer learns of the new one.
                live.outbox = deque(m for m in live.outbox if not isinstance(m, (Block, NewWorld)))
                live.outbox.append(NewWorld(live.session.replay))
                live.waiting_for_input = False
                self._changed.notify_all()

        self._on_model_thread(work)

    def next_message(self, session_id: str, timeout: float | None = None) -> Message | None:
        """The next message for this session's consumer (or its place in line's); None on timeout (0: do not
        wait). A closed session, or a place that left the line, answers with its Closed message (an id never
        seen raises UnknownSession). Seating moves a place's unread messages into the session's outbox."""

        def taken(holder, message) -> None:
            if isinstance(holder, _Live):
                holder.session.last_consumed = self.clock()  # waiting for video counts as watching
                if holder.paced and isinstance(message, Block):
                    holder.start_at = float("inf")  # the next block waits for its consumer's `pace`

        def holder():
            found = self._sessions.get(session_id) or self._waiting.get(session_id)
            if isinstance(found, _Live):
                found.session.last_consumed = self.clock()
            return found

        with self._lock:
            return read_outbox(self._changed, holder, lambda: self._closed.message(session_id), self.clock,
                               timeout, taken)

    def pace(self, session_id: str, start_in_s: float) -> None:
        """Just in time: start this session's next block `start_in_s` seconds from now (0 or less: at once),
        not as soon as the outbox has room. A consumer that knows when its viewer will need the next block
        (the stream, from the player's playhead) calls this after each block it takes, so the block is
        computed as late as playback allows and applies the input that arrived until then."""
        with self._lock:
            live = self._live_locked(session_id)
            live.paced = True
            live.start_at = self.clock() + start_in_s
            self._changed.notify_all()

    def keep_alive(self, session_id: str) -> None:
        """The client is there though it sends no input (a protocol's ping): the idle clock starts again. A
        session still in line, or closed, is left as it is."""
        with self._lock:
            live = self._sessions.get(session_id)
            if live is not None:
                live.session.last_input = self.clock()

    def close(self, session_id: str, reason: str = "closed", cause: CloseCause = CloseCause.USER) -> None:
        """Close a session (by the user, or on consumer disconnect), or take its place out of the line;
        idempotent, returns every page, and seats whoever the room now fits."""
        if self.withdraw(session_id, reason, cause):
            return

        def work() -> None:
            with self._lock:
                self._close_locked(session_id, reason, cause)
            self._seat_waiting()

        self._on_model_thread(work)

    def _close_locked(self, session_id: str, reason: str, cause: CloseCause) -> None:
        """Needs the step lock (the pool is touched) and the table lock."""
        live = self._sessions.pop(session_id, None)
        if live is None:
            return
        live.session.close()
        live.outbox.clear()  # finished blocks nobody will take: drop their frames now
        self._remember_closed_locked(session_id, Closed(reason, cause))

    def _remember_closed_locked(self, session_id: str, closed: Closed) -> None:
        """Why a session closed (or a place left the line), for its consumer's next_message and late callers."""
        self._closed.remember(session_id, closed)
        self._changed.notify_all()

    def session_status(self, session_id: str) -> dict[str, Any]:
        with self._lock:
            live = self._sessions.get(session_id)
            if live is None:
                return {"status": SessionStatus.CLOSED.value, "closed_reason": self._closed.message(session_id).reason}
            status = live.session.describe()
            status.update(bytes=sum(live.session.nbytes().values()), blocks_waiting=live.blocks_waiting,
                          waiting_for_input=live.waiting_for_input)
            return status

    def replay(self, session_id: str) -> Replay:
        """A copy of the session's replay log as it stands (scripts and tests; a stream builds its own from
        the NewWorld and Block messages it receives)."""
        with self._lock:
            return self._live_locked(session_id).session.replay

    # -- offline renders (serving/renders.py) ------------------------------------------------------

    def render(self, request: RenderRequest, out_path: Path, owner: str | None = None,
               progress: Callable[[RenderProgress], None] | None = None) -> int:
        """An offline video: its blocks are made on the model between live blocks, below their priority, and
        written to `out_path` here, on the caller's thread, as they come. Returns the number of blocks.

        owner: who asks (a client address), for the line's per-owner bound; progress: told the render's place
        in line whenever it changes, then each block made. RenderRefused when the line is full or the owner
        already has a render in it; RenderFailedError when a block fails (no file is left either way)."""
        with self._lock:
            if self._stopped:
                raise RenderRefused("the server is shutting down")
            try:
                job = self._renders.add(request, owner)
            except RenderRefusedError as exc:
                raise RenderRefused(str(exc)) from None
            self._changed.notify_all()
        config = self.model_config
        writer = H264Writer(out_path, width=config.width, height=config.height, fps=config.fps)
        finished, written = False, 0
        try:
            while True:
                item = self._next_render_item(job)
                if isinstance(item, np.ndarray):
                    writer.write(item)
                    written += 1
                    if progress is not None:
                        progress(RenderProgress(0, written, job.total))
                elif isinstance(item, RenderProgress):
                    if progress is not None:
                        progress(item)
                elif isinstance(item, RenderDone):
                    finished = True
                    return item.blocks
                elif isinstance(item, RenderFailed):
                    raise RenderFailedError(item.text)
        finally:
            writer.close()
            if not finished:
                out_path.unlink(missing_ok=True)
                with self._lock:
                    running = not job.ended
                if running:  # the caller went away (or failed writing): the render stops and frees its pages
                    self._on_model_thread(lambda: self._end_render(job, RenderFailed("the render was cancelled")))

    def _worker_alive_locked(self) -> bool:
        return self._worker_running and self._worker is not None and self._worker.is_alive()

    def _next_render_item(self, job: RenderJob):
        """The render's next item, waiting for the worker to make it; without a running worker (tests, a
        ZeroGPU fork) the caller makes its blocks itself."""
        while True:
            with self._lock:
                if job.outbox:
                    item = job.outbox.popleft()
                    self._changed.notify_all()  # room for the next block
                    return item
                inline = not self._worker_alive_locked()
                if not inline:
                    self._changed.wait(self.config.worker_poll_s)
                    continue
            self._render_block(force=True)

    def _render_block(self, force: bool = False, after_live: bool = False) -> bool:
        """One block of the first render in line, if its requester has room for it and no live block is due
        before it would end; whether one ran. A render that has waited its longest (`RenderLimits.max_wait_s`)
        runs anyway, right after a live block (`after_live`): where the next live block is furthest away."""
        with self._step_lock:
            with self._lock:
                job = self._renders.runnable()
                if job is None or self._stopped:
                    return False
                if not force and not self._scheduler.render_may_run(self._sessions, self._renders, job, after_live):
                    return False
            started = time.perf_counter()
            try:
                if job.outputs is None:  # the first block opens the rollout (its private page pool); its condition
                    # stream is the picture's shared one, warm already when a live world plays the same picture
                    request = job.request
                    job.outputs = self.pipeline.rollout_request(request.start, request.controls,
                                                                start_camera=request.start_camera,
                                                                conditions=self.conditions)
                output = next(job.outputs, None)
                pixels = None if output is None else frames_to_uint8(output.frames)
                self.conditions.trim()
            except Exception as exc:  # the render ends with the reason; live worlds go on
                log.warning("offline render failed at block %d: %s", job.blocks_done, repr(exc))
                self._end_render(job, RenderFailed(f"block {job.blocks_done} failed: {type(exc).__name__}: "
                                                   f"{str(exc)[:300]}"))
                return True
            with self._lock:
                if pixels is not None:
                    job.outbox.append(pixels)
                    self._renders.ran(job, time.perf_counter() - started)
                    self._changed.notify_all()
                done = pixels is None or job.blocks_done >= job.total
            if done:
                self._end_render(job, RenderDone(job.blocks_done))
            return True

    def _end_render(self, job: RenderJob, final) -> None:
        """Close the render's rollout (its pages go back) and leave the line; step lock held (or the model
        thread's job)."""
        if job.outputs is not None:
            job.outputs.close()
            job.outputs = None
        with self._lock:
            if job.ended:
                return
            job.outbox.append(final)
            self._renders.remove(job)
            self._changed.notify_all()

    def render_stats(self) -> dict[str, Any]:
        with self._lock:
            return {"renders": len(self._renders.jobs), "render_block_s": round(self._renders.block_s, 3)}

    # -- condition warm-up -------------------------------------------------------------------------

    def prewarm(self, pictures) -> None:
        """Encode these start pictures' condition streams to their fixed point while the model is idle.

        Until its stream reaches the fixed point (about ten blocks for the embedded VAE) every block of a
        new picture pays a condition encode, the largest part of an early block on a CPU. The app passes its
        example pictures, so a world started from one runs at full speed from its first block. `pictures`
        are PIL images fitted to the model's size (as StartRequest.picture: lingbot_core/boundary/requests.py). The
        work goes one block at a time while nobody plays (`warm_one_condition_block`): a start or a queued job
        waits for at most one block's encode, and the streams live in the condition cache within its
        reserve, accounted like any other.
        """
        def queue() -> None:
            streams = [self.pipeline.shared_condition(self.pipeline.pixels(picture), self.conditions)
                       for picture in pictures]
            with self._lock:
                self._prewarm.extend(stream for stream in streams if not stream.fixed)
                self._changed.notify_all()
        self._on_model_thread(queue)

    def warm_one_condition_block(self) -> bool:
        """One block of the oldest unfinished prewarm stream, if no session is open and no job waits.

        Not while anyone plays, even between paced blocks: an encode started just before a paced block would
        make that block late. The idle worker calls this; tests without a worker call it directly. Returns
        whether it encoded."""
        with self._step_lock:
            with self._lock:
                busy = self._stopped or self._jobs or self._sessions
                while self._prewarm and self._prewarm[0].fixed:
                    self._prewarm.popleft()
                if busy or not self._prewarm:
                    return False
                stream = self._prewarm[0]
            try:
                self.pipeline.encode_next_condition_block(stream)
            except Exception:  # the stream is as it was (SharedCondition keeps a failed encode out); drop it
                log.exception("condition prewarm failed; the picture's sessions will encode it themselves")
                with self._lock:
                    self._prewarm.popleft()
            self.conditions.trim()
            return True

    # -- telemetry and accounting ------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"active_sessions": len(self._sessions), "waiting": len(self._waiting),
                    "capacity": self.capacity, "pages_in_use": self.pages.num_in_use,
                    "pages_total": self.pages.num_pages, "accounted_bytes": self.accounted_bytes(),
                    "memory_budget": self.memory_budget, "session_bytes": self.session_bytes,
                    "block_reserve": self.block_reserve, "condition_cache_bytes": self.conditions.nbytes(),
                    "condition_streams": len(self.conditions)}

    def accounted_bytes(self) -> int:
        """Bytes every live session holds now (committed + in-flight) plus the blocks in their outboxes."""
        with self._lock:
            lives = list(self._sessions.values())
            outboxes = sum(m.nbytes for live in lives for m in live.outbox if isinstance(m, (Block, Frames)))
        sessions = sum(sum(live.session.nbytes().values()) for live in lives)
        return sessions + outboxes + self.conditions.nbytes()  # shared condition streams: once

    def session_ids(self) -> list[str]:
        with self._lock:
            return list(self._sessions)

    # -- the worker --------------------------------------------------------------------------------

    def _expire_idle_locked(self) -> None:
        """The one idle policy (serving/scheduler.py): no input for idle_ttl_s closes a session."""
        ttl = self.config.idle_ttl_s
        for session_id in self._scheduler.idle_expired(self._sessions):
            self._close_locked(session_id, f"no input for {ttl:.0f} s", CloseCause.IDLE)

    def run_once(self) -> str | None:
        """Advance one runnable session by one block: its id, or None if none could run.

        The worker loops on this; tests call it directly with start_worker=False.
        """
        with self._step_lock:
            with self._lock:
                self._expire_idle_locked()
            self._seat_waiting()  # room an idle close, a departure or an eviction made
            with self._lock:
                picked = self._scheduler.pick(self._sessions)
                if picked is None:
                    return None
                session_id, live = picked
            started = time.perf_counter()
            rollout = live.session.rollout  # read under the step lock: the pose this block starts from
            start_pose = rollout.camera.pose.copy() if rollout is not None else None
            early = _EarlyFrames(self, live, started) if live.early_frames else None
            try:
                output = live.session.step(on_frames=early.post) if early is not None else live.session.step()
                self.conditions.trim()  # the block may have grown a shared stream
            except Exception as exc:  # the session is intact; tell its consumer
                log.warning("session %s: block %d failed: %s", session_id, live.session.block_index, repr(exc))
                # The events this block tried to apply are dropped, so one poisoned event cannot fail every
                # later block; the session goes on without them. A block that failed with no new input
                # waits for some instead of failing again and again.
                dropped = live.session.drop_failed_events()
                ids = ", ".join(map(str, dropped))
                if not dropped:
                    what = f"block {live.session.block_index} failed"
                elif len(dropped) == 1:
                    what = f"event {ids} could not be applied and was dropped"
                else:
                    what = f"events {ids} could not be applied and were dropped"
                with self._lock:
                    live.waiting_for_input = not dropped
                    live.outbox.append(Failed(f"{what}: {type(exc).__name__}: {str(exc)[:300]}",
                                              waiting_for_input=not dropped))
                    self._changed.notify_all()
                return session_id
            block_ms = 1000.0 * (time.perf_counter() - started)
            message = Block(output.block_index, frames_to_uint8(output.frames), output.latents.cpu(),
                            output.stage_ms, block_ms, live.session.replay_entry(output.block_index),
                            np.asarray(output.poses), start_pose,
                            first_frame_ms=early.first_frame_ms if early is not None else None)
            with self._lock:
                live.outbox.append(message)
                self._changed.notify_all()
            return session_id

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._jobs:
                    work, future = self._jobs.popleft()
                elif self._stopped:
                    self._worker_running = False  # later requests run in their callers' threads
                    return
                else:
                    work = None
            if work is not None:  # admissions, resets and closes go before the next block
                if future.set_running_or_notify_cancel():
                    try:
                        with self._step_lock:
                            future.set_result(work())
                    except BaseException as exc:  # handed to the thread that asked
                        future.set_exception(exc)
                continue
            try:
                ran = self.run_once()
                if self._render_block(after_live=ran is not None):  # in the gap a live block left
                    continue
            except Exception:  # a bug, not a session failure: keep serving the others
                log.exception("engine worker iteration failed")
                ran = None
            if ran is None and self.warm_one_condition_block():
                continue
            if ran is None:
                with self._lock:
                    if not self._stopped and not self._jobs and not any(
                            self._scheduler.runnable(live) for live in self._sessions.values()):
                        self._changed.wait(self._scheduler.idle_wait(self._sessions, self._renders))

    def _stop_worker(self) -> None:
        """Stop the worker after the jobs already queued; later model work runs in its callers' threads."""
        with self._lock:
            self._stopped = True
            self._changed.notify_all()
        if self._worker is not None:
            self._worker.join()

    def shutdown(self) -> None:
        """Stop the worker and close every session."""
        self._stop_worker()
        with self._step_lock:
            for job in list(self._renders.jobs):
                self._end_render(job, RenderFailed("the server is shutting down"))
            with self._lock:
                for session_id in list(self._sessions):
                    self._close_locked(session_id, "server shutting down", CloseCause.SHUTDOWN)
                for session_id in list(self._waiting):
                    self.withdraw(session_id, "server shutting down", CloseCause.SHUTDOWN)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()
