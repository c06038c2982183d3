"""Train the embedded preset's VAE (diffusers' AutoencoderKLWan) on rendered clips of train worlds.

    python -m training.vae --steps 20000 [--size 96x160] [--base-dim 16] [--decoder-base-dim 8] [--z-dim 16]
                           [--blocks 1] [--batch 2] [--lr 2e-4] [--lr-decay-from -1] [--lr-final 0.1]
                           [--kl-weight 1e-6] [--loss l1] [--seed 0] [--init-from RUN_OR_EXPORT] [--decoder-only]
                           [--data-seed 0] [--run-dir DIR] [--eval-every 500] [--eval-blocks 2] [--checkpoint-every 100]
                           [--workers 1] [--threads 1] [--rollouts FILE --rollout-share 0.5]
    python -m training.vae --run-dir DIR --export OUT      # OUT/vae/: fp16 safetensors, diffusers layout
    python -m training.vae --run-dir DIR_OR_OUT/vae --evaluate [--eval-clips 4] [--eval-blocks 2]  # held-out PSNR

The model is the same class and checkpoint layout as the real model's VAE, at the size given here.
Loss: a pixel reconstruction term (L1 or MSE) of a sample of the posterior, plus a small KL term
towards N(0, 1), as the Wan VAE is trained (its perceptual and adversarial terms are left out).
The decoder output is not clamped during training, so pixels that overshoot [-1, 1] still get a
gradient; inference clamps.

Reproducible and resumable: step s trains on clips s*batch .. s*batch + batch - 1 of the data seed
(training/data.py renders clip i as a pure function of (data_seed, i), from TRAIN_SEEDS only), and the
posterior noise comes from a generator seeded by --seed whose state is checkpointed. So the run
state is the model, the optimizer, the step and that generator: `RUN_DIR/last.pt` holds them (written
whole, then renamed). Starting again with the same run directory resumes from it, bit-exactly, and
refuses (with the differing settings named) when the run settings differ; --steps may grow.

Output in the run directory (default ~/.cache/lingbot/train/vae/<size>-b<base>-d<dec>-z<z>-s<seed>,
outside git so a later session on the machine can resume): last.pt, and log.jsonl with one line per
step (step, loss, rec, kl, seconds) and one per evaluation (step, psnr, psnr_image). Evaluation runs
on held-out worlds (HELD_OUT_SEEDS) through the inference path of lingbot_core/model/vae_stream.py:
`psnr` decodes the clip's latents block by block with `decode_block` (the streaming decoder and its
carried cache; the latents come from the causal encoder run once over the clip, which the streamed
encoder equals), `psnr_image` encodes the start frame as the condition stream does
(`encode_condition_block`) and decodes latent frame 0 back to it.

--export writes OUT/vae/ (config.json + diffusion_pytorch_model.safetensors, float16) as
`AutoencoderKLWan.save_pretrained` does, the folder the checkpoint loader reads (lingbot_core/blocks/loading.py),
with latents_mean / latents_std measured on --stats-clips train clips, so the transformer sees
normalised latents. A decoder-only run started from an exported folder keeps that folder's statistics
instead: its encoder is that folder's encoder, bit for bit, so a world model trained on the old export
reads the new one's latents exactly as before, and only the decoded pixels change.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, NamedTuple

import numpy as np
import torch
from diffusers import AutoencoderKLWan
from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d, unpatchify
from diffusers.utils import SAFETENSORS_WEIGHTS_NAME
from safetensors.torch import load_file
from tqdm import tqdm

from lingbot_core.config import PRESETS, ModelConfig, patched_vae
from lingbot_core.model.vae_stream import (ConditionStream, DecoderStream, build_vae, check_streamable,
                                           decode_block, decode_latent_frame, encode_condition_block)
from lingbot_core.world import HELD_OUT_SEEDS
from training.data import ClipDataset, StoredClips, make_clip
from training.runs import decayed_rate, save_atomically, trim_log

CHECKPOINT = "last.pt"
LOG = "log.jsonl"
CHECKPOINT_FORMAT = 1
EXPORT_WEIGHTS = SAFETENSORS_WEIGHTS_NAME  # the file save_pretrained writes in OUT/vae/
ROLLOUTS_FORMAT = 1  # python -m training.world --rollouts
EVAL_DATA_SEED = 0  # held-out clips i = 0 .. eval_clips - 1 of this data seed: the same clips at every evaluation


@dataclass(frozen=True)
class VaeTrainConfig:
    """Everything that defines a run; a checkpoint resumes only under the same values."""

    height: int = 96
    width: int = 160
    base_dim: int = 16
    decoder_base_dim: int | None = 8
    z_dim: int = 16
    # 2: fold 2x2 pixel patches into channels before the encoder and unfold after the decoder (diffusers'
    # patch_size, as in the Wan 2.2 VAE), with one halving fewer, so the latent grid is the same. The
    # full-resolution layers then run at half the frame size: a patched decoder of 3x the parameters
    # decodes a block in less time than the unpatched one (see the model card).
    patch_size: int = 1
    # Window length in blocks: 12 * blocks - 3 pixel frames. The causal encoder and decoder learn only the
    # frame positions a window holds, while a session streams far past them: the shipped encoder, trained
    # on 1-block windows, gives drifting latents after its 9 frames (so do the world model's targets, which
    # it encoded), and a decoder trained on 1-block windows decodes those at 13-19 dB against 23-26 dB for
    # the first block. Its last stage is therefore decoder-only on whole 6-block clips.
    blocks: int = 1
    batch: int = 2
    lr: float = 2e-4
    lr_decay_from: int = -1  # from this step on the rate falls linearly to lr * lr_final (-1: constant)
    lr_final: float = 0.1
    weight_decay: float = 0.01
    kl_weight: float = 1e-6
    loss: str = "l1"
    seed: int = 0  # initial weights and posterior noise
    data_seed: int = 0
    supersample: int = 2
    # Stored clips (python -m training.data) instead of rendering each step: clips_dir holds clips
    # 0 .. stored_clips - 1; a batch item is a random window of 12 * blocks - 3 frames of one of them,
    # cropped to crop_height x crop_width (0: the whole frame) and maybe mirrored left-right. The
    # VAE is convolutional, so crops train the same weights at a fraction of the cost.
    clips_dir: str | None = None
    stored_clips: int = 0
    crop_height: int = 0
    crop_width: int = 0
    # Second stage: start from other weights (init_from: a run folder, or an exported vae/ folder, which
    # is all a machine without the run has) and train the decoder only, on the posterior mean. The
    # encoder, and so the latent space a world model was trained on, stay exactly as they were, while the
    # decoder keeps improving (on whole frames, for example).
    init_from: str | None = None
    decoder_only: bool = False
    # "sample": decode a sample of the posterior (the Wan recipe); "mean": decode its mean, as the world
    # model's latents are (an autoencoder with the KL term as a regulariser; it converges much faster
    # on a CPU budget because the decoder is not fed the posterior's noise early on).
    posterior: str = "sample"
    # A decoder-only run may decode, against the stored clips' true frames, the world model's own latents
    # of those clips for a rollout_share of its batch items, and the encoder's latents of them for the
    # rest (both from a file of `python -m training.world --rollouts`): the decoder then learns the
    # latents a session actually feeds it, which leave the encoder's as a rollout goes on. Such a run
    # decodes whole clips, unmirrored (the rollouts are of the clips as rendered), item j of the run
    # being clip rng([data_seed, j]).integers(N), its own latents where the next draw is under the share.
    rollouts: str | None = None
    rollout_share: float = 0.0

    def __post_init__(self) -> None:
        if self.posterior not in ("sample", "mean"):
            raise ValueError(f"posterior must be 'sample' or 'mean'; got {self.posterior!r}")
        if self.loss not in ("l1", "mse"):
            raise ValueError(f"loss must be 'l1' or 'mse'; got {self.loss!r}")
        for name in ("base_dim", "z_dim", "blocks", "batch", "supersample"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1; got {getattr(self, name)}")
        if self.patch_size not in (1, 2):
            raise ValueError(f"patch_size must be 1 or 2 (the temporal factor needs two halvings); got {self.patch_size}")
        if self.decoder_base_dim is not None and self.decoder_base_dim < 1:
            raise ValueError(f"decoder_base_dim must be at least 1; got {self.decoder_base_dim}")
        if not 0.0 < self.lr_final <= 1.0:
            raise ValueError(f"lr_final must be within (0, 1]; got {self.lr_final}")
        if not (self.lr > 0 and math.isfinite(self.lr)) or self.kl_weight < 0 or self.weight_decay < 0:
            raise ValueError("lr must be positive, kl_weight and weight_decay non-negative")
        if self.clips_dir is not None and self.stored_clips < 1:
            raise ValueError("clips_dir needs stored_clips >= 1 (how many of its clips the run uses)")
        if (self.crop_height or self.crop_width) and not (
                0 < self.crop_height <= self.height and 0 < self.crop_width <= self.width
                and self.crop_height % 16 == 0 and self.crop_width % 16 == 0):
            raise ValueError(f"crop {self.crop_height}x{self.crop_width} must be multiples of 16 within "
                             f"{self.height}x{self.width}")
        if self.rollouts is not None and not (self.decoder_only and self.clips_dir and self.init_from
                                              and not self.crop_height and 0.0 < self.rollout_share <= 1.0):
            raise ValueError("rollouts need a decoder-only run from an exported VAE (--init-from, whose latent "
                             "statistics they are normalised by) on stored whole clips, no crop, and a "
                             "rollout_share within (0, 1]")
        self.model_config()  # refuses sizes the model cannot run, before anything is written

    def model_config(self, base: ModelConfig = PRESETS["embedded"]) -> ModelConfig:
        """`base` at this size with this VAE; latents stats start as identity (set on export)."""
        vae = dict(base.vae, base_dim=self.base_dim, decoder_base_dim=self.decoder_base_dim, z_dim=self.z_dim,
                   latents_mean=[0.0] * self.z_dim, latents_std=[1.0] * self.z_dim)
        if self.patch_size == 2:
            vae = patched_vae(vae)
        # The transformer's latent channels follow z_dim (noisy latent + mask + condition latent).
        transformer = dataclasses.replace(base.transformer, out_channels=self.z_dim,
                                          in_channels=2 * self.z_dim + base.transformer.mask_channels)
        return dataclasses.replace(base, height=self.height, width=self.width, vae=vae, transformer=transformer)

    def learning_rate(self, step: int, steps: int) -> float:
        return decayed_rate(self.lr, step, steps, self.lr_decay_from, self.lr_final)

    def default_run_dir(self) -> Path:
        patch = f"-p{self.patch_size}" if self.patch_size > 1 else ""
        name = f"{self.height}x{self.width}-b{self.base_dim}-d{self.decoder_base_dim}-z{self.z_dim}{patch}-s{self.seed}"
        return Path.home() / ".cache" / "lingbot" / "train" / "vae" / name


def new_vae(tc: VaeTrainConfig) -> AutoencoderKLWan:
    model_config = tc.model_config()
    vae = build_vae(model_config, torch.float32, "cpu", seed=tc.seed)
    check_streamable(vae, model_config)
    return vae.train().requires_grad_(True)


def new_optimizer(vae: AutoencoderKLWan, tc: VaeTrainConfig) -> torch.optim.AdamW:
    if tc.decoder_only:
        vae.encoder.requires_grad_(False)
        vae.quant_conv.requires_grad_(False)
    return torch.optim.AdamW([p for p in vae.parameters() if p.requires_grad], lr=tc.lr,
                             weight_decay=tc.weight_decay)


def decode_unclamped(vae: AutoencoderKLWan, z: torch.Tensor) -> torch.Tensor:
    """`vae.decode(z)` without its final clamp (which zeroes the gradient of overshooting pixels)."""
    x = vae.post_quant_conv(z)
    cache = [None] * sum(isinstance(m, WanCausalConv3d) for m in vae.decoder.modules())
    frames = [decode_latent_frame(vae, x[:, :, i : i + 1], cache, i == 0) for i in range(x.shape[2])]
    return unpatchify(torch.cat(frames, dim=2), vae.config.patch_size or 1)


def losses(vae: AutoencoderKLWan, video: torch.Tensor, tc: VaeTrainConfig, generator: torch.Generator,
           latents: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Loss terms on `video` [B, 3, T, H, W] in [-1, 1]: rec (per pixel), kl (per latent element), loss.
    `latents` (decoder-only runs with rollouts): what to decode, on the VAE's scale, instead of encoding
    `video`; there is no posterior then, and no KL term."""
    if latents is not None:
        if not tc.decoder_only:
            raise ValueError("given latents are decoded by a decoder-only run only")
        posterior, recon = None, decode_unclamped(vae, latents)
    elif tc.decoder_only:
        with torch.no_grad():
            posterior = vae.encode(video).latent_dist
        recon = decode_unclamped(vae, posterior.mean)
    elif tc.posterior == "mean":
        posterior = vae.encode(video).latent_dist
        recon = decode_unclamped(vae, posterior.mean)
    else:
        posterior = vae.encode(video).latent_dist
        recon = decode_unclamped(vae, posterior.sample(generator=generator))
    rec = (recon - video).abs().mean() if tc.loss == "l1" else (recon - video).square().mean()
    if posterior is None:
        kl = rec.new_zeros(())
    else:
        kl = 0.5 * (posterior.mean.square() + posterior.var - 1.0 - posterior.logvar).mean()
    return {"loss": rec + tc.kl_weight * kl, "rec": rec, "kl": kl}


