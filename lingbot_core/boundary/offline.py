"""An offline video's request, parsed once for every surface (the page's Offline tab, the command, the API).

An action script (JSONL: one event a block) or a camera trajectory (poses.npy + intrinsics.npy, one pose a
video frame) becomes a `RenderRequest`: the start (picture fitted, prompt cleaned), one `BlockControl` a
block and, for a trajectory, its first pose. Everything is counted and bounded before it is read whole,
and every line is checked before the first block runs: a script of a million lines is refused at line
`max_blocks + 1`, a trajectory file of a million frames is cut to the frames `max_blocks` blocks use before
its values are checked, and a bad prompt on the last line is refused before any block is made.

A trajectory is cut as upstream cuts it: N blocks use its first 12N - 3 frames; without a block count the
video is the whole blocks the file covers (rounding down, then at most `max_blocks`). The request's note
says how many frames were used and dropped.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from lingbot_core.config import ModelConfig
from lingbot_core.boundary.events import (EventError, KeyStateEvent, MAX_EVENT_LINE_BYTES, MotionEvent, PoseEvent,
                                          PromptEvent, ScriptEvent, read_events)
from lingbot_core.model import camera
from lingbot_core.boundary.requests import StartRequest, parse_start
from lingbot_core.boundary.requests import BlockControl
from lingbot_core.boundary.user_text import quote
from lingbot_core.boundary.video import H264Writer, frames_to_uint8


@dataclass(frozen=True)
class RenderRequest:
    """One offline video, parsed at the boundary (the command line, the app's offline tab)."""

    start: StartRequest
    controls: tuple[BlockControl, ...]  # one a block: key sets from a script, or a trajectory's poses
    start_camera: camera.CameraState | None = None  # a trajectory's first pose (None: the key integrator's start)
    note: str = ""  # what the request took from its input, in words (a trajectory's frames used and dropped)


def controls_from_events(events: list, config: ModelConfig) -> list[BlockControl]:
    """A script event is one block; a key-state event holds its keys for one whole block; a pose script gives one
    block's poses, read as a live session reads them (key-input intrinsics, translations in key steps). A camera
    motion is live input only (it acts on the pose where a block begins): a replay records its poses."""
    frames_per_block = config.transformer.num_frames_per_block
    controls = []
    for event in events:
        if isinstance(event, ScriptEvent):
            controls.append(BlockControl(actions=event.frames, prompt=event.prompt))
        elif isinstance(event, KeyStateEvent):
            controls.append(BlockControl(actions=(event.keys,) * frames_per_block, prompt=event.prompt))
        elif isinstance(event, PromptEvent):  # a block with no keys, from which the new text holds
            controls.append(BlockControl(actions=(frozenset(),) * frames_per_block, prompt=event.prompt))
        elif isinstance(event, PoseEvent):
            intrinsics = camera.reference_intrinsics(config.camera, frames_per_block, config.width, config.height)
            controls.append(BlockControl(poses=np.array(event.poses), intrinsics=intrinsics,
                                         translation_scale=config.camera.move_step, prompt=event.prompt))
        elif isinstance(event, MotionEvent):
            raise EventError(f"event {event.event_id}: a camera motion is live input; a script gives each block's "
                             "keys ('frames') or poses ('poses')")
    return controls


def plan_trajectory(poses: np.ndarray, intrinsics: np.ndarray, config: ModelConfig,
                    num_blocks: int | None = None) -> camera.TrajectoryPlan:
    """A video-rate trajectory truncated to the blocks it drives and normalised over all of them (as upstream)."""
    return camera.plan_trajectory(poses, intrinsics, config.transformer.num_frames_per_block,
                                  config.vae_temporal_factor, num_blocks)


def trajectory_controls(plan: camera.TrajectoryPlan) -> list[BlockControl]:
    """One control per block; every block carries the whole trajectory's scale, so streamed == one-shot."""
    return [BlockControl(poses=block.poses, intrinsics=block.intrinsics, translation_scale=plan.translation_scale)
            for block in plan.blocks]


def describe_plan(plan: camera.TrajectoryPlan, file_frames: int | None = None) -> str:
    """What the video takes from the trajectory file, in words."""
    total = file_frames if file_frames is not None else plan.frames_used + plan.frames_dropped
    return (f"trajectory: {plan.frames_used} of its {total} frames used for {len(plan.blocks)} blocks, "
            f"{total - plan.frames_used} dropped")


def read_script(text: str | None, path: str | os.PathLike | None, config: ModelConfig,
                max_blocks: int | None) -> list[BlockControl]:
    """An action script's controls, from its text or its file; counted and bounded before it is parsed whole."""
    frames_per_block = config.transformer.num_frames_per_block
    limit = None if max_blocks is None else max_blocks * (MAX_EVENT_LINE_BYTES + 2)  # a line, its ending
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise EventError(f"no events file {quote(path.name)}")
        size = path.stat().st_size
        if limit is not None and size > limit:
            raise EventError(f"the events file is {size} bytes; {max_blocks} blocks take at most {limit}")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise EventError(f"{quote(path.name)} is not UTF-8 text") from None
    if limit is not None and len(text) > limit:
        raise EventError(f"the action script is {len(text)} characters; {max_blocks} blocks take at most {limit}")
    events = read_events(text, frames_per_block, config.text.max_prompt_chars, max_events=max_blocks)
    if not events:
        raise EventError("the action script holds no events")
    return controls_from_events(events, config)


def read_trajectory(poses_path, intrinsics_path, trusted_root, config: ModelConfig,
                    max_blocks: int | None, num_blocks: int | None = None
                    ) -> tuple[list[BlockControl], camera.CameraState, str]:
    """A trajectory file pair's controls, its first pose and a note of the frames used; only the frames the
    video uses (at most `max_blocks` blocks, or `num_blocks`) are checked and resampled."""
    fpb, factor = config.transformer.num_frames_per_block, config.vae_temporal_factor
    if num_blocks is not None and max_blocks is not None and num_blocks > max_blocks:
        raise camera.TrajectoryError(f"{num_blocks} blocks asked; this server makes at most {max_blocks} a request")
    cap = num_blocks if num_blocks is not None else max_blocks
    max_frames = None if cap is None else cap * fpb * factor - (factor - 1)
    poses, intrinsics, file_frames = camera.read_trajectory(poses_path, intrinsics_path, trusted_root,
                                                            config.camera, max_frames)
    if num_blocks is None and cap is not None:  # the whole blocks the file covers, at most the cap
        whole = ((file_frames - 1) // factor + 1) // fpb
        num_blocks = min(whole, cap) if whole >= 1 else None
    plan = plan_trajectory(poses, intrinsics, config, num_blocks)
    return trajectory_controls(plan), camera.CameraState(poses[0]), describe_plan(plan, file_frames)


def parse_render(config: ModelConfig, image, prompt, seed, *, script_text: str | None = None,
                 script_path=None, poses_path=None, intrinsics_path=None, trusted_root=None,
                 max_blocks: int | None = None, num_blocks: int | None = None) -> RenderRequest:
    """The one parse of an offline request: a script (text or file) or a trajectory (both files), checked whole
    before any block runs. `max_blocks`: the most this server makes (None: no bound, the command's);
    `num_blocks`: a trajectory's requested length. Bad input raises a ValueError naming the problem."""
    has_script = script_path is not None or bool(script_text and script_text.strip())
    has_trajectory = poses_path is not None or intrinsics_path is not None
    if has_script == has_trajectory:
        raise ValueError("give one of: an action script (text or .jsonl file), or a poses.npy + intrinsics.npy pair")
    if num_blocks is not None and (has_script or num_blocks < 1):
        raise ValueError("a block count needs a trajectory and must be at least 1 (a script sets one block an event)")
    # The controls first (bounded, cheap), the picture's decode (the costly check) last.
    if has_script:
        controls, start_camera, note = read_script(script_text, script_path, config, max_blocks), None, ""
    elif poses_path is None or intrinsics_path is None:
        raise ValueError("a trajectory needs both poses.npy and intrinsics.npy")
    else:
        controls, start_camera, note = read_trajectory(poses_path, intrinsics_path, trusted_root, config,
                                                       max_blocks, num_blocks)
    return RenderRequest(parse_start(image, prompt, seed, config), tuple(controls), start_camera, note)


# ---------------------------------------------------------------------------------------------
# The render (the command's; a server shares its model with live worlds: serving/engine.py)


def render(pipeline, request: RenderRequest, out_path: Path, latents_out: Path | None = None) -> int:
    """The rollout of `request` encoded into an MP4 as it is made. Returns the number of blocks."""
    outputs = pipeline.rollout_request(request.start, request.controls, start_camera=request.start_camera)
    return write_rollout(outputs, out_path, pipeline.config, latents_out)


def write_rollout(outputs: Iterator, out_path: Path, config: ModelConfig, latents_out: Path | None = None) -> int:
    """Stream block outputs into an MP4; returns the number of blocks written."""
    writer = H264Writer(out_path, width=config.width, height=config.height, fps=config.fps)
    latents, blocks, finished = [], 0, False
    try:
        for output in outputs:
            writer.write(frames_to_uint8(output.frames))
            if latents_out is not None:
                latents.append(output.latents.float().cpu())
            blocks += 1
            print(f"block {output.block_index}: " + ", ".join(f"{k} {v:.0f} ms" for k, v in output.stage_ms.items()),
                  file=sys.stderr)
        finished = True
    finally:
        writer.close()
        if not finished:  # a failed run (a block that raised) leaves no truncated video behind
            out_path.unlink(missing_ok=True)
    if latents_out is not None:
        torch.save(torch.cat(latents, dim=2), latents_out)
    return blocks
