"""Drive one realtime session through the serving engine, event by event, and keep everything it makes.

    python examples/realtime.py --image examples/forest.png --prompt "a forest path" \
        --events examples/walk.jsonl --output-dir out/ [--seed 0] [--model embedded]

Each event is posted at a block boundary and applies to the next block, exactly as a browser's key
presses reach a served session. For every block the script saves its clean latents
(`block_00000_latents.pt`, [1, z, F, h, w]) and its frames (`block_00000_frames.npy`, [T, H, W, 3]
uint8), appends the frames to `rollout.mp4`, and at the end writes the session's replay
(`replay.json`) plus the action script that reproduces it offline (`replay.jsonl`):

    python -m lingbot_core.generate --image IMG --prompt TEXT --seed N --events out/replay.jsonl ...

Frames are written as they arrive, so any number of events runs in flat memory.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lingbot_core.boundary.events import EventError, read_events_file  # noqa: E402
from lingbot_core.process.precision import AUTO, DTYPE_CHOICES  # noqa: E402
from lingbot_core.boundary.requests import parse_start  # noqa: E402
from lingbot_core.serving.contract import Admission, Block, EngineConfig
from lingbot_core.serving.engine import Engine, NewWorld  # noqa: E402
from lingbot_core.boundary.video import H264Writer  # noqa: E402

def run(pipeline, image, prompt: str, seed: int, events: list, output_dir: Path, log=print) -> Engine:
    """Play `events` through a fresh engine; returns the (shut down) engine for inspection."""
    output_dir.mkdir(parents=True, exist_ok=True)
    config = pipeline.config
    # The script plays the worker itself (run_once), so each event meets exactly the block it is meant for.
    engine = Engine(pipeline, EngineConfig(max_sessions=1), start_worker=False)
    try:
        ticket = engine.admit(parse_start(image, prompt, seed, config))  # parsed once, here at the boundary
        if ticket.admission is not Admission.ADMITTED:
            raise RuntimeError("the engine has no room for one session")
        session_id = ticket.session_id
        writer = H264Writer(output_dir / "rollout.mp4", width=config.width, height=config.height, fps=config.fps)
        try:
            for event in events:
                engine.post_event(session_id, event)
                engine.run_once()
                message = engine.next_message(session_id, timeout=0)
                if isinstance(message, NewWorld):  # first in the outbox; the replay is saved from the engine below
                    message = engine.next_message(session_id, timeout=0)
                if not isinstance(message, Block):
                    raise RuntimeError(str(message) if message is not None else "no block was produced")
                frames = message.pixels
                stem = output_dir / f"block_{message.block_index:05d}"
                torch.save(message.latents, f"{stem}_latents.pt")
                np.save(f"{stem}_frames.npy", frames)
                writer.write(frames)
                timings = ", ".join(f"{name} {ms:.0f} ms" for name, ms in message.stage_ms.items())
                log(f"block {message.block_index} (event {event.event_id}): {message.block_ms:.0f} ms ({timings})")
        finally:
            writer.close()
        replay = engine.replay(session_id)
        (output_dir / "replay.json").write_text(replay.to_json())
        (output_dir / "replay.jsonl").write_text(replay.to_events_jsonl())
    finally:
        engine.shutdown()
    return engine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--image", required=True)
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--events", required=True, help="JSONL: one script or held-key event per line")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="embedded", help="embedded, a local diffusers folder, or a Hub id")
    parser.add_argument("--allow-download", action="store_true")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default=AUTO)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)

    from lingbot_core.blocks.pipeline import load_pipeline

    try:
        pipeline = load_pipeline(args.model, dtype=args.dtype, device=args.device,
                                 allow_download=args.allow_download)
        print(f"precision: {pipeline.precision.describe()}", file=sys.stderr)
        events = read_events_file(args.events, pipeline.config.transformer.num_frames_per_block)
        if not events:
            parser.error("the events file holds no events")
        output_dir = Path(args.output_dir)
        run(pipeline, args.image, args.prompt, args.seed, events, output_dir)
    except (ValueError, EventError) as exc:  # every input error is a ValueError subclass with a readable message
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {len(events)} blocks to {output_dir}: rollout.mp4, per-block latents and frames, replay.json; "
          f"reproduce offline with: python -m lingbot_core.generate --image {args.image} --prompt {args.prompt!r} "
          f"--seed {args.seed} --events {output_dir / 'replay.jsonl'} --dtype {pipeline.precision.name} --out OUT.mp4")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
