"""How the embedded preset's block time (fp32, eager) scales with resolution and model width.

    python benchmarks/bench_block_scaling.py [--variants 128x224:4x64:4:1024:8 96x160:4x64:4:1024:8 ...]
                                             [--warmup 6] [--blocks 4] [--threads 2]

A variant is HEIGHTxWIDTH (multiples of 32):HEADSxHEAD_DIM:LAYERS:FFN:DECODER_BASE (the VAE decoder's base width; the
encoder keeps the preset's). Each variant is the embedded preset with those fields replaced and
seeded random weights (speed does not depend on the weights), rolled out from a rendered held-out
world holding W, with the condition stream cached as the engine does. Blocks before --warmup are excluded: the KV window is still filling (sink + window
= 6 blocks at the preset's 9 / 18 frames). Prints, per variant, tokens per latent frame, transformer
parameters, and the median ms per block with its split (condition, 4 denoise forwards, commit,
decode) and the range, then the CPU kind and load average (the machine is shared: read figures of
one run together, not across runs).

This is a measurement for choosing the trained preset (issue 11: a whole block <= 750 ms on 2
AVX2 cores, fp32, eager); it changes no preset.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lingbot_core.blocks.condition_cache import ConditionCache  # noqa: E402
from lingbot_core.config import PRESETS  # noqa: E402
from lingbot_core.blocks.loading import build_seeded_parts  # noqa: E402
from lingbot_core.blocks.pipeline import Pipeline  # noqa: E402
from lingbot_core.boundary.requests import BlockControl  # noqa: E402
from lingbot_core.world import HELD_OUT_SEEDS, key_path, make_world, render, to_uint8  # noqa: E402

from bench_render import cpu_kind  # noqa: E402

STAGES = ("condition", "denoise", "commit", "decode")
DEFAULT_VARIANTS = ["128x224:4x64:4:1024:8", "96x160:4x64:4:1024:8", "96x160:6x64:4:1536:8",
                    "96x160:4x64:6:1024:8", "64x128:4x64:4:1024:8", "96x160:4x64:4:1024:16"]


def variant_config(spec: str):
    size, heads, layers, ffn, decoder = spec.split(":")
    height, width = (int(v) for v in size.lower().split("x"))
    num_heads, head_dim = (int(v) for v in heads.lower().split("x"))
    base = PRESETS["embedded"]
    transformer = dataclasses.replace(base.transformer, num_attention_heads=num_heads, attention_head_dim=head_dim,
                                      num_layers=int(layers), ffn_dim=int(ffn))
    return dataclasses.replace(base, name=f"embedded-{spec}", transformer=transformer, height=height, width=width,
                               vae=dict(base.vae, decoder_base_dim=int(decoder)))


def measure(spec: str, warmup: int, blocks: int) -> dict:
    config = variant_config(spec)
    pipe = Pipeline.from_parts(build_seeded_parts(config, seed=0, dtype=torch.float32))
    world = make_world(HELD_OUT_SEEDS.start)
    start = key_path([frozenset()], config)
    image = to_uint8(render(world, start.pixel_poses[:1], start.intrinsics, config.width, config.height))[0]
    fpb = config.transformer.num_frames_per_block
    controls = [BlockControl(actions=(frozenset("w"),) * fpb)] * (warmup + blocks)
    rows = []
    started = time.perf_counter()
    # As the engine does: the picture's condition stream through a cache (it stops encoding once the
    # stream of zero frames reaches its fixed point).
    conditions = ConditionCache(max_bytes=1 << 30)
    for output in pipe.rollout(image, "a walk through a procedural world", 0, controls, conditions=conditions):
        now = time.perf_counter()
        if output.block_index >= warmup:
            rows.append(dict(output.stage_ms, total=1000 * (now - started)))
        started = now
    params = sum(p.numel() for p in pipe.transformer.parameters())
    return {"spec": spec, "tokens": config.tokens_per_frame, "params": params,
            **{k: statistics.median(r[k] for r in rows) for k in (*STAGES, "total")},
            "low": min(r["total"] for r in rows), "high": max(r["total"] for r in rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS)
    parser.add_argument("--warmup", type=int, default=6)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{'variant HxW:heads:layers:ffn:dec':>34} {'tokens':>6} {'params':>7} {'block ms':>8} "
          f"{'range':>11} {'cond':>5} {'denoise':>7} {'commit':>6} {'decode':>6}")
    for spec in args.variants:
        r = measure(spec, args.warmup, args.blocks)
        print(f"{r['spec']:>34} {r['tokens']:>6} {r['params'] / 1e6:>6.1f}M {r['total']:>8.0f} "
              f"{r['low']:>5.0f}-{r['high']:<5.0f} {r['condition']:>5.0f} {r['denoise']:>7.0f} {r['commit']:>6.0f} "
              f"{r['decode']:>6.0f}", flush=True)
    print(f"CPU: {cpu_kind()}; fp32 eager, {args.threads} threads; median of blocks {args.warmup}.."
          f"{args.warmup + args.blocks - 1}; load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