def train_step(vae: AutoencoderKLWan, optimizer: torch.optim.Optimizer, video: torch.Tensor, tc: VaeTrainConfig,
               generator: torch.Generator, latents: torch.Tensor | None = None) -> dict[str, float]:
    vae.train()
    optimizer.zero_grad(set_to_none=True)
    terms = losses(vae, video, tc, generator, latents)
    if not torch.isfinite(terms["loss"]):
        raise FloatingPointError(f"non-finite loss {terms['loss'].item()}; lower --lr (the checkpoint is kept)")
    terms["loss"].backward()
    optimizer.step()
    return {name: value.item() for name, value in terms.items()}


# ---------------------------------------------------------------------------------------------
# Evaluation through the streaming inference path


def latent_stats(vae: AutoencoderKLWan) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (1, vae.config.z_dim, 1, 1, 1)
    return (torch.tensor(vae.config.latents_mean, dtype=torch.float32).view(shape),
            torch.tensor(vae.config.latents_std, dtype=torch.float32).view(shape))


@torch.no_grad()
def stream_reconstruct(vae: AutoencoderKLWan, model_config: ModelConfig,
                       video: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(clip, start frame) reconstructions of `video` [3, T, H, W] as inference produces them.

    The clip: posterior means of the causal encoder, normalised, decoded block by block by the streaming
    decoder. The start frame: the condition stream's block 0, latent frame 0, decoded alone.
    """
    vae.eval()
    like = next(vae.parameters())
    x = video.unsqueeze(0).to(like.dtype)
    mean, std = (t.to(like.dtype) for t in latent_stats(vae))
    latents = (vae.encode(x).latent_dist.mode() - mean) / std
    per_block = model_config.transformer.num_frames_per_block
    state, frames = DecoderStream(), []
    for start in range(0, latents.shape[2], per_block):
        out, state = decode_block(vae, state, latents[:, :, start : start + per_block])
        frames.append(out)
    condition, _ = encode_condition_block(vae, ConditionStream.start(x[:, :, 0]), 0, model_config)
    image, _ = decode_block(vae, DecoderStream(), condition[:, :, :1])
    return torch.cat(frames, dim=2)[0], image[0]


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """PSNR in dB of two tensors in [-1, 1] (peak 1 on the [0, 1] scale)."""
    mse = ((a.float() - b.float()) / 2.0).square().mean().item()
    return float("inf") if mse == 0 else 10.0 * math.log10(1.0 / mse)


def held_out_clips(tc: VaeTrainConfig, count: int, blocks: int) -> list[torch.Tensor]:
    model_config = tc.model_config()
    return [make_clip(EVAL_DATA_SEED, i, model_config, blocks, tc.supersample, world_seeds=HELD_OUT_SEEDS).video
            for i in range(count)]


def evaluate(vae: AutoencoderKLWan, tc: VaeTrainConfig, clips: list[torch.Tensor]) -> dict[str, float]:
    """Mean PSNR over the held-out clips: whole clip (streamed decode) and start frame (condition path)."""
    model_config = tc.model_config()
    clip_psnr, image_psnr = [], []
    for video in clips:
        recon, image = stream_reconstruct(vae, model_config, video)
        clip_psnr.append(psnr(recon, video))
        image_psnr.append(psnr(image, video[:, :1]))
    vae.train()
    return {"psnr": float(np.mean(clip_psnr)), "psnr_image": float(np.mean(image_psnr))}


def block_psnr(vae: AutoencoderKLWan, tc: VaeTrainConfig, clips: list[torch.Tensor]) -> list[float]:
    """Mean PSNR per block index over the held-out clips, streamed as a session streams: a causal VAE
    can be good at block 0 and poor later (a window shorter than the session), which a clip mean hides."""
    model_config = tc.model_config()
    blocks = []
    for video in clips:
        recon, _ = stream_reconstruct(vae, model_config, video)
        count = (video.shape[1] + model_config.vae_temporal_factor - 1) // model_config.pixel_frames_per_block
        bounds = [0] + [model_config.pixel_frames_for_blocks(b) for b in range(1, count + 1)]
        blocks.append([psnr(recon[:, a:b], video[:, a:b]) for a, b in zip(bounds, bounds[1:])])
    vae.train()
    return np.mean(blocks, axis=0).tolist()


# ---------------------------------------------------------------------------------------------
# Run state


def _one_thread(_: int) -> None:
    torch.set_num_threads(1)  # render workers: one thread each (see benchmarks/bench_render.py)


class Batch(NamedTuple):
    video: torch.Tensor  # [B, 3, T, H, W] in [-1, 1]
    latents: torch.Tensor | None = None  # [B, z, F, h, w] on the VAE's scale: decode these (rollouts runs)


class Rollouts(NamedTuple):
    own: torch.Tensor  # [N, z, F, h, w]: the world model's latents of clips 0 .. N-1, on the VAE's scale
    encoded: torch.Tensor  # the encoder's latents of the same clips, on the VAE's scale


def read_rollouts(tc: VaeTrainConfig) -> Rollouts:
    """The rollouts file's latents of the run's clips. The file holds them normalised by the init_from
    export's statistics, as the world model reads and makes them; the decoder takes them back."""
    state = torch.load(Path(tc.rollouts).expanduser(), map_location="cpu", weights_only=True)
    if state.get("format") != ROLLOUTS_FORMAT:
        raise ValueError(f"{tc.rollouts} is not a rollouts file of format {ROLLOUTS_FORMAT} "
                         "(python -m training.world --rollouts)")
    statistics = start_latent_stats(tc)
    if statistics is None:
        raise ValueError(f"rollouts need --init-from an exported vae/ folder (whose latent statistics normalised "
                         f"them), not {tc.init_from}")
    if [list(state.get("latents_mean", [])), list(state.get("latents_std", []))] != list(statistics):
        raise ValueError(f"{tc.rollouts} was normalised by other latent statistics than {tc.init_from}'s: "
                         "make the rollouts with this VAE (training.world --vae)")
    frames = tc.blocks * tc.model_config().transformer.num_frames_per_block
    mean, std = (torch.tensor(v).view(1, -1, 1, 1, 1) for v in statistics)
    parts = []
    for name in ("latents", "encoded"):
        latents = state[name]
        if len(latents) < tc.stored_clips or latents.shape[1] != tc.z_dim or latents.shape[2] != frames:
            raise ValueError(f"{tc.rollouts} holds {len(latents)} clips' {name} of {latents.shape[2]} latent frames "
                             f"and {latents.shape[1]} channels; the run needs {tc.stored_clips} of {frames} and "
                             f"{tc.z_dim}")
        parts.append(latents[: tc.stored_clips].float() * std + mean)
    return Rollouts(*parts)


def rollout_batches(tc: VaeTrainConfig, first_step: int, steps: int) -> Iterator[Batch]:
    """Batches of whole stored clips with the latents to decode for each (see VaeTrainConfig.rollouts)."""
    stored = StoredClips(tc.clips_dir, tc.stored_clips)
    frames = tc.model_config().pixel_frames_for_blocks(tc.blocks)
    rollouts = read_rollouts(tc)
    lengths = {item["video"].shape[0] for item in stored.items}
    if lengths != {frames}:
        raise ValueError(f"rollouts are of whole clips of {tc.blocks} blocks ({frames} frames); the stored clips "
                         f"have {sorted(lengths)} frames")
    for step in range(first_step, steps):
        videos, latents = [], []
        for j in range(step * tc.batch, (step + 1) * tc.batch):
            rng = np.random.default_rng([tc.data_seed, j])
            index = int(rng.integers(len(stored)))
            videos.append(stored.video(index))
            latents.append((rollouts.own if rng.random() < tc.rollout_share else rollouts.encoded)[index])
        yield Batch(torch.stack(videos), torch.stack(latents))


def stored_batches(tc: VaeTrainConfig, first_step: int, steps: int) -> Iterator[Batch]:
    """Batches of windows of stored clips; item j is a pure function of (data_seed, j), so runs resume exactly."""
    if tc.rollouts:
        yield from rollout_batches(tc, first_step, steps)
        return
    stored = StoredClips(tc.clips_dir, tc.stored_clips)
    frames = tc.model_config().pixel_frames_for_blocks(tc.blocks)
    for step in range(first_step, steps):
        items = []
        for j in range(step * tc.batch, (step + 1) * tc.batch):
            rng = np.random.default_rng([tc.data_seed, 7, j])
            index = int(rng.integers(len(stored)))
            total = stored.items[index]["video"].shape[0]
            video = stored.video(index, int(rng.integers(total - frames + 1)), frames)
            if tc.crop_height:
                top = int(rng.integers(video.shape[2] - tc.crop_height + 1))
                left = int(rng.integers(video.shape[3] - tc.crop_width + 1))
                video = video[:, :, top:top + tc.crop_height, left:left + tc.crop_width]
            if rng.random() < 0.5:
                video = video.flip(-1)
            items.append(video)
        yield Batch(torch.stack(items))


def batches(tc: VaeTrainConfig, first_step: int, steps: int, workers: int) -> Iterator[Batch]:
    """Videos [batch, 3, T, H, W] of steps first_step .. steps - 1: step s holds clips s*batch ... ."""
    if tc.clips_dir:
        yield from stored_batches(tc, first_step, steps)
        return
    dataset = ClipDataset(tc.model_config(), tc.blocks, (steps - first_step) * tc.batch, tc.data_seed,
                          first_step * tc.batch, tc.supersample)
    loader = torch.utils.data.DataLoader(dataset, batch_size=tc.batch, num_workers=workers,
                                         worker_init_fn=_one_thread if workers else None)
    for item in loader:
        yield Batch(item["video"])


def save_checkpoint(run_dir: Path, tc: VaeTrainConfig, step: int, vae: AutoencoderKLWan,
                    optimizer: torch.optim.Optimizer, generator: torch.Generator) -> None:
    state = {"format": CHECKPOINT_FORMAT, "train_config": dataclasses.asdict(tc), "step": step,
             "next_clip": step * tc.batch, "model": vae.state_dict(), "optimizer": optimizer.state_dict(),
             "noise_rng": generator.get_state()}
    save_atomically(state, run_dir / CHECKPOINT)


def load_checkpoint(run_dir: Path, tc: VaeTrainConfig | None = None) -> tuple[VaeTrainConfig, dict]:
    """The run's config and state; with `tc`, refuse a checkpoint written under other settings."""
    path = run_dir / CHECKPOINT
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # a truncated or foreign file: say which, do not touch it
        raise ValueError(f"cannot read the checkpoint {path}: {error}") from error
    if state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path} is not a training.vae checkpoint of format {CHECKPOINT_FORMAT}")
    saved = VaeTrainConfig(**state["train_config"])
    if tc is not None and saved != tc:
        diff = {k: (v, getattr(tc, k)) for k, v in dataclasses.asdict(saved).items() if getattr(tc, k) != v}
        raise ValueError(f"{path} was trained with other settings (checkpoint, asked): {diff}; use another "
                         "--run-dir or the checkpoint's settings")
    return saved, state


