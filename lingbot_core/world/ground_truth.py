"""Ground truth beside a live stream: the true scene along the camera path each block was generated on.

For a session started from a world's start picture (lingbot_core/world/examples.py), each block the
engine sends carries its camera path (`Block.poses`, one pose per latent frame, and
`start_pose`, the pose before the block). The decoded block shows pixel frames; they map to latent
poses as in `trajectory.py`: pixel frame 4k is latent pose k and the three frames before it are
interpolated from latent pose k-1. So block 0 (latent frames 0..2) is 9 pixel frames starting at
its first pose, and block b >= 1 is 12 pixel frames interpolated from `start_pose` (the previous
block's last pose) through its three poses. Concatenated, the blocks' frames are exactly
`key_path(all actions).pixel_poses` rendered whole.

Rendering 12 frames costs about half a second of one core, while the model holds the others. It runs
in a separate worker process limited to one thread (torch's thread count is process-wide: a thread of
the app cannot run on fewer threads than the model without changing them for the model too; two
thread teams on 2 cores made a render 10x slower). One render at a time: a block that arrives while
the worker is busy gets no ground truth ("skipped: busy") rather than stalling the stream.

    GroundTruthRenderer   the worker process, owned by the app, shared by its streams
    GroundTruthView       one stream's ground truth: submit each block, collect comparisons
    beside                a stream's updates merged with its ground truth as each render finishes
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator

import numpy as np

from lingbot_core.config import ModelConfig
from lingbot_core.model import camera
from lingbot_core.world.render import SUPERSAMPLE
from lingbot_core.world.trajectory import pixel_poses

_ROOT = Path(__file__).resolve().parents[2]  # the repository root, on the worker's import path
_WORLDS_KEPT = 4  # the worker keeps the last few worlds built (each stream asks for one world)


def block_pixel_poses(start_pose: np.ndarray, latent_poses: np.ndarray, block_index: int,
                      temporal_factor: int) -> np.ndarray:
    """Pixel-frame poses of one decoded block: [9, 4, 4] for block 0, [12, 4, 4] after (factor 4, 3 latents)."""
    latent_poses = np.asarray(latent_poses, dtype=np.float64)
    if block_index == 0:  # pixel frame 0 is latent frame 0 alone (the causal VAE's first frame)
        return pixel_poses(latent_poses, temporal_factor)
    chain = np.concatenate([np.asarray(start_pose, dtype=np.float64)[None], latent_poses])
    return pixel_poses(chain, temporal_factor)[1:]  # frame 0 of the chain belongs to the previous block


def block_intrinsics(config: ModelConfig) -> np.ndarray:
    """Key-input intrinsics (fx, fy, cx, cy) in pixels of the model's frame: what the stream's blocks use."""
    return np.array(camera.intrinsics_for(config.camera, config.width, config.height))


def psnr(generated: np.ndarray, truth: np.ndarray) -> float:
    """PSNR in dB of two uint8 videos of one shape (inf when identical)."""
    if generated.shape != truth.shape:
        raise ValueError(f"cannot compare frames of shape {generated.shape} with {truth.shape}")
    mse = float(np.mean((generated.astype(np.float64) - truth.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10.0 * np.log10(255.0**2 / mse)


# ---------------------------------------------------------------------------------------------
# The worker process


class GroundTruthRenderer:
    """A one-thread render process, started on first use (importing torch there takes a second or two).

    `submit` returns a Future of the frames [T, H, W, 3] uint8, or None when a ground-truth render is
    already running (the caller skips that block); `render` waits its turn (start pictures). Requests
    are answered in order by one thread of this process. A worker that dies is started again by the
    next request.
    """

    def __init__(self, supersample: int = SUPERSAMPLE) -> None:
        self.supersample = supersample
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None
        self._running: Future | None = None
        self._closed = False
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ground-truth")

    def _ensure_process_locked(self) -> subprocess.Popen:
        if self._closed:
            raise RuntimeError("the ground-truth renderer is closed")
        if self._process is None or self._process.poll() is not None:
            env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
                       PYTHONPATH=os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")])))
            self._process = subprocess.Popen([sys.executable, "-m", "lingbot_core.world.ground_truth"],
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=_ROOT)
        return self._process

    def warm(self) -> None:
        """Start the render process now (its start-up imports PyTorch: seconds), so the first true frame of a
        world started soon after does not wait for it."""
        with self._lock:
            self._ensure_process_locked()

    @property
    def busy(self) -> bool:
        running = self._running
        return running is not None and not running.done()

    def submit(self, world_seed: int, poses: np.ndarray, intrinsics: np.ndarray, width: int,
               height: int) -> Future | None:
        with self._lock:
            if self.busy or self._closed:
                return None
            process = self._ensure_process_locked()
            request = self._request(world_seed, poses, intrinsics, width, height)
            self._running = self._executor.submit(self._ask, process, request)
            return self._running

    def render(self, world_seed: int, poses: np.ndarray, intrinsics: np.ndarray, width: int,
               height: int) -> np.ndarray:
        """Frames [F, H, W, 3] uint8, waiting behind a running render (for start pictures: one frame)."""
        with self._lock:
            process = self._ensure_process_locked()
            future = self._executor.submit(self._ask, process, self._request(world_seed, poses, intrinsics, width,
                                                                             height))
        return future.result()

    def _request(self, world_seed, poses, intrinsics, width, height) -> tuple:
        return (int(world_seed), np.asarray(poses, dtype=np.float64), np.asarray(intrinsics, dtype=np.float64),
                int(width), int(height), self.supersample)

    @staticmethod
    def _ask(process: subprocess.Popen, request: tuple) -> np.ndarray:
        try:
            pickle.dump(request, process.stdin)
            process.stdin.flush()
            status, value = pickle.load(process.stdout)  # our own child's answer: trusted
        except (OSError, EOFError, pickle.UnpicklingError) as exc:
            process.kill()  # a half-written exchange cannot be resumed; the next submit starts afresh
            raise RuntimeError(f"the ground-truth worker stopped: {exc!r}") from None
        if status != "ok":
            raise RuntimeError(f"ground-truth render failed: {value}")
        return value

    def close(self) -> None:
        with self._lock:
            self._closed = True
            process, self._process = self._process, None
        self._executor.shutdown(wait=True, cancel_futures=True)  # a running exchange finishes (under a second)
        if process is not None:
            with contextlib.suppress(OSError):
                process.stdin.close()  # the worker exits at end of input
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _serve(requests, answers) -> None:
    """The worker's loop: (seed, poses, intrinsics, width, height, supersample) in, ("ok", frames) out."""
    import torch

    from lingbot_core.world.render import render, to_uint8
    from lingbot_core.world.scene import make_world

    torch.set_num_threads(1)  # this process only: the model's process keeps its threads
    worlds: dict[int, Any] = {}
    while True:
        try:
            seed, poses, intrinsics, width, height, supersample = pickle.load(requests)
        except EOFError:
            return
        try:
            if seed not in worlds:
                if len(worlds) >= _WORLDS_KEPT:
                    worlds.pop(next(iter(worlds)))
                worlds[seed] = make_world(seed)
            answer = ("ok", to_uint8(render(worlds[seed], poses, intrinsics, width, height, supersample)))
        except Exception as exc:  # a bad request is answered, and the worker serves the next one
            answer = ("error", f"{type(exc).__name__}: {exc}")
        pickle.dump(answer, answers)
        answers.flush()


