"""One user's world: its rollout state, its event queue, a transactional step and a replay log.

A session owns everything one world carries between blocks: the rollout state (condition encoder
history or its fixed-point marker, decoder stream state, KV page table, text K/V, RNG state, camera
tail pose and pitch, prompt, block index) plus the input side (queued events, held keys, event
floor) and a replay log. It holds no global state and never touches another session's state.

`step` takes the block's control from the queued events, runs the block and, only when every stage
succeeded, commits the new rollout state, consumes the events, raises the event floor and appends
to the replay, all at once. A failure leaves every one of those exactly as it was; the session is
marked FAILED (with `last_error`) and the next step may succeed.

Threads: the engine owns every session and serialises `step`, `reset` and `close` on its model thread
(the KV pool is not thread-safe), so a session never sees two of them at once. Input (`post_event`)
and the readings (`nbytes`, `describe`, `replay`) come from request threads while the model thread
steps outside the engine's table lock: a small internal lock guards the queue, the replay and the
commit against them.
"""

from __future__ import annotations

import copy
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from lingbot_core.blocks.condition_cache import ConditionCache
from lingbot_core.boundary.events import (Event, EventError, KeyStateEvent, MotionEvent, PoseEvent, ScriptEvent,
                                          accept_event, block_keys)
from lingbot_core.boundary.image import image_digest
from lingbot_core.blocks.kv_cache import KVPagePool
from lingbot_core.blocks.pages import PageAllocator
from lingbot_core.boundary.requests import StartRequest
from lingbot_core.boundary.requests import BlockControl
from lingbot_core.blocks.rollout import BlockOutput, RolloutState, release
from lingbot_core.model import camera
from lingbot_core.model.camera_motion import CameraMotion, advance
from lingbot_core.serving.contract import SessionStatus
from lingbot_core.serving.memory import Footprint, committed_bytes, in_flight_bytes
from lingbot_core.serving.replay import Replay


class SessionClosed(RuntimeError):
    """The session was closed (by the user, a disconnect, the idle policy or eviction)."""


# ---------------------------------------------------------------------------------------------
# The session


@dataclass(frozen=True)
class _Plan:
    """One block's input, taken from the queue at the block boundary."""

    control: BlockControl
    consumed: int  # queued events this block applies
    held_after: frozenset[str]
    motion_after: CameraMotion | None  # the SE(3) camera command in force after the block
    event_ids: tuple[int, ...]


