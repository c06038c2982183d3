"""How far a decoder can get on a VAE's latents: single-frame probes behind the README's "Where the VAE's
blur comes from".

    python benchmarks/vae_capacity.py shipped-decoder --steps 823 --lr 3e-4   # the shipped decoder, trained on
    python benchmarks/vae_capacity.py patched-decoder --base 24 --steps 2500  # a fresh patched decoder, shipped latents
    python benchmarks/vae_capacity.py patched-vae --base 24 --steps 1200      # a patched VAE, encoder trained too

Frames, not clips: every 8th frame of the first 240 stored clips of --train-dir (python -m training.data) to
train, and 24 frames of the first 8 clips of --test-dir to test, each encoded alone as a session encodes its
start picture (the causal VAE's first-frame path). Batches of 4 frames, AdamW, MSE, seeded; prints the test
PSNR every 100 steps. The first two keep the shipped encoder frozen, so they ask whether a better decoder
alone would sharpen what users see; the third, whether a new encoder would. A measurement for the model
card; it changes no model.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from diffusers import AutoencoderKLWan
from diffusers.models.autoencoders.autoencoder_kl_wan import patchify

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lingbot_core.config import PRESETS, WAN21_VAE, patched_vae  # noqa: E402
from training.vae import decode_unclamped  # noqa: E402

from bench_render import cpu_kind  # noqa: E402

SHIPPED = Path(__file__).resolve().parents[1] / "lingbot_core" / "embedded_model" / "vae"
DATA = Path.home() / ".cache" / "lingbot" / "data"


def frames(folder: str, clips: int, every: int) -> torch.Tensor:
    """[N, 3, 1, H, W] in [-1, 1]: every `every`-th frame of the first `clips` stored clips."""
    paths = sorted(glob.glob(os.path.join(folder, "clip_*.npz")))[:clips]
    if not paths:
        raise SystemExit(f"no stored clips in {folder}: python -m training.data --out {folder} ...")
    video = torch.cat([torch.from_numpy(np.load(p)["video"][::every]).permute(0, 3, 1, 2) for p in paths])
    return (video.float() / 127.5 - 1.0).unsqueeze(2)


def patched(base: int) -> AutoencoderKLWan:
    z = PRESETS["embedded"].vae["z_dim"]
    torch.manual_seed(0)
    return AutoencoderKLWan(**patched_vae(dict(WAN21_VAE, base_dim=base, decoder_base_dim=base, z_dim=z,
                                               latents_mean=[0.0] * z, latents_std=[1.0] * z)))


def psnr(reconstruction: torch.Tensor, target: torch.Tensor) -> float:
    mse = (reconstruction.clamp(-1, 1) - target).square().mean(dim=(1, 2, 3, 4))
    return (10 * torch.log10(4.0 / mse)).mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("shipped-decoder", "patched-decoder", "patched-vae"))
    parser.add_argument("--base", type=int, default=24, help="base width of the patched VAE")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--train-dir", default=str(DATA / "w96"))
    parser.add_argument("--test-dir", default=str(DATA / "w96h"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    shipped = AutoencoderKLWan.from_pretrained(SHIPPED).float().eval()
    joint = args.mode == "patched-vae"
    model = shipped if args.mode == "shipped-decoder" else patched(args.base)
    encoder = model if joint else shipped
    shipped.requires_grad_(False)
    trained = list(model.parameters()) if joint else [*model.decoder.parameters(), *model.post_quant_conv.parameters()]
    for parameter in trained:
        parameter.requires_grad_(True)

    def encode(x: torch.Tensor) -> torch.Tensor:  # posterior means, as a session's latents are
        h = encoder.encoder(patchify(x, encoder.config.patch_size or 1), feat_cache=[None] * 256, feat_idx=[0])
        return encoder.quant_conv(h)[:, : encoder.config.z_dim]

    train, test = frames(args.train_dir, 240, 8), frames(args.test_dir, 8, 8)[::3][:24]
    with torch.no_grad():
        test_latents = None if joint else encode(test)

    def test_psnr() -> float:
        with torch.no_grad():
            return psnr(decode_unclamped(model, encode(test) if joint else test_latents), test)

    optimizer = torch.optim.AdamW(trained, lr=args.lr, weight_decay=0)
    generator = torch.Generator().manual_seed(0)
    print(f"{args.mode}: decoder {sum(p.numel() for p in model.decoder.parameters()) / 1e6:.2f} M parameters, "
          f"{len(train)} train and {len(test)} test frames; test {test_psnr():.2f} dB at step 0", flush=True)
    began = time.perf_counter()
    for step in range(1, args.steps + 1):
        x = train[torch.randint(len(train), (4,), generator=generator)]
        if joint:
            mean = encode(x)
            loss = (decode_unclamped(model, mean) - x).square().mean() + 1e-4 * mean.square().mean()
        else:
            with torch.no_grad():
                latents = encode(x)
            loss = (decode_unclamped(model, latents) - x).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 100 == 0 or step == args.steps:
            print(f"step {step} ({time.perf_counter() - began:.0f} s): test {test_psnr():.2f} dB", flush=True)
    print(f"CPU: {cpu_kind()}; fp32, {args.threads} thread(s)")


if __name__ == "__main__":
    main()