# ---------------------------------------------------------------------------------------------
# One stream's ground truth


@dataclass(frozen=True)
class Comparison:
    """The ground truth of one generated block."""

    block_index: int
    truth: np.ndarray | None  # [T, H, W, 3] uint8; None when it could not be rendered (`error` says why)
    psnr_db: float | None
    error: str | None = None

    def describe(self) -> str:
        if self.error is not None:
            return f"ground truth of block {self.block_index} failed: {self.error}"
        return f"ground truth PSNR {self.psnr_db:.1f} dB (block {self.block_index})"


class GroundTruthView:
    """The ground truth of one stream of world `world_seed`: each block is submitted as it arrives.

    `switch_world(seed)` (a reset in the same stream to another picture; None: not a world) applies from
    the next block 0 on. `submit` and `take` belong to the stream's loop; `switch_world` may come from
    another thread (it only sets one attribute).
    """

    def __init__(self, renderer: GroundTruthRenderer, config: ModelConfig, world_seed: int | None) -> None:
        self.renderer, self.config = renderer, config
        self.world_seed = world_seed
        self._next_world: tuple[int | None] | None = None
        self.pending: tuple[Any, Future] | None = None  # (block, its render)
        self.skipped = 0

    def switch_world(self, world_seed: int | None) -> None:
        self._next_world = (world_seed,)

    def submit(self, block) -> str:
        """Start the ground truth of `block` (an engine Block); returns a note for the telemetry line, or ''."""
        if block.block_index == 0 and self._next_world is not None:
            (self.world_seed,), self._next_world = self._next_world, None
            self.pending = None  # the old world's last truth would show after the new world began: dropped
        if self.world_seed is None:
            return "ground truth: this picture is not a world render" if block.block_index == 0 else ""
        if block.poses is None or block.start_pose is None:
            return "ground truth skipped: the block carries no camera path"
        if self.pending is not None:  # this stream's previous block is still rendering
            self.skipped += 1
            return "ground truth skipped: busy"
        poses = block_pixel_poses(block.start_pose, block.poses, block.block_index, self.config.vae_temporal_factor)
        future = self.renderer.submit(self.world_seed, poses, block_intrinsics(self.config), self.config.width,
                                      self.config.height)
        if future is None:
            self.skipped += 1
            return "ground truth skipped: busy"
        self.pending = (block, future)
        return ""

    def take(self) -> Comparison | None:
        """The finished comparison, if the pending render is done."""
        if self.pending is None or not self.pending[1].done():
            return None
        (block, future), self.pending = self.pending, None
        try:
            truth = future.result()
        except Exception as exc:
            return Comparison(block.block_index, None, None, str(exc))
        return Comparison(block.block_index, truth, psnr(block.pixels, truth))


