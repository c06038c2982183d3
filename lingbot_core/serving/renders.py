"""Offline renders on a serving engine: a line of requests that share the model with live worlds block by block.

A render used to run whole as one model-thread job, so a 64-block request stopped every live world for
half a minute. Now each render is a rollout advanced one block at a time by the engine's worker, below the
live worlds' priority: a render block runs when no live block is due (a paced world's next start is
further away than a render block takes), or when the render has waited `max_wait_s` for one, so live
worlds wait at most one render block and a render is never starved. One render runs at a time (its
private page pool is the only memory it adds), the others wait in line and are told their place.

The requester writes the video itself, on its own thread, from the uint8 frames each block posts (at most
`lead_blocks` ahead of it), so no encoding runs on the model thread. The line is bounded in total and per
owner (a client address): a request past either bound is refused at once, with the reason.

`RenderLine` keeps no lock of its own: the engine calls it under its table lock.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from lingbot_core.boundary.offline import RenderRequest


@dataclass(frozen=True)
class RenderLimits:
    max_renders: int = 4  # renders running or waiting, in all
    max_per_owner: int = 1  # renders running or waiting per owner (a client address)
    max_wait_s: float = 2.0  # longest a waiting render block defers to live blocks
    lead_blocks: int = 2  # blocks made ahead of the requester's writing

    def __post_init__(self) -> None:
        if min(self.max_renders, self.max_per_owner, self.lead_blocks) < 1 or self.max_wait_s < 0:
            raise ValueError("max_renders, max_per_owner and lead_blocks must be at least 1, max_wait_s >= 0")


class RenderRefusedError(RuntimeError):
    """The render line is full, or its owner already has a render in it."""


@dataclass(frozen=True)
class RenderProgress:
    """Where a render stands: renders ahead of it (0: it runs) and its blocks made of all."""

    position: int
    blocks_done: int
    blocks_total: int

    def describe(self) -> str:
        if self.position:
            return f"waiting for the model: {self.position} render(s) ahead of this one"
        return f"rendering: block {self.blocks_done} of {self.blocks_total} made"


@dataclass(frozen=True)
class RenderFailed:
    text: str


@dataclass(frozen=True)
class RenderDone:
    blocks: int


class RenderJob:
    """One render in the line: its request, its rollout once started, and what its requester reads."""

    def __init__(self, request: RenderRequest, owner: str | None, now: float) -> None:
        self.request = request
        self.owner = owner
        self.total = len(request.controls)
        self.outbox: deque[Any] = deque()  # RenderProgress, np.ndarray (a block's uint8 frames), RenderFailed, RenderDone
        self.outputs: Iterator | None = None  # the rollout (model thread only)
        self.blocks_done = 0
        self.waiting_since = now  # when it last became able to run (its starvation clock)
        self.position = -1  # the last position posted
        self.ended = False

    @property
    def blocks_unread(self) -> int:
        return sum(isinstance(item, np.ndarray) for item in self.outbox)


class RenderLine:
    def __init__(self, limits: RenderLimits = RenderLimits(), clock=time.monotonic) -> None:
        self.limits = limits
        self.clock = clock
        self.jobs: deque[RenderJob] = deque()  # the first runs
        self.block_s = 0.5  # a render block's time, a running average (decides whether it fits before a live block)

    def add(self, request: RenderRequest, owner: str | None) -> RenderJob:
        limits = self.limits
        if len(self.jobs) >= limits.max_renders:
            raise RenderRefusedError(f"{len(self.jobs)} offline renders are running or waiting, the most this server "
                                     "takes; try again in a minute")
        if owner is not None and sum(job.owner == owner for job in self.jobs) >= limits.max_per_owner:
            raise RenderRefusedError("you already have an offline render running or waiting; wait for it to finish")
        job = RenderJob(request, owner, self.clock())
        self.jobs.append(job)
        self.post_positions()
        return job

    def remove(self, job: RenderJob) -> bool:
        if job not in self.jobs:
            return False
        self.jobs.remove(job)
        job.ended = True
        self.post_positions()
        return True

    def post_positions(self) -> None:
        for position, job in enumerate(self.jobs):
            if job.position != position:
                job.position = position
                job.outbox.append(RenderProgress(position, job.blocks_done, job.total))

    def runnable(self) -> RenderJob | None:
        """The first render, if its requester has room for another block."""
        if not self.jobs:
            return None
        job = self.jobs[0]
        return job if job.blocks_unread < self.limits.lead_blocks else None

    def starved(self, job: RenderJob) -> bool:
        return self.clock() - job.waiting_since >= self.limits.max_wait_s

    def ran(self, job: RenderJob, seconds: float) -> None:
        """A block of `job` was made in `seconds`."""
        self.block_s = 0.7 * self.block_s + 0.3 * seconds
        job.blocks_done += 1
        job.waiting_since = self.clock()
