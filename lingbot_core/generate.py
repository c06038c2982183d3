"""Offline generation: an image, a prompt and an action script (or a camera trajectory) -> one MP4.

    python -m lingbot_core.generate --image IMG --prompt TEXT --events EVENTS.jsonl --out OUT.mp4
    python -m lingbot_core.generate --image IMG --prompt TEXT --poses P.npy --intrinsics K.npy --out OUT.mp4

Each script event drives one block (3 latent frames, 12 video frames); N blocks give 12N - 3 frames at
16 FPS. Frames are encoded as they are made, so memory stays flat for any number of events. A checkpoint
folder runs at 480x832 unless --height/--width say otherwise. Bad input exits with code 2 and leaves no
output file behind.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from .config import ModelConfig
from .events import KeyStateEvent, ScriptEvent, read_events_file
from .image import load_image
from .model import camera
from .precision import AUTO, DTYPE_CHOICES
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


def controls_from_trajectory(poses: np.ndarray, intrinsics: np.ndarray, config: ModelConfig,
                             num_blocks: int | None = None) -> list[BlockControl]:
    """Split a video-rate trajectory into per-block latent-frame poses (resampled, no length cap)."""
    frames_per_block = config.transformer.num_frames_per_block
    if num_blocks is None:
        latent_frames = (len(poses) - 1) // config.vae_temporal_factor + 1
        num_blocks = max(1, math.ceil(latent_frames / frames_per_block))
    poses, intrinsics = camera.resample_trajectory(poses, intrinsics, num_blocks * frames_per_block)
    return [BlockControl(poses=poses[b * frames_per_block:(b + 1) * frames_per_block],
                         intrinsics=intrinsics[b * frames_per_block:(b + 1) * frames_per_block])
            for b in range(num_blocks)]


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
    parser.add_argument("--image", required=True)
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--events", help="JSONL action script, one event per block")
    parser.add_argument("--poses", help="poses.npy [F,4,4] camera-to-world")
    parser.add_argument("--intrinsics", help="intrinsics.npy [F,4] in 832x480 reference pixels")
    parser.add_argument("--blocks", type=int, help="with --poses: number of blocks (default: from the trajectory)")
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
                        help="torch.compile the transformer blocks and the VAE decode step (default: on CUDA only)")
    parser.add_argument("--latents-out", help="also save the clean latents [1, z, F, h, w] (torch.save)")
    args = parser.parse_args(argv)

    from .pipeline import load_pipeline  # heavy imports after argument errors
    from .startup import StartupLog

    if (args.events is None) == (args.poses is None):
        parser.error("give exactly one of --events or --poses/--intrinsics")
    if (args.poses is None) != (args.intrinsics is None):
        parser.error("--poses and --intrinsics go together")
    if args.blocks is not None and (args.poses is None or args.blocks < 1):
        parser.error("--blocks needs --poses and must be at least 1 (an events file sets one block per event)")
    try:
        # The image is checked before the model loads and before the output file is created.
        image = load_image(args.image)
        log = StartupLog()
        log.note(f"starting: torch {torch.__version__}, {torch.get_num_threads()} threads, "
                 f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
        pipe = load_pipeline(args.model, dtype=args.dtype, device=args.device, compile=args.compile,
                             allow_download=args.allow_download, height=args.height, width=args.width, log=log)
        frames_per_block = pipe.config.transformer.num_frames_per_block
        start_camera = None
        if args.events is not None:
            controls = controls_from_events(read_events_file(args.events, frames_per_block), frames_per_block)
        else:
            poses_path, intrinsics_path = Path(args.poses).absolute(), Path(args.intrinsics).absolute()
            # The files are trusted where the user pointed: their common folder is the root they must stay under.
            root = Path(os.path.commonpath([str(poses_path.parent), str(intrinsics_path.parent)]))
            poses, intrinsics = camera.load_trajectory(poses_path, intrinsics_path, trusted_root=root)
            controls = controls_from_trajectory(poses, intrinsics, pipe.config, args.blocks)
            start_camera = camera.CameraState(poses[0])
        if not controls:
            parser.error("the events file holds no events")
        blocks = write_rollout(pipe.rollout(image, args.prompt, args.seed, controls, start_camera=start_camera),
                               Path(args.out), pipe.config, Path(args.latents_out) if args.latents_out else None)
    except ValueError as exc:  # every input error is a ValueError subclass with a readable message
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {blocks} blocks, {pipe.config.pixel_frames_for_blocks(blocks)} frames at "
          f"{pipe.config.fps} FPS")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
