"""Offline generation: an image, a prompt and an action script (or a camera trajectory) -> one MP4.

    python -m lingbot_core.generate --image IMG --prompt TEXT --events EVENTS.jsonl --out OUT.mp4
    python -m lingbot_core.generate --image IMG --prompt TEXT --poses P.npy --intrinsics K.npy --out OUT.mp4
    python -m lingbot_core.generate --action-path examples/00 --out OUT.mp4   # an official example folder

Each script event drives one block (3 latent frames, 12 video frames); N blocks give 12N - 3 frames at
16 FPS. A trajectory (one pose per video frame) is cut as upstream cuts it: --blocks N uses its first
12N - 3 frames, and without --blocks the video is the whole blocks it covers, rounding down; the
command says how many frames were used and dropped. Frames are encoded as they are made, so memory stays flat for any number of events. A checkpoint
folder runs at 480x832 unless --height/--width say otherwise. Bad input exits with code 2 and leaves no
output file behind.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from .config import ModelConfig
from .events import KeyStateEvent, ScriptEvent, read_events_file
from .example_folder import read_example_folder
from .image import load_image
from .model import camera
from .precision import AUTO, DTYPE_CHOICES
from .requests import StartRequest, parse_start
from .rollout import BlockControl
from .video import H264Writer, frames_to_uint8


def controls_from_events(events: list, frames_per_block: int) -> list[BlockControl]:
    """A script event is one block; a key-state event holds its keys for one whole block."""
    controls = []
    for event in events:
        if isinstance(event, ScriptEvent):
            controls.append(BlockControl(actions=event.frames, prompt=event.prompt))
        elif isinstance(event, KeyStateEvent):
            controls.append(BlockControl(actions=(event.keys,) * frames_per_block, prompt=event.prompt))
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


def controls_from_trajectory(poses: np.ndarray, intrinsics: np.ndarray, config: ModelConfig,
                             num_blocks: int | None = None) -> list[BlockControl]:
    return trajectory_controls(plan_trajectory(poses, intrinsics, config, num_blocks))


def describe_plan(plan: camera.TrajectoryPlan) -> str:
    """What the video takes from the trajectory file, in words."""
    total = plan.frames_used + plan.frames_dropped
    return (f"trajectory: {plan.frames_used} of its {total} frames used for {len(plan.blocks)} blocks, "
            f"{plan.frames_dropped} dropped")


@dataclass(frozen=True)
class RenderRequest:
    """One offline video, parsed at the boundary (the command line, the app's offline tab)."""

    start: StartRequest
    controls: tuple[BlockControl, ...]  # one a block: key sets from a script, or a trajectory's poses
    start_camera: camera.CameraState | None = None  # a trajectory's first pose (None: the key integrator's start)


def render(pipeline, request: RenderRequest, out_path: Path, latents_out: Path | None = None) -> int:
    """The one offline render, shared by the command and the app (which queues it on its model thread):
    the rollout of `request` encoded into an MP4 as it is made. Returns the number of blocks."""
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
        if not finished:  # a failed run (bad prompt, a block that raised) leaves no truncated video behind
            out_path.unlink(missing_ok=True)
    if latents_out is not None:
        torch.save(torch.cat(latents, dim=2), latents_out)
    return blocks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lingbot_core.generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--image", help="start image (with --action-path: default the folder's image.jpg)")
    parser.add_argument("--prompt", help="prompt text (with --action-path: default the folder's prompt.txt)")
    parser.add_argument("--events", help="JSONL action script, one event per block")
    parser.add_argument("--poses", help="poses.npy [F,4,4] camera-to-world, one per video frame")
    parser.add_argument("--intrinsics", help="intrinsics.npy [F,4] in 832x480 reference pixels")
    parser.add_argument("--action-path", help="an official LingBot-World example folder: poses.npy, intrinsics.npy, "
                                              "image.jpg, prompt.txt (as the official command's --action_path)")
    parser.add_argument("--blocks", type=int, help="with a trajectory: number of blocks, using its first 12N-3 frames "
                                                   "(default: the whole blocks it covers)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="embedded", help="embedded, a local diffusers folder, or a Hub id")
    parser.add_argument("--allow-download", action="store_true", help="fetch a Hub id with huggingface_hub")
    parser.add_argument("--height", type=int, help="output height in pixels (default: the model's, 480 for a folder)")
    parser.add_argument("--width", type=int, help="output width in pixels (default: the model's, 832 for a folder)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default=AUTO,
                        help="auto (default): bf16 on CUDA and on CPUs where it runs natively and a probe shows "
                             "it faster, else fp32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="torch.compile the transformer blocks and the VAE decode step (default: on CUDA, and "
                             "on a CPU for the embedded model: the first blocks run eager while the graphs build "
                             "in the background, seconds with a warm inductor cache, minutes cold; "
                             "LINGBOT_WARM_COMPILE=1 bash setup.sh builds them ahead; --no-compile: eager)")
    parser.add_argument("--latents-out", help="also save the clean latents [1, z, F, h, w] (torch.save)")
    args = parser.parse_args(argv)

    from .pipeline import load_pipeline  # heavy imports after argument errors
    from .allocator import keep_freed_memory
    from .startup import StartupLog

    if (args.events is not None) + (args.poses is not None) + (args.action_path is not None) != 1:
        parser.error("give exactly one of --events, --poses/--intrinsics or --action-path")
    if (args.poses is None) != (args.intrinsics is None):
        parser.error("--poses and --intrinsics go together")
    if args.blocks is not None and (args.events is not None or args.blocks < 1):
        parser.error("--blocks needs --poses or --action-path and must be at least 1 (an events file sets one "
                     "block per event)")
    if args.action_path is None and (args.image is None or args.prompt is None):
        parser.error("--image and --prompt are required (an --action-path folder can supply them)")
    try:
        image_path, prompt, poses_path, intrinsics_path = args.image, args.prompt, args.poses, args.intrinsics
        if args.action_path is not None:
            folder = read_example_folder(args.action_path)
            poses_path, intrinsics_path = folder.poses, folder.intrinsics
            image_path = image_path if image_path is not None else folder.image
            prompt = prompt if prompt is not None else folder.prompt
            if image_path is None or prompt is None:
                raise ValueError(f"{args.action_path} has no " + ("image.jpg" if image_path is None else "prompt.txt")
                                 + "; give " + ("--image" if image_path is None else "--prompt"))
        # The image is decoded and checked before the model loads and before the output file is created.
        image = load_image(image_path)
        log = StartupLog()
        log.note(f"starting: torch {torch.__version__}, {torch.get_num_threads()} threads, "
                 f"CPU capability {torch.backends.cpu.get_cpu_capability()}; {keep_freed_memory()}")
        pipe = load_pipeline(args.model, dtype=args.dtype, device=args.device, compile=args.compile,
                             allow_download=args.allow_download, height=args.height, width=args.width, log=log)
        frames_per_block = pipe.config.transformer.num_frames_per_block
        start_camera = None
        if args.events is not None:
            controls = controls_from_events(read_events_file(args.events, frames_per_block), frames_per_block)
        else:
            poses_path, intrinsics_path = Path(poses_path).absolute(), Path(intrinsics_path).absolute()
            # The files are trusted where the user pointed: their common folder is the root they must stay under.
            root = Path(os.path.commonpath([str(poses_path.parent), str(intrinsics_path.parent)]))
            poses, intrinsics = camera.load_trajectory(poses_path, intrinsics_path, trusted_root=root,
                                                       cfg=pipe.config.camera)
            plan = plan_trajectory(poses, intrinsics, pipe.config, args.blocks)
            print(describe_plan(plan))
            controls = trajectory_controls(plan)
            start_camera = camera.CameraState(poses[0])
        if not controls:
            parser.error("the events file holds no events")
        request = RenderRequest(parse_start(image, prompt, args.seed, pipe.config), tuple(controls), start_camera)
        blocks = render(pipe, request, Path(args.out), Path(args.latents_out) if args.latents_out else None)
    except ValueError as exc:  # every input error is a ValueError subclass with a readable message
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {blocks} blocks, {pipe.config.pixel_frames_for_blocks(blocks)} frames at "
          f"{pipe.config.fps} FPS")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
