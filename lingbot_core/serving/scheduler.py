"""Which block the engine's one worker runs next, and when it may rest (the policy; the engine does the work).

- Live sessions first, round-robin at block boundaries: the next one that may run moves to the back.
- A session runs at most `max_lead_blocks` blocks ahead of its consumer, and a paced session (its consumer
  called `pace`) no earlier than the start it was given: an idle viewer costs no compute, and a block is made
  as late as playback allows, so it applies every key pressed until then.
- Offline renders (serving/renders.py) go below live sessions: a render block runs when no live block is due
  before it would end, or, once it has waited `max_wait_s`, right after a live block.
- The idle policy: no input for `idle_ttl_s` closes a session; one nobody drove or watched for
  `evictable_after_s` may be evicted, least recently used first, to seat a newcomer.

The engine calls every method under its table lock; `sessions` is its ordered table of seats, each with
`session` (last_input, last_consumed, status), `blocks_waiting`, `waiting_for_input` and `start_at`.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

from lingbot_core.serving.contract import EngineConfig
from lingbot_core.serving.renders import RenderJob, RenderLine
from lingbot_core.serving.contract import SessionStatus


class Scheduler:
    def __init__(self, config: Callable[[], EngineConfig], clock: Callable[[], float]) -> None:
        """config: the engine's config as it is now (a getter: the engine's own attribute stays the one truth)."""
        self._config = config
        self.clock = clock

    @property
    def config(self) -> EngineConfig:
        return self._config()

    def may_run(self, seat: Any) -> bool:
        return seat.session.status is not SessionStatus.CLOSED and not seat.waiting_for_input

    def has_room(self, seat: Any) -> bool:
        return seat.blocks_waiting < self.config.max_lead_blocks

    def runnable(self, seat: Any) -> bool:
        return self.may_run(seat) and self.has_room(seat) and self.clock() >= seat.start_at

    def pick(self, sessions: OrderedDict[str, Any]) -> tuple[str, Any] | None:
        """The next session that may run, round-robin: it moves to the back of the order."""
        for session_id, seat in sessions.items():
            if self.runnable(seat):
                sessions.move_to_end(session_id)
                return session_id, seat
        return None

    def live_block_due(self, sessions: OrderedDict[str, Any], within_s: float) -> bool:
        """Whether a live session will want the model within `within_s` (a paced start, or one runnable now)."""
        now = self.clock()
        return any(self.may_run(seat) and self.has_room(seat) and seat.start_at - now < within_s
                   for seat in sessions.values())

    def render_may_run(self, sessions: OrderedDict[str, Any], renders: RenderLine, job: RenderJob,
                       after_live: bool) -> bool:
        """A render block fits before the next live block, or it has waited its longest and a live block has
        just ended (where the next one is furthest away)."""
        return (after_live and renders.starved(job)) or not self.live_block_due(sessions, renders.block_s)

    def idle_wait(self, sessions: OrderedDict[str, Any], renders: RenderLine) -> float:
        """How long the idle worker sleeps: until the earliest paced start or a waiting render's longest wait,
        at most worker_poll_s."""
        now = self.clock()
        wait = self.config.worker_poll_s
        starts = [seat.start_at for seat in sessions.values() if self.may_run(seat) and self.has_room(seat)]
        if starts:
            wait = min(wait, max(min(starts) - now, 0.001))
        job = renders.runnable()
        if job is not None:
            wait = min(wait, max(job.waiting_since + renders.limits.max_wait_s - now, 0.001))
        return wait

    def idle_expired(self, sessions: OrderedDict[str, Any]) -> list[str]:
        """Sessions nobody has given input (an event or a reset) for idle_ttl_s, watched or not, so a forgotten
        tab does not keep its seat."""
        now = self.clock()
        return [session_id for session_id, seat in sessions.items()
                if now - seat.session.last_input > self.config.idle_ttl_s]

    def evictable(self, sessions: OrderedDict[str, Any]) -> str | None:
        """The least recently used session idle long enough to be evicted, if any."""
        now = self.clock()
        idle = [(max(seat.session.last_input, seat.session.last_consumed), session_id)
                for session_id, seat in sessions.items()
                if now - max(seat.session.last_input, seat.session.last_consumed) >= self.config.evictable_after_s]
        return min(idle)[1] if idle else None