def train(tc: VaeTrainConfig, run_dir: Path, steps: int, *, workers: int = 0, eval_every: int = 0,
          eval_clips: int = 4, eval_blocks: int = 2, checkpoint_every: int = 100,
          progress: bool = False) -> AutoencoderKLWan:
    """Train to `steps` total steps, resuming from `run_dir`'s checkpoint if there is one; returns the VAE."""
    run_dir.mkdir(parents=True, exist_ok=True)
    vae = new_vae(tc)
    optimizer = new_optimizer(vae, tc)
    generator = torch.Generator().manual_seed(tc.seed)
    step = 0
    if (run_dir / CHECKPOINT).exists():
        _, state = load_checkpoint(run_dir, tc)
        vae.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        generator.set_state(state["noise_rng"])
        step = state["step"]
        trim_log(run_dir / LOG, step)
    elif tc.init_from:
        load_start(vae, Path(tc.init_from).expanduser())
    if step >= steps:
        return vae

    eval_set = held_out_clips(tc, eval_clips, eval_blocks) if eval_every else []
    bar = tqdm(total=steps, initial=step, unit="step", disable=not progress, dynamic_ncols=True)
    with open(run_dir / LOG, "a") as log:
        started = time.perf_counter()
        for batch in batches(tc, step, steps, workers):
            for group in optimizer.param_groups:
                group["lr"] = tc.learning_rate(step, steps)
            terms = train_step(vae, optimizer, batch.video, tc, generator, batch.latents)
            step += 1
            record = {"step": step, **{k: round(v, 6) for k, v in terms.items()},
                      "seconds": round(time.perf_counter() - started, 3)}
            if eval_every and (step % eval_every == 0 or step == steps):
                record.update({k: round(v, 3) for k, v in evaluate(vae, tc, eval_set).items()})
            log.write(json.dumps(record) + "\n")
            bar.set_postfix({k: record[k] for k in ("loss", "psnr") if k in record})
            bar.update(1)
            if step % checkpoint_every == 0 or step == steps:
                log.flush()
                save_checkpoint(run_dir, tc, step, vae, optimizer, generator)
    bar.close()
    return vae


