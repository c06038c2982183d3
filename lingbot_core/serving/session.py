"""One user's world: its rollout state, its event queue, a transactional step and a replay log.

The session never touches another session's state and holds no global state. `step` assembles the
block's control from queued events, runs the block through the pipeline and, only when every stage
succeeded, commits the new rollout state, consumes the events, raises the event floor and appends
to the replay. A failure leaves all of that exactly as it was and marks nothing but `last_error`.
"""

from __future__ import annotations

import enum
import json
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..events import Event, EventError, KeyStateEvent, ScriptEvent, parse_event
from ..image import image_digest, load_image
from ..kv_cache import KVPagePool
from ..model.text import normalize_prompt
from ..rollout import BlockControl, BlockOutput, RolloutState, release


class SessionStatus(enum.Enum):
    ACTIVE = "active"
    FAILED = "failed"  # the last block raised; the state is intact and the next step may succeed
    CLOSED = "closed"


class SessionClosed(RuntimeError):
    """The session was closed (by the user, a disconnect, its idle TTL or eviction)."""


@dataclass
class Replay:
    """Enough to regenerate the identical latents offline: image hash, seed, prompts and per-block keys."""

    model: str
    image_sha256: str
    seed: int
    prompt: str
    blocks: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps({"model": self.model, "image_sha256": self.image_sha256, "seed": self.seed,
                           "prompt": self.prompt, "blocks": self.blocks}, indent=1)

    def to_events_jsonl(self) -> str:
        """The action script that `python -m lingbot_core.generate --events` replays block for block."""
        lines = []
        for index, block in enumerate(self.blocks):
            event = {"event_id": index, "frames": block["frames"]}
            if "prompt" in block:
                event["prompt"] = block["prompt"]
            lines.append(json.dumps(event))
        return "\n".join(lines) + "\n"


class Session:
    def __init__(self, session_id: str, pipeline, pool: KVPagePool, image, prompt: str, seed: int,
                 max_queued_events: int = 64, clock=time.monotonic) -> None:
        self.session_id = session_id
        self.pipeline = pipeline
        self.pool = pool
        self.max_queued_events = max_queued_events
        self.clock = clock
        self.status = SessionStatus.ACTIVE
        self.last_error: str | None = None
        self.event_floor = -1  # highest event id accepted; ids must exceed it, also across resets
        self.queue: deque[Event] = deque()
        self.held_keys: frozenset[str] = frozenset()
        self.last_input = self.last_consumed = clock()
        self.rollout: RolloutState | None = None
        self._start(image, prompt, seed)

    # -- lifecycle ---------------------------------------------------------------------------------

    def _start(self, image, prompt: str, seed: int) -> None:
        picture = load_image(image)
        text = normalize_prompt(prompt, self.pipeline.config.text.max_prompt_chars)
        rollout = self.pipeline.start(picture, text, seed)
        if self.rollout is not None:
            release(self.pool, self.rollout)
        self.rollout = rollout
        self.replay = Replay(self.pipeline.config.name, image_digest(picture), int(seed), text)
        self.queue.clear()
        self.held_keys = frozenset()
        self.status = SessionStatus.ACTIVE

    def reset(self, image, prompt: str, seed: int) -> None:
        """A new world in the same session; event ids keep increasing from where they were."""
        self._check_open()
        self._start(image, prompt, seed)

    def close(self) -> None:
        if self.status is SessionStatus.CLOSED:
            return
        if self.rollout is not None:
            release(self.pool, self.rollout)
        self.rollout = None
        self.queue.clear()
        self.status = SessionStatus.CLOSED

    @property
    def block_index(self) -> int:
        return self.rollout.block_index if self.rollout is not None else 0

    # -- input -------------------------------------------------------------------------------------

    def post_event(self, raw: dict | Event) -> None:
        """Queue one event for the next block boundary; a bad event raises EventError and changes nothing."""
        self._check_open()
        frames_per_block = self.pipeline.config.transformer.num_frames_per_block
        event = raw if isinstance(raw, (ScriptEvent, KeyStateEvent)) else parse_event(raw, frames_per_block)
        last_id = self.queue[-1].event_id if self.queue else self.event_floor
        if event.event_id <= last_id:
            raise EventError(f"event_id {event.event_id} is stale or a duplicate; the next id must exceed {last_id}")
        if len(self.queue) >= self.max_queued_events:
            raise EventError(f"the event queue is full ({self.max_queued_events} events); wait for a block")
        if event.prompt is not None:
            event = replace(event, prompt=normalize_prompt(event.prompt, self.pipeline.config.text.max_prompt_chars))
        self.queue.append(event)
        self.last_input = self.clock()

    def _next_control(self) -> tuple[BlockControl, int, frozenset[str]]:
        """This block's control, how many queued events it consumes, and the held keys after it."""
        frames_per_block = self.pipeline.config.transformer.num_frames_per_block
        held, tapped, prompt, used = self.held_keys, set(), None, 0
        for event in self.queue:
            if isinstance(event, ScriptEvent):  # one script event per block, after any key changes before it
                used += 1
                prompt = event.prompt or prompt
                frames = tuple(f | held for f in event.frames)
                return BlockControl(actions=frames, prompt=prompt), used, held
            # A key pressed and released between two blocks still acts for one frame.
            tapped |= event.keys - held
            held = event.keys
            prompt = event.prompt or prompt
            used += 1
        frames = (held | tapped,) + (held,) * (frames_per_block - 1)
        return BlockControl(actions=frames, prompt=prompt), used, held

    # -- the block ---------------------------------------------------------------------------------

    def step(self, on_stage=None) -> BlockOutput:
        """Run one block; commit everything or nothing."""
        self._check_open()
        control, used, held_after = self._next_control()
        state = self.rollout
        try:
            if control.prompt is not None and control.prompt != state.prompt:
                state = self.pipeline.with_prompt(state, control.prompt)  # text K/V once per switch
            output, committed = self.pipeline.step(self.pool, state, control, on_stage=on_stage)
        except Exception as exc:
            self.status = SessionStatus.FAILED
            self.last_error = f"{type(exc).__name__}: {exc}"
            raise
        # Commit: the rollout, the consumed events, the held keys and the replay move together.
        record: dict[str, Any] = {"frames": [sorted(f) for f in control.actions]}
        if committed.prompt != self.rollout.prompt:
            record["prompt"] = committed.prompt
        self.rollout = committed
        for _ in range(used):
            self.event_floor = self.queue.popleft().event_id
        self.held_keys = held_after
        self.replay.blocks.append(record)
        self.status = SessionStatus.ACTIVE
        self.last_error = None
        return output

    # -- accounting --------------------------------------------------------------------------------

    def nbytes(self) -> dict[str, int]:
        """Bytes this session holds now, by component (KV counted as whole pages)."""
        if self.rollout is None:
            return {}
        page_bytes = KVPagePool.page_nbytes(self.pipeline.config, self.pool.k.dtype)
        return {
            "kv_pages": len(self.rollout.kv.frame_pages) * page_bytes,
            "text_kv": _tensor_bytes(self.rollout.text_kv),
            "condition": self.rollout.condition.nbytes(),
            "decoder": self.rollout.decoder.nbytes(),
        }

    def _check_open(self) -> None:
        if self.status is SessionStatus.CLOSED:
            raise SessionClosed(f"session {self.session_id} is closed")


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.nbytes
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    if hasattr(value, "__dict__"):
        return sum(_tensor_bytes(v) for v in vars(value).values())
    return 0