class Session:
    def __init__(self, session_id: str, pipeline, pool: KVPagePool, pages: PageAllocator, request: StartRequest,
                 max_queued_events: int = 64, clock: Callable[[], float] = time.monotonic,
                 footprint: Footprint | None = None, conditions: ConditionCache | None = None) -> None:
        """pool, pages: the K/V tensors and their owner's bookkeeping (the engine's; a session takes and returns
        pages, it never sizes or owns them). conditions: where sessions share one condition stream per start
        picture (the engine's cache)."""
        if max_queued_events < 1:
            raise ValueError(f"max_queued_events must be at least 1, got {max_queued_events}")
        self.session_id = session_id
        self.pipeline = pipeline
        self.pool = pool
        self.pages = pages
        self.max_queued_events = max_queued_events
        self.clock = clock
        self.footprint = footprint
        self.conditions = conditions
        self._lock = threading.Lock()  # queue, held keys, floor, replay, status: the parts input touches
        self._in_flight: dict[str, int] = {}
        self.status = SessionStatus.ACTIVE
        self.last_error: str | None = None
        self.event_floor = -1  # id of the last event a committed block applied
        self._last_event_id = -1  # highest id ever accepted: ids increase across blocks and resets
        self.queue: deque[Event] = deque()
        self._failed_event_ids: tuple[int, ...] = ()  # the input of the last failed block
        self.held_keys: frozenset[str] = frozenset()
        self.motion: CameraMotion | None = None  # an SE(3) camera command in force (camera motion events)
        self.last_input = self.last_consumed = clock()
        self.rollout: RolloutState | None = None
        self._replay: Replay | None = None  # grows with each commit: read only under the lock
        self._start(request)

    # -- lifecycle ---------------------------------------------------------------------------------

    def _start(self, request: StartRequest) -> None:
        """Build the new world first; only then drop the old one, so a start that fails changes nothing.
        The request was parsed at the boundary (lingbot_core/boundary/requests.py) and is trusted here."""
        rollout = self.pipeline.start_request(request, conditions=self.conditions)
        replay = Replay(self.pipeline.config.name, image_digest(request.picture), request.seed, request.prompt,
                        dtype=str(self.pipeline.dtype).removeprefix("torch."))
        with self._lock:
            old, self.rollout, self._replay = self.rollout, rollout, replay
            self.queue.clear()  # input meant for the old world; its ids stay spent
            self.event_floor = self._last_event_id
            self.held_keys = frozenset()
            self.motion = None
            self.status = SessionStatus.ACTIVE
            self.last_error = None
            self.last_input = self.clock()
        if old is not None:
            release(self.pages, old)

    def reset(self, request: StartRequest) -> None:
        """A new world in the same session; event ids keep increasing from where they were."""
        with self._lock:
            self._check_open()
        self._start(request)

    def close(self) -> None:
        """Return every page and drop every tensor (idempotent; never during a block: see Threads above)."""
        with self._lock:
            if self.status is SessionStatus.CLOSED:
                return
            self.status = SessionStatus.CLOSED
            self.queue.clear()
            rollout, self.rollout = self.rollout, None
        if rollout is not None:
            release(self.pages, rollout)

    @property
    def block_index(self) -> int:
        rollout = self.rollout
        return rollout.block_index if rollout is not None else 0

    @property
    def held_pages(self) -> int:
        """KV pages the committed state holds (the engine admits by the pages sessions may still take)."""
        rollout = self.rollout
        return len(rollout.kv.frame_pages) if rollout is not None else 0

    @property
    def replay(self) -> Replay | None:
        """A copy of this world's replay log as it stands (the log itself grows with each commit)."""
        with self._lock:
            return None if self._replay is None else self._replay.copy()

    def replay_entry(self, block_index: int) -> dict[str, Any]:
        """A copy of the replay record of this world's committed block `block_index`."""
        with self._lock:
            return copy.deepcopy(self._replay.blocks[block_index])

    # -- input -------------------------------------------------------------------------------------

    def post_event(self, raw: dict | Event) -> Event:
        """Queue one event for the next block boundary; a bad event raises EventError and changes nothing."""
        config = self.pipeline.config
        event = accept_event(raw, config.transformer.num_frames_per_block, config.text.max_prompt_chars)
        with self._lock:
            self._check_open()
            if event.event_id <= self._last_event_id:
                raise EventError(f"event_id {event.event_id} is stale or a duplicate; "
                                 f"the next id must exceed {self._last_event_id}")
            if len(self.queue) >= self.max_queued_events:
                raise EventError(f"the event queue is full ({self.max_queued_events} events); "
                                 "wait for the next block")
            self.queue.append(event)
            self._last_event_id = event.event_id
            self.last_input = self.clock()
        return event

    def _plan(self) -> _Plan:
        """This block's control from the queue (caller holds the lock); the queue itself is not changed.

        Key-state events reduce as upstream's reducer does (events.block_keys): the last state holds, and the
        last non-empty state, when it differs, is the first frame's one pulse. A script event (keys or poses)
        ends the block's input: it gives the block's frames (plus the keys held by then), and later events wait.
        Camera motion (an SE(3) velocity or target, vLLM-Omni's camera interaction) and held keys are two ways
        to drive the camera: the later input of the two wins, and the other stops (a newer camera event
        cancels the one in force, as upstream). A motion in force gives the block's poses from the camera's
        pose at the block boundary (model/camera_motion.advance), normalised by the key step, so a velocity of
        one step a latent frame reads as a held key does.
        """
        config = self.pipeline.config
        frames_per_block = config.transformer.num_frames_per_block
        snapshots, prompt, ids, script = [], None, [], None
        motion, motion_event = self.motion, None
        for event in self.queue:
            ids.append(event.event_id)
            prompt = event.prompt if event.prompt is not None else prompt
            if isinstance(event, (ScriptEvent, PoseEvent)):
                script = event
                break
            if isinstance(event, MotionEvent):
                motion_event, snapshots = event, []  # keys before it are over; the keys held stop
            elif isinstance(event, KeyStateEvent):
                snapshots.append(event.keys)
                motion_event, motion = None, None  # key input after a motion: keys drive from here
        held_before = frozenset() if motion_event is not None else self.held_keys
        frames, held = block_keys(held_before, snapshots, frames_per_block)
        if isinstance(script, PoseEvent):
            return _Plan(self._pose_control(script.poses, prompt), len(ids), held, None, tuple(ids))
        if script is not None:
            frames = tuple(keys | held for keys in script.frames)
            return _Plan(BlockControl(actions=frames, prompt=prompt), len(ids), held, None, tuple(ids))
        if motion_event is not None:
            pose = self.rollout.camera.pose
            motion = (CameraMotion.velocity(motion_event.translation, motion_event.rotation)
                      if motion_event.mode == "velocity" else
                      CameraMotion.toward(pose, motion_event.translation, motion_event.rotation, motion_event.steps))
        if motion is None:
            return _Plan(BlockControl(actions=frames, prompt=prompt), len(ids), held, None, tuple(ids))
        poses, motion_after = advance(motion, self.rollout.camera.pose, frames_per_block)
        return _Plan(self._pose_control(poses, prompt), len(ids), frozenset(), motion_after, tuple(ids))

    def _pose_control(self, poses, prompt: str | None) -> BlockControl:
        """A block driven by poses as key input is: the key-input intrinsics, translations in key steps."""
        config = self.pipeline.config
        frames = config.transformer.num_frames_per_block
        return BlockControl(poses=poses, intrinsics=camera.reference_intrinsics(config.camera, frames, config.width,
                                                                                config.height),
                            translation_scale=config.camera.move_step, prompt=prompt)

    # -- the block ---------------------------------------------------------------------------------

    def step(self, on_stage: Callable[[str], None] | None = None, on_frames=None) -> BlockOutput:
        """Run one block; commit everything or nothing.

        on_stage(name) is called before each stage: "text" (only when the prompt changes), then the
        rollout's "condition", "denoise", "decode", "commit" and "done". Raising from it fails the block.
        """
        with self._lock:
            self._check_open()
            plan = self._plan()
            state = self.rollout
            switch = plan.control.prompt is not None and plan.control.prompt != state.prompt
            self._in_flight = in_flight_bytes(self.pipeline, self.pool.k.dtype, self.footprint, state, switch)
        try:
            if switch:
                if on_stage is not None:
                    on_stage("text")
                state = self.pipeline.with_prompt(state, plan.control.prompt)  # text K/V once per switch
            early = {"on_frames": on_frames} if on_frames is not None else {}  # only for a viewer that wants them
            output, committed = self.pipeline.step(self.pool, self.pages, state, plan.control, on_stage=on_stage,
                                                   **early)
        except BaseException as exc:
            with self._lock:
                self._in_flight = {}
                self.status = SessionStatus.FAILED
                self.last_error = f"{type(exc).__name__}: {exc}"
                self._failed_event_ids = plan.event_ids
            raise

        # Commit: the rollout, the consumed events, the held keys and the replay move together.
        if plan.control.poses is not None:  # driven by poses: the replay keeps them (what regenerates the block)
            record: dict[str, Any] = {"poses": [pose.tolist() for pose in plan.control.poses],
                                      "event_ids": list(plan.event_ids)}
        else:
            record = {"frames": [sorted(keys) for keys in plan.control.actions], "event_ids": list(plan.event_ids)}
        if switch:
            record["prompt"] = committed.prompt
        with self._lock:
            self._in_flight = {}
            self.rollout = committed
            for _ in range(plan.consumed):
                self.queue.popleft()
            if plan.event_ids:
                self.event_floor = plan.event_ids[-1]
            self.held_keys = plan.held_after
            self.motion = plan.motion_after
            self._replay.blocks.append(record)
            self.status = SessionStatus.ACTIVE
            self.last_error = None
        return output

    def drop_failed_events(self) -> tuple[int, ...]:
        """After a failed block: take the events it tried to apply off the queue (their ids stay spent), so
        the next block runs without them. Returns their ids; () if the block had no new input."""
        with self._lock:
            failed, self._failed_event_ids = set(self._failed_event_ids), ()
            dropped = []
            while self.queue and self.queue[0].event_id in failed:
                dropped.append(self.queue.popleft().event_id)
            return tuple(dropped)

    # -- accounting --------------------------------------------------------------------------------

    def nbytes(self) -> dict[str, int]:
        """Bytes this session holds now, by component: the committed state plus, during a block, in-flight."""
        with self._lock:
            rollout, in_flight = self.rollout, dict(self._in_flight)
        if rollout is None:
            return {}
        return {**committed_bytes(rollout, KVPagePool.page_nbytes(self.pipeline.config, self.pool.k.dtype)),
                **in_flight}

    def describe(self) -> dict[str, Any]:
        """A consistent snapshot for status displays."""
        with self._lock:
            return {"block_index": self.block_index, "status": self.status.value, "last_error": self.last_error,
                    "queued_events": len(self.queue), "event_floor": self.event_floor,
                    "held_keys": sorted(self.held_keys),
                    "prompt": self.rollout.prompt if self.rollout is not None else None}

    def _check_open(self) -> None:
        if self.status is SessionStatus.CLOSED:
            raise SessionClosed(f"session {self.session_id} is closed")