def is_export(folder: Path) -> bool:
    """An exported vae/ folder (diffusers layout) rather than a run folder."""
    return (folder / "config.json").exists() and (folder / EXPORT_WEIGHTS).exists()


def load_start(vae: AutoencoderKLWan, folder: Path) -> None:
    """Load `init_from`'s weights into `vae`: a run folder's checkpoint, or an exported vae/ folder."""
    if not is_export(folder):
        _, start = load_checkpoint(folder)
        vae.load_state_dict(start["model"])
        return
    weights = {k: v.float() for k, v in load_file(folder / EXPORT_WEIGHTS).items()}
    try:
        vae.load_state_dict(weights)
    except RuntimeError as error:  # another size: say so without the whole state-dict listing
        config = json.loads((folder / "config.json").read_text())
        raise ValueError(f"{folder} holds a VAE of another size (base_dim {config.get('base_dim')}, "
                         f"decoder_base_dim {config.get('decoder_base_dim')}, z_dim {config.get('z_dim')}) than "
                         f"this run's ({vae.config.base_dim}, {vae.config.decoder_base_dim}, {vae.config.z_dim})"
                         ) from error


def start_latent_stats(tc: VaeTrainConfig) -> tuple[list[float], list[float]] | None:
    """The latents statistics a run's export must keep: those of the exported folder a decoder-only run
    started from (its encoder is that folder's, unchanged); None where they are to be measured."""
    if not (tc.decoder_only and tc.init_from and is_export(Path(tc.init_from).expanduser())):
        return None
    config = json.loads((Path(tc.init_from).expanduser() / "config.json").read_text())
    return list(config["latents_mean"]), list(config["latents_std"])