async def beside(updates: AsyncIterator, view: GroundTruthView) -> AsyncIterator[tuple[Any, Comparison | None]]:
    """A stream's updates merged with its ground truth, each comparison as soon as its render finishes.

    Yields (update, None) for each update, and (None, comparison) when a render finishes. The caller
    submits an update's block (`view.submit`) before asking for the next item, so the render is
    waited on together with the next update; updates are never held back for a render. The updates'
    generator is advanced in a task of its own, cancelled (which closes it) when this one is closed.
    """
    next_update: asyncio.Future | None = None
    rendering: tuple[Future, asyncio.Future] | None = None  # the view's pending render, wrapped once
    try:
        while True:
            if next_update is None:
                next_update = asyncio.ensure_future(anext(updates))
            waits = {next_update}
            if view.pending is not None:
                if rendering is None or rendering[0] is not view.pending[1]:
                    rendering = (view.pending[1], asyncio.wrap_future(view.pending[1]))
                    rendering[1].add_done_callback(_retrieve)
                waits.add(rendering[1])
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            comparison = view.take()
            if comparison is not None:
                yield None, comparison
            if next_update.done():
                done, next_update = next_update, None
                try:
                    update = done.result()
                except StopAsyncIteration:
                    break
                yield update, None
    finally:
        if next_update is not None and not next_update.done():
            next_update.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await next_update
    # The stream ended: the last block's truth is still worth showing.
    if view.pending is not None:
        last = asyncio.wrap_future(view.pending[1])
        last.add_done_callback(_retrieve)
        await asyncio.wait([last])
        comparison = view.take()
        if comparison is not None:
            yield None, comparison


def _retrieve(future: asyncio.Future) -> None:
    """Mark a wrapped render's exception as seen: `GroundTruthView.take` reports it."""
    if not future.cancelled():
        future.exception()


# The renderer runs below the world's priority: on a CPU it shares the cores with the model thread, and a late
# true frame only says "ground truth skipped: busy", where a late model block stalls the world. SCHED_IDLE (Linux)
# runs it only on CPU time nothing else wants; where that is not to be had, the lowest niceness. At niceness 10
# the renderer still took about a tenth of a busy core from the model: a key's latency grew by 16% on 2 cores.
RENDER_NICENESS = 19


def _run_below_the_world() -> None:
    with contextlib.suppress(OSError, AttributeError):  # not on Linux, or not the process's to change
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return
    with contextlib.suppress(OSError, AttributeError):  # not where niceness is not the process's to lower
        os.nice(RENDER_NICENESS)


if __name__ == "__main__":
    _run_below_the_world()
    _serve(sys.stdin.buffer, sys.stdout.buffer)
