"""When a viewer needs its next block: where its playhead is, and how much video to keep ahead of it.

The page's stream (serving/streaming.py) asks the engine to start each block just in time (`pace`): late
enough that it applies every key pressed until then, early enough that it reaches the player `lead_s`
before the player runs dry. `PlaybackClock` places the playhead, from the player's own reports when it
makes them; `AdaptiveLead` keeps each viewer's lead as small as its playback allows.
"""

from __future__ import annotations

from typing import Protocol


class LeadBounds(Protocol):
    """The lead's settings (StreamConfig in serving/streaming.py has them)."""

    lead_s: float
    lead_min_s: float
    lead_max_s: float
    lead_up_s: float
    lead_down_s: float
    lead_calm_blocks: int


class PlaybackClock:
    """Where the viewer's playhead is: reported by the player when it can, else estimated from what was sent.

    `origin` is the wall time at which the playhead would have been at 0 had the player never waited.
    Estimate: a segment reaches the player `delivery_s` after it is sent, and a player that ran dry
    resumes when the next one arrives (origin moves forward). A report (`observe`) replaces the estimate:
    a paused or stalled player stops the clock, so the world waits for its viewer.
    """

    def __init__(self, delivery_s: float = 0.0) -> None:
        self.delivery_s = delivery_s
        self.sent_s = 0.0  # seconds of video sent so far
        self.origin: float | None = None

    def playhead(self, now: float) -> float:
        if self.origin is None:
            return 0.0
        return min(max(now - self.origin, 0.0), self.sent_s)

    def on_sent(self, duration_s: float, now: float) -> None:
        arrives = now + self.delivery_s
        if self.origin is None or arrives - self.origin > self.sent_s:  # first segment, or the viewer ran dry
            self.origin = arrives - self.sent_s
        self.sent_s += duration_s

    def observe(self, playhead_s: float, now: float) -> None:
        self.origin = now - min(max(playhead_s, 0.0), self.sent_s)

    def wait_before_next(self, now: float, lead_s: float) -> float:
        """Seconds until the playhead is within `lead_s` of the end of the sent video (0: take now)."""
        if self.origin is None:
            return 0.0
        return max(0.0, self.origin + self.sent_s - lead_s - now)


class AdaptiveLead:
    """The pacing lead of one viewer, as small as its playback allows without the player running dry.

    A stall after a block that was held back for pacing means the lead was too short for this viewer's
    delivery path (muxing, HLS fetch, a busy browser): the lead grows by `lead_up_s`. A stall after a block
    that started at once is the model's (it made the block slower than it plays) and a longer lead would
    not have helped: nothing changes. Each `lead_calm_blocks` blocks in a row without a stall take
    `lead_down_s` back, so the lead finds the least that plays smoothly and follows the machine's load."""

    def __init__(self, config: LeadBounds) -> None:
        self.config = config
        self.lead_s = config.lead_s
        self._calm = 0

    def after_block(self, stalled: bool, held_back: bool) -> float:
        cfg = self.config
        if stalled:
            self._calm = 0
            if held_back:
                # Never above lead_max_s, nor below where it started (a configured lead_s may exceed the bound).
                self.lead_s = min(max(self.lead_s, cfg.lead_max_s), self.lead_s + cfg.lead_up_s)
        else:
            self._calm += 1
            if self._calm >= cfg.lead_calm_blocks:
                self._calm = 0
                self.lead_s = max(min(self.lead_s, cfg.lead_min_s), self.lead_s - cfg.lead_down_s)
        return self.lead_s