# ---------------------------------------------------------------------------------------------
# Export


@torch.no_grad()
def measured_latent_stats(vae: AutoencoderKLWan, tc: VaeTrainConfig, clips: int) -> tuple[list[float], list[float]]:
    """Per-channel mean and std of the posterior means over `clips` train clips of the run's data seed."""
    vae.eval()
    model_config = tc.model_config()
    means = [vae.encode(make_clip(tc.data_seed, i, model_config, tc.blocks, tc.supersample).video.unsqueeze(0))
             .latent_dist.mode() for i in range(clips)]
    flat = torch.cat([m.transpose(0, 1).reshape(tc.z_dim, -1) for m in means], dim=1)
    std = flat.std(dim=1).clamp_min(1e-4)  # a dead channel must not divide by zero
    return flat.mean(dim=1).tolist(), std.tolist()


def export_vae(vae: AutoencoderKLWan, out: Path, latents_mean: list[float], latents_std: list[float]) -> Path:
    """Write `out`/vae/ in float16 safetensors, diffusers layout; returns that folder."""
    exported = copy.deepcopy(vae).eval()
    exported.register_to_config(latents_mean=list(latents_mean), latents_std=list(latents_std))
    torch.nn.Module.to(exported, dtype=torch.float16)
    folder = out / "vae"
    exported.save_pretrained(folder, safe_serialization=True)
    return folder


