"""What candidate embedded VAE sizes cost per block: streaming condition encode and streaming decode (fp32, eager).

    python benchmarks/bench_vae_sizes.py [--variants 128x224:16:8:16 96x160:16:8:16 ...] [--reps 3]
                                         [--threads 1 2] [--conv-size 64x128]

A variant is HEIGHTxWIDTH (multiples of 32):BASE_DIM:DECODER_BASE_DIM:Z_DIM of diffusers'
AutoencoderKLWan (the rest as the Wan 2.1 VAE), with seeded random weights (speed does not depend on
the weights); a fifth field `p2` makes it patched as `python -m training.vae --patch-size 2` builds it
(2x2 pixels folded into channels, one halving fewer, the same latent grid), for example
96x160:24:24:16:p2. Per variant and thread count it streams block 0 through lingbot_core/model/vae_stream.py
(fills the causal caches), then times, from those same states, the condition encode of block 1 (three
chunks of four frames) and the decode of one block's three latent frames into 12 pixel frames. Prints
the median of --reps in ms, the encoder and decoder parameters, the CPU kind and the load average (the
machine is shared: compare rows of one run, not across runs).

Then, on one thread, one causal 3x3x3 convolution as the decoder runs it (16 -> 16 channels over 2 cached
+ 1 new frame, padded, at --conv-size): batch 1, which PyTorch's CPU heuristic sends to its slow im2col
kernel (`slow_conv3d`: oneDNN only when batch x channels x frames x height > 20480 for batch 1), against
the same input as a batch of two, which goes to oneDNN, per sample. `--variants` with no value prints
only this line.

A measurement for choosing the trained embedded VAE (issue 11: a whole block <= 750 ms on 2 AVX2
cores in fp32); it changes no preset. The engine caches the condition stream and stops encoding once
it reaches its fixed point, so the encode column bounds the early blocks; decode is paid every block.
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

from lingbot_core.config import PRESETS, patched_vae  # noqa: E402
from lingbot_core.model.vae_stream import (ConditionStream, DecoderStream, build_vae, decode_block,  # noqa: E402
                                           encode_condition_block)

from bench_render import cpu_kind  # noqa: E402

DEFAULT_VARIANTS = ["128x224:16:8:16", "96x160:16:8:16", "96x160:12:8:16", "96x160:8:8:8", "64x128:16:8:16",
                    "64x128:8:8:8"]


def variant_config(spec: str):
    size, base, decoder, z, *patch = spec.split(":")
    if patch not in ([], ["p2"]):
        raise ValueError(f"variant {spec!r}: the fifth field, if any, is p2")
    height, width = (int(v) for v in size.lower().split("x"))
    z_dim = int(z)
    base_config = PRESETS["embedded"]
    vae = dict(base_config.vae, base_dim=int(base), decoder_base_dim=int(decoder), z_dim=z_dim,
               latents_mean=[0.0] * z_dim, latents_std=[1.0] * z_dim)
    if patch:
        vae = patched_vae(vae)
    transformer = dataclasses.replace(base_config.transformer, out_channels=z_dim,
                                      in_channels=2 * z_dim + base_config.transformer.mask_channels)
    return dataclasses.replace(base_config, name=f"vae-{spec}", height=height, width=width, vae=vae,
                               transformer=transformer)


def _median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - started))
    return statistics.median(times)


def measure(spec: str, threads: list[int], reps: int) -> dict:
    config = variant_config(spec)
    vae = build_vae(config, torch.float32, "cpu", seed=0)
    image = torch.rand(1, 3, config.height, config.width) * 2 - 1
    latents = torch.randn(1, config.vae["z_dim"], config.transformer.num_frames_per_block, config.latent_height,
                          config.latent_width)
    result = {"spec": spec, "enc_params": sum(p.numel() for p in vae.encoder.parameters()),
              "dec_params": sum(p.numel() for p in vae.decoder.parameters())}
    for n in threads:
        torch.set_num_threads(n)
        _, condition = encode_condition_block(vae, ConditionStream.start(image), 0, config)
        frames, decoder = decode_block(vae, DecoderStream(), latents)
        result[f"encode_{n}"] = _median_ms(lambda: encode_condition_block(vae, condition, 1, config), reps)
        result[f"decode_{n}"] = _median_ms(lambda: decode_block(vae, decoder, latents), reps)
        result["frames"] = decode_block(vae, decoder, latents)[0].shape[2]
    return result


@torch.no_grad()
def conv_paths(height: int, width: int, reps: int) -> tuple[float, float]:
    """Median ms of one padded 3x3x3 conv over 3 frames: batch 1 (slow path), and per sample of batch 2 (oneDNN)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        weight = torch.randn(16, 16, 3, 3, 3)
        one = torch.randn(1, 16, 3, height + 2, width + 2)
        two = torch.cat([one, one])
        torch.nn.functional.conv3d(one, weight), torch.nn.functional.conv3d(two, weight)  # warm-up
        slow = _median_ms(lambda: torch.nn.functional.conv3d(one, weight), reps)
        onednn = _median_ms(lambda: torch.nn.functional.conv3d(two, weight), reps) / 2
    finally:
        torch.set_num_threads(threads)
    return slow, onednn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="*", default=DEFAULT_VARIANTS)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--conv-size", default="64x128")
    args = parser.parse_args()
    columns = "".join(f" {'enc ' + str(n) + 't':>8} {'dec ' + str(n) + 't':>8}" for n in args.threads)
    print(f"{'variant HxW:base:dec:z[:p2]':>27} {'enc par':>8} {'dec par':>8}{columns}   (ms, median of {args.reps})")
    for spec in args.variants:
        r = measure(spec, args.threads, args.reps)
        cells = "".join(f" {r[f'encode_{n}']:>8.0f} {r[f'decode_{n}']:>8.0f}" for n in args.threads)
        print(f"{r['spec']:>27} {r['enc_params'] / 1e3:>7.0f}k {r['dec_params'] / 1e3:>7.0f}k{cells}", flush=True)
    height, width = (int(v) for v in args.conv_size.lower().split("x"))
    slow, onednn = conv_paths(height, width, max(args.reps, 5))
    print(f"one causal conv 16->16 ch, 3 frames, {height}x{width}, 1 thread: batch 1 (slow_conv3d) {slow:.1f} ms; "
          f"batch 2 (oneDNN) {onednn:.1f} ms per sample")
    print(f"CPU: {cpu_kind()}; fp32 eager; encode = condition block 1 (12 frames), decode = 12 frames "
          f"of block 1; load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
