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
from pathlib import Path

import torch

from lingbot_core.boundary.example_folder import read_example_folder
from lingbot_core.boundary.image import load_image
from lingbot_core.boundary.offline import RenderRequest, parse_render, render
from lingbot_core.process.precision import AUTO, DTYPE_CHOICES

__all__ = ["RenderRequest", "main", "render"]


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
                        help="torch.compile the transformer blocks and the VAE decode step (default: on CUDA; on a CPU "
                             "only for a model measured to pay there, none so far, so eager; --compile builds the "
                             "graphs before the first block, seconds with a warm inductor cache, minutes cold: "
                             "LINGBOT_WARM_COMPILE=1 bash setup.sh builds them ahead; --no-compile: eager)")
    parser.add_argument("--latents-out", help="also save the clean latents [1, z, F, h, w] (torch.save)")
    args = parser.parse_args(argv)

    from lingbot_core.blocks.pipeline import load_pipeline  # heavy imports after argument errors
    from lingbot_core.process.allocator import keep_freed_memory
    from lingbot_core.process.startup import StartupLog

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
        root = None
        if poses_path is not None:
            poses_path, intrinsics_path = Path(poses_path).absolute(), Path(intrinsics_path).absolute()
            # The files are trusted where the user pointed: their common folder is the root they must stay under.
            root = Path(os.path.commonpath([str(poses_path.parent), str(intrinsics_path.parent)]))
        log = StartupLog()
        log.note(f"starting: torch {torch.__version__}, {torch.get_num_threads()} threads, "
                 f"CPU capability {torch.backends.cpu.get_cpu_capability()}; {keep_freed_memory()}")
        pipe = load_pipeline(args.model, dtype=args.dtype, device=args.device, compile=args.compile,
                             allow_download=args.allow_download, height=args.height, width=args.width, log=log)
        # The one offline parse (lingbot_core/boundary/offline.py), as the app's Offline tab parses: no bound on length.
        request = parse_render(pipe.config, image, prompt, args.seed, script_path=args.events,
                               poses_path=poses_path, intrinsics_path=intrinsics_path, trusted_root=root,
                               num_blocks=args.blocks)
        if request.note:
            print(request.note)
        blocks = render(pipe, request, Path(args.out), Path(args.latents_out) if args.latents_out else None)
    except ValueError as exc:  # every input error is a ValueError subclass with a readable message
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {blocks} blocks, {pipe.config.pixel_frames_for_blocks(blocks)} frames at "
          f"{pipe.config.fps} FPS")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