# ---------------------------------------------------------------------------------------------


def _config_from_args(args: argparse.Namespace) -> VaeTrainConfig:
    try:
        height, width = (int(v) for v in args.size.lower().split("x"))
    except ValueError:
        raise ValueError(f"--size must be HEIGHTxWIDTH, for example 96x160; got {args.size!r}") from None
    crop = tuple(int(v) for v in args.crop.lower().split("x")) if args.crop else (0, 0)
    return VaeTrainConfig(height=height, width=width, base_dim=args.base_dim,
                          decoder_base_dim=args.decoder_base_dim or None, z_dim=args.z_dim,
                          patch_size=args.patch_size, blocks=args.blocks,
                          batch=args.batch, lr=args.lr, lr_decay_from=args.lr_decay_from, lr_final=args.lr_final,
                          weight_decay=args.weight_decay, kl_weight=args.kl_weight,
                          loss=args.loss, seed=args.seed, data_seed=args.data_seed, supersample=args.supersample,
                          clips_dir=args.clips_dir, stored_clips=args.stored_clips, crop_height=crop[0],
                          crop_width=crop[1], init_from=args.init_from, decoder_only=args.decoder_only,
                          posterior=args.posterior, rollouts=args.rollouts,
                          rollout_share=args.rollout_share if args.rollouts else 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = VaeTrainConfig()
    parser.add_argument("--steps", type=int, default=0, help="total steps of the run (resumes below this)")
    parser.add_argument("--size", default=f"{d.height}x{d.width}", help="HEIGHTxWIDTH, multiples of 32")
    parser.add_argument("--base-dim", type=int, default=d.base_dim)
    parser.add_argument("--decoder-base-dim", type=int, default=d.decoder_base_dim, help="0: same as --base-dim")
    parser.add_argument("--z-dim", type=int, default=d.z_dim)
    parser.add_argument("--patch-size", type=int, default=d.patch_size,
                        help="2: a patched VAE (2x2 pixels folded into channels, one halving fewer)")
    parser.add_argument("--blocks", type=int, default=d.blocks)
    parser.add_argument("--batch", type=int, default=d.batch)
    parser.add_argument("--lr", type=float, default=d.lr)
    parser.add_argument("--lr-decay-from", type=int, default=d.lr_decay_from,
                        help="from this step on the rate falls linearly to lr * --lr-final at --steps (-1: constant)")
    parser.add_argument("--lr-final", type=float, default=d.lr_final)
    parser.add_argument("--weight-decay", type=float, default=d.weight_decay)
    parser.add_argument("--kl-weight", type=float, default=d.kl_weight)
    parser.add_argument("--loss", choices=("l1", "mse"), default=d.loss)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--data-seed", type=int, default=d.data_seed)
    parser.add_argument("--supersample", type=int, default=d.supersample)
    parser.add_argument("--clips-dir", help="train on the clips stored here (python -m training.data) instead of rendering")
    parser.add_argument("--stored-clips", type=int, default=0, help="how many stored clips (0 .. N-1) to use")
    parser.add_argument("--crop", help="HxW crops of the stored clips (multiples of 16)")
    parser.add_argument("--init-from", help="start from this run folder's weights, or an exported vae/ folder's")
    parser.add_argument("--decoder-only", action="store_true", help="train the decoder only (encoder frozen)")
    parser.add_argument("--posterior", choices=("sample", "mean"), default="sample",
                        help="decode a posterior sample (Wan's recipe) or its mean")
    parser.add_argument("--rollouts", help="with --decoder-only: also decode the world model's own latents of the "
                        "stored clips from this file (python -m training.world --rollouts)")
    parser.add_argument("--rollout-share", type=float, default=0.5,
                        help="share of the batch items that decode a rollout (with --rollouts)")
    parser.add_argument("--run-dir", help="checkpoint and log folder (default under ~/.cache/lingbot/train/vae/)")
    parser.add_argument("--eval-every", type=int, default=500)
    parser.add_argument("--eval-clips", type=int, default=4)
    parser.add_argument("--eval-blocks", type=int, default=2, help="length of the held-out clips in blocks")
    parser.add_argument("--checkpoint-every", type=int, default=100)
    parser.add_argument("--workers", type=int, default=1, help="render processes (0: render in this process)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the training process")
    parser.add_argument("--evaluate", action="store_true", help="print the run's held-out PSNR and stop")
    parser.add_argument("--export", metavar="DIR", help="write DIR/vae/ from the run's checkpoint and stop")
    parser.add_argument("--stats-clips", type=int, default=8, help="train clips for the exported latents stats")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    try:
        tc = _config_from_args(args)
        run_dir = Path(args.run_dir).expanduser() if args.run_dir else tc.default_run_dir()
        if args.evaluate:
            if is_export(run_dir):  # an exported vae/ folder of this command's sizes
                vae, label = new_vae(tc), str(run_dir)
                load_start(vae, run_dir)
            else:
                tc, state = load_checkpoint(run_dir)
                vae, label = new_vae(tc), f"step {state['step']}"
                vae.load_state_dict(state["model"])
            clips = held_out_clips(tc, args.eval_clips, args.eval_blocks)
            scores = evaluate(vae, tc, clips)
            print(f"{label}: held-out PSNR {scores['psnr']:.2f} dB (clips of {args.eval_blocks} blocks, "
                  "streamed decode), "
                  f"{scores['psnr_image']:.2f} dB (start frame through the condition encoder), "
                  f"{args.eval_clips} clips; per block: "
                  + ", ".join(f"{value:.2f}" for value in block_psnr(vae, tc, clips)))
            return
        if args.export:
            if not (run_dir / CHECKPOINT).exists():
                parser.error(f"no checkpoint {run_dir / CHECKPOINT} to export")
            tc, state = load_checkpoint(run_dir)  # the checkpoint's own settings
            vae = new_vae(tc)
            vae.load_state_dict(state["model"])
            mean, std = start_latent_stats(tc) or measured_latent_stats(vae, tc, args.stats_clips)
            folder = export_vae(vae, Path(args.export), mean, std)
            print(f"step {state['step']} -> {folder}")
            return
        if args.steps < 1:
            parser.error("--steps (total steps of the run) is required to train")
        print(f"run {run_dir}")
        train(tc, run_dir, args.steps, workers=args.workers, eval_every=args.eval_every,
              eval_clips=args.eval_clips, eval_blocks=args.eval_blocks, checkpoint_every=args.checkpoint_every,
              progress=True)
    except (ValueError, FloatingPointError) as error:
        parser.exit(2, f"error: {error}\n")


if __name__ == "__main__":
    main()
