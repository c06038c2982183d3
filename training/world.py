"""Train the embedded preset's world model (the causal transformer) on stored clips of train worlds.

    python -m training.world --vae DIR/vae --clips-dir DIR --stored-clips N --steps S [--blocks 6] [--batch 2]
                             [--lr 3e-4] [--rollout-from STEP] [--rollout-share 0.5] [--seed 0] [--run-dir DIR]
                             [--lr-decay-from STEP] [--lr-final 0.1] [--motion-weight W] [--mirror] [--threads 2]
                             [--init-from MODEL_DIR] [--position-shift-share 0.5] [--position-shift-blocks 64]
                             [--extra-flow-shifts SHIFT ...]
    python -m training.world --run-dir DIR --export OUT   # OUT/transformer/: fp16 safetensors, diffusers layout
    python -m training.world --vae DIR/vae --init-from MODEL_DIR --clips-dir DIR --stored-clips N --run-dir DIR \
                             --rollouts OUT.pt   # the model's own latents of every clip, for training.vae --rollouts

It trains exactly the structure inference runs (lingbot_core/blocks/rollout.py `step_block`):
- the condition of block b is block b of the causal condition stream of the clip's start frame
  followed by zero frames, with the mask on latent frame 0 (`vae_stream.condition_mask`);
- the camera of block b is the Plücker map of its latent poses anchored on the previous block's last
  pose, integrated from the clip's keys by `camera.integrate_actions` from its start pose (level, or
  pitched for clips rendered with --start-pitch) and normalised per block, as for key input;
- a block attends to its sink and recent-window context (`attention.context_frames`) through K/V
  written by a t=0 forward of the clean context, and to its own frames non-causally;
- its noisy latents sit at one of the sampler's four sigmas, x_t = (1 - s) x0 + s eps, the model
  predicts v at timestep 1000 s, and the loss is the error of x0 = x_t - s v against the clip's
  latents (the sampler's own update).

Teacher forcing runs the blocks of a window in order, as inference does: each block's noisy forward
reads the rotated K/V that the t=0 forwards of its context frames recorded (the same K/V the cache
would hold, selected by the same sink/window rule), then its own clean t=0 forward records its K/V. From --rollout-from on, a share of
the batches replaces the clean context with the model's own rollout (four sampler steps and a commit
per block, no gradient), while the targets stay the rendered clip: the world is deterministic, so the
right next block after an imperfect context is still the true one, and the model learns to pull its
own drift back (the point of Self-Forcing, with a regression target that this world makes possible).

A training window is 6 blocks, a session is unbounded, and RoPE's time axis is absolute: at block 64
the sink sits 190 latent frames behind the current block, a distance no 6-block window shows. With
--position-shift-share, a share of the batches places every block after the sink m blocks later on
that axis (m uniform in 1 .. --position-shift-blocks), so each such block attends exactly as block
b + m of a session does (`block_position`), with its true neighbours and its sink.

Text conditioning is trivial: each step draws a prompt from PROMPTS (the app's example prompts and a
few others), so the model learns to read the world from the picture and the keys whatever the prompt
says, and prompt switching changes nothing it relies on.

Reproducible and resumable as training/vae.py: step s uses batch items s*batch .. of the data seed,
each a pure function of (data_seed, item); RUN_DIR/last.pt holds model, optimizer, step and RNG (and, with
--ema-decay, the average of the weights, which is what gets exported).
The frozen VAE's latents of the stored clips are computed once into RUN_DIR/latents.pt; a run resumed
with more stored clips (never fewer) encodes only the new ones and appends them.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from diffusers import AutoencoderKLWan
from tqdm import tqdm

from lingbot_core.config import EMBEDDED, ModelConfig
from lingbot_core.blocks import loading
from lingbot_core.blocks.loading import CheckpointError, build_seeded_parts, load_transformer_shards, plan_transformer_shards
from lingbot_core.model import camera
from lingbot_core.model.attention import context_frames
from lingbot_core.model.transformer import CausalLingBotWorldTransformer3DModel
from lingbot_core.model.vae_stream import check_streamable, condition_mask
from training.data import StoredClips, array_to_actions, mirror_actions, mirror_poses, start_state
from training.runs import decayed_rate, save_atomically, trim_log
from training.vae import ROLLOUTS_FORMAT
from training.weight_average import CHECKPOINT_KEY as AVERAGE_KEY, WeightAverage, exported_weights

CHECKPOINT = "last.pt"
LOG = "log.jsonl"
LATENTS = "latents.pt"
MIRRORED_LATENTS = "latents_mirrored.pt"
ROLLOUT_BATCH = 6  # clips rolled out at once by --rollouts (the draws of the sampler's noise follow it)
CHECKPOINT_FORMAT = 1

PROMPTS = (
    "A walk through a quiet countryside with trees, rocks and small houses.",
    "A misty valley at dawn.",
    "Green hills under a pale sky, a few houses in the distance.",
    "A sunny afternoon in a village.",
    "An open field with scattered trees and stones.",
)


@dataclass(frozen=True)
class WorldTrainConfig:
    """Everything that defines a run; a checkpoint resumes only under the same values."""

    vae: str  # the exported VAE folder (python -m training.vae --export): latents and conditions come from it
    clips_dir: str
    stored_clips: int
    blocks: int = 6  # blocks per training window, always from block 0 (the sink is the first block)
    batch: int = 2
    lr: float = 3e-4
    weight_decay: float = 0.01
    seed: int = 0
    data_seed: int = 0
    rollout_from: int = -1  # from this step on, a share of batches trains on self-generated context (-1: never)
    rollout_share: float = 0.5
    lr_decay_from: int = -1  # from this step on the learning rate falls linearly to lr * lr_final (-1: constant)
    lr_final: float = 0.1
    # Weight of each latent position in the loss: 1 + motion_weight * (how much the true latents change
    # there from the previous frame, over its batch mean). Camera motion shows mostly where objects and
    # texture move, a small share of a frame; weighting it up makes the camera's part of the error count
    # (0: plain mean squared error).
    motion_weight: float = 0.0
    # Also train on every clip's mirror image (frames flipped left to right, A<->D and J<->L swapped),
    # an exact clip of the mirrored world: twice the data, and every world turned in both directions, so
    # a turn's direction can only come from the keys.
    mirror: bool = False
    # Start from the weights of an exported transformer (a model folder holding transformer/, such as
    # lingbot_core/embedded_model) instead of seeded ones, with a fresh optimizer. Lets a run continue
    # from the shipped weights on a machine that has no earlier run folder ("": seeded start).
    init_from: str = ""
    # The share of batches whose blocks after the sink sit 1 .. position_shift_blocks blocks later in
    # RoPE time (see the module docstring): teaches the distances of long sessions (0: never).
    position_shift_share: float = 0.0
    position_shift_blocks: int = 64
    # The denoiser also learns the sigmas that the sampler's timesteps give under these flow shifts,
    # drawn as often as the preset's own (the rollouts keep the preset's schedule). A model moving to a
    # new schedule keeps the old one this way, so one run can be measured under both (empty: only the
    # preset's four).
    extra_flow_shifts: tuple[float, ...] = ()
    # Keep an exponential moving average of the weights, decay per step, and export it
    # (training/weight_average.py says why; 0: none). May be turned on part-way through a run.
    ema_decay: float = 0.0

    def __post_init__(self) -> None:
        if self.blocks < 1 or self.batch < 1 or self.stored_clips < 1:
            raise ValueError("blocks, batch and stored_clips must be at least 1")
        if not 0.0 <= self.rollout_share <= 1.0:
            raise ValueError("rollout_share must be within [0, 1]")
        if not 0.0 < self.lr_final <= 1.0:
            raise ValueError("lr_final must be within (0, 1]")
        if self.motion_weight < 0.0:
            raise ValueError("motion_weight must be at least 0")
        if not 0.0 <= self.position_shift_share <= 1.0:
            raise ValueError("position_shift_share must be within [0, 1]")
        if self.position_shift_blocks < 1:
            raise ValueError("position_shift_blocks must be at least 1")
        if not 0.0 <= self.ema_decay < 1.0:
            raise ValueError("ema_decay must be within [0, 1)")
        # A checkpoint stores the run's settings as lists; compare them as the tuple a command gives.
        object.__setattr__(self, "extra_flow_shifts", tuple(float(x) for x in self.extra_flow_shifts))
        if any(not shift > 0.0 for shift in self.extra_flow_shifts):
            raise ValueError("every extra flow shift must be above 0")

    def position_shift(self, step: int, frames_per_block: int) -> int:
        """Latent frames by which step's batch moves its blocks after the sink (0: where they are).
        A pure function of (data_seed, step), as the batch itself, so a resumed run draws the same."""
        rng = np.random.default_rng([self.data_seed, 13, step])
        if rng.random() >= self.position_shift_share:
            return 0
        return int(rng.integers(1, self.position_shift_blocks + 1)) * frames_per_block

    def learning_rate(self, step: int, steps: int) -> float:
        return decayed_rate(self.lr, step, steps, self.lr_decay_from, self.lr_final)


def model_config(vae: AutoencoderKLWan) -> ModelConfig:
    """The embedded preset with this VAE's config (its latents statistics included)."""
    keys = ("base_dim", "decoder_base_dim", "z_dim", "dim_mult", "num_res_blocks", "attn_scales",
            "temperal_downsample", "dropout", "latents_mean", "latents_std")
    if vae.config.get("patch_size"):  # a patched VAE (config.patched_vae) folds pixels into 12 channels
        keys += ("patch_size", "in_channels", "out_channels")
    vae_kwargs = {k: (list(vae.config[k]) if isinstance(vae.config[k], (list, tuple)) else vae.config[k])
                  for k in keys}
    return dataclasses.replace(EMBEDDED, vae=dict(EMBEDDED.vae, **vae_kwargs), trained=True)


def load_vae(folder: str | Path) -> AutoencoderKLWan:
    """An exported VAE folder in fp32 on the CPU, read as the pipeline's loader reads it."""
    return loading.load_vae(Path(folder).expanduser(), torch.float32, "cpu")


# ---------------------------------------------------------------------------------------------
# Data: latents, conditions and cameras of the stored clips


def _normalised_mean(vae: AutoencoderKLWan, video: torch.Tensor) -> torch.Tensor:
    """The posterior mean of `video`, normalised per channel as the condition encoder and decoder expect."""
    mean = vae.encode(video).latent_dist.mean
    z = vae.config.z_dim
    stats_mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1)
    stats_std = torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1)
    return (mean - stats_mean) / stats_std


@torch.no_grad()
def encode_clips(vae: AutoencoderKLWan, config: ModelConfig, stored: StoredClips, blocks: int,
                 batch: int = 8, mirrored: bool = False, first: int = 0) -> dict[str, torch.Tensor]:
    """Per clip from `first` on: latents [z, F, h, w] of its first `blocks` blocks, and the condition
    stream of its start frame for those blocks (the one-shot encode of [start, zeros...], which the
    streamed condition encoder equals). `mirrored`: of the clips' mirror images, with their mirrored keys."""
    frames = config.pixel_frames_for_blocks(blocks)
    latents, conditions = [], []
    for start in tqdm(range(first, len(stored), batch), desc="encode mirrored" if mirrored else "encode", unit="batch"):
        videos = torch.stack([stored.video(i, 0, frames) for i in range(start, min(start + batch, len(stored)))])
        if mirrored:
            videos = videos.flip(-1)  # the VAE is not mirror-symmetric, so the mirror image is encoded itself
        latents.append(_normalised_mean(vae, videos))
        condition_video = torch.zeros_like(videos)
        condition_video[:, :, 0] = videos[:, :, 0]
        conditions.append(_normalised_mean(vae, condition_video))
    per_block = config.transformer.num_frames_per_block
    actions = [stored.items[i]["actions"][: blocks * per_block].astype(np.uint8) for i in range(first, len(stored))]
    actions = torch.stack([torch.from_numpy(mirror_actions(a) if mirrored else a) for a in actions])
    starts = torch.stack([torch.from_numpy(stored.items[i]["latent_poses"][0].astype(np.float64))
                          for i in range(first, len(stored))])
    if mirrored:
        starts = mirror_poses(starts)
    return {"latents": torch.cat(latents), "conditions": torch.cat(conditions), "actions": actions,
            "start_poses": starts}


def cached_encoding(path: Path, vae: AutoencoderKLWan, config: ModelConfig, stored: Callable[[], StoredClips],
                    count: int, blocks: int, mirrored: bool = False) -> dict[str, torch.Tensor]:
    """encode_clips of clips 0 .. count - 1, kept at `path`. A cache of fewer clips (a run whose
    data grew on resume) is extended by the new clips only: encoding is most of a run's start-up.
    A cache of more (a run that grew its data, then stopped before its first checkpoint under the
    new count) gives its first `count`. `stored` gives the clips; it is called only when something
    must be encoded."""
    cached = torch.load(path, weights_only=True) if path.exists() else None
    have = 0 if cached is None else len(cached["latents"])
    if cached is not None and "start_poses" not in cached:
        # Written before clips could start pitched (training.data --start-pitch): every clip it holds
        # was rendered from the level start.
        cached["start_poses"] = torch.eye(4, dtype=torch.float64).expand(have, 4, 4).clone()
    if have > count:
        return {key: value[:count] for key, value in cached.items()}
    if have < count:
        new = encode_clips(vae, config, stored(), blocks, mirrored=mirrored, first=have)
        cached = new if cached is None else {key: torch.cat([cached[key], new[key]]) for key in new}
        save_atomically(cached, path)
    return cached


def block_pluckers(config: ModelConfig, frame_actions, blocks: int,
                   start: camera.CameraState | None = None) -> torch.Tensor:
    """[F, 6, H, W] Plücker maps of `blocks` blocks of keys from the clip's start state (level when
    None), exactly as step_block builds them in a session that has reached that state."""
    per_block = config.transformer.num_frames_per_block
    state = camera.CameraState.initial() if start is None else start
    maps = []
    for b in range(blocks):
        actions = tuple(frame_actions[b * per_block:(b + 1) * per_block])
        poses, next_state = camera.integrate_actions(state, actions, config.camera)
        intrinsics = camera.reference_intrinsics(config.camera, per_block, config.width, config.height)
        maps.append(camera.plucker_block(state.pose, poses, intrinsics, config.width, config.height, config.camera))
        state = next_state
    return torch.cat(maps)


# ---------------------------------------------------------------------------------------------
# The two forwards of teacher forcing


class RecordKV:
    """The clean K/V of the blocks committed so far, per layer: [B, frames * tokens, H, D], frames in order."""

    writes = True
    context_valid = None  # no context

    def __init__(self) -> None:
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def context(self, layer: int):
        return None

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer], self.v[layer] = k, v

    def append(self, block: "RecordKV") -> None:
        """Add one committed block's K/V after the frames already held."""
        for layer in block.k:
            if layer in self.k:
                self.k[layer] = torch.cat([self.k[layer], block.k[layer]], 1)
                self.v[layer] = torch.cat([self.v[layer], block.v[layer]], 1)
            else:
                self.k[layer], self.v[layer] = block.k[layer], block.v[layer]


class ReadKV:
    """Cache stand-in for a block's forward: the recorded K/V of its context frames, never written.

    The context has exactly the block's frames (its length varies with the block; training runs eager),
    where inference's kv_cache.BlockKV pads a fixed window and masks it: the results are equal."""

    writes = False
    context_valid = None  # every context token counts

    def __init__(self, record: RecordKV, frames: list[int], tokens_per_frame: int) -> None:
        self.record, self.frames, self.tokens = record, frames, tokens_per_frame

    def context(self, layer: int):
        if not self.frames:
            return None
        k, v = self.record.k[layer], self.record.v[layer]
        index = torch.cat([torch.arange(f * self.tokens, (f + 1) * self.tokens) for f in self.frames])
        return k[:, index], v[:, index]


def block_position(start: int, shift: int, config: ModelConfig) -> int:
    """RoPE start of the block at window frame `start` when the blocks after the sink move `shift`
    latent frames later: the sink stays at 0 .. sink_size-1, as in every session."""
    if shift < 0 or shift % config.transformer.num_frames_per_block:
        raise ValueError(f"shift must be a whole number of blocks >= 0, got {shift} latent frames")
    return start if start < config.transformer.sink_size else start + shift


def sampler_sigmas(config: ModelConfig, extra_flow_shifts: tuple[float, ...] = ()) -> torch.Tensor:
    """The sigmas the denoiser trains at: the preset's schedule, then those of each extra flow shift
    (`WorldTrainConfig.extra_flow_shifts`) that it does not already hold, in that order."""
    sigmas = list(config.sampler.sigmas())
    for shift in extra_flow_shifts:
        other = dataclasses.replace(config.sampler, flow_shift=shift).sigmas()
        sigmas += [s for s in other if all(abs(s - have) > 1e-9 for have in sigmas)]
    return torch.tensor(sigmas, dtype=torch.float32)


def motion_weights(x0: torch.Tensor, motion_weight: float) -> torch.Tensor:
    """[B, 1, F, h, w] loss weights: 1 + motion_weight * |x0_f - x0_(f-1)| (channel mean) / its batch mean.

    Frame 0 has no previous frame and weight 1. The weights follow the true latents, so a rollout batch
    (whose context is the model's own) is weighted as its teacher-forced twin."""
    change = torch.zeros_like(x0[:, :1])
    change[:, :, 1:] = (x0[:, :, 1:] - x0[:, :, :-1]).abs().mean(1, keepdim=True)
    return 1.0 + motion_weight * change / change.mean().clamp_min(1e-8)


def teacher_forced_loss(model: CausalLingBotWorldTransformer3DModel, config: ModelConfig, batch: dict,
                        text_kv, generator: torch.Generator, motion_weight: float = 0.0,
                        shift: int = 0, extra_flow_shifts: tuple[float, ...] = ()) -> torch.Tensor:
    """Mean squared x0 error of every block given the context latents in batch['context'], each
    position weighted by `motion_weights` (a plain mean when motion_weight is 0). `shift`: latent
    frames by which the blocks after the sink sit later in RoPE time (`block_position`).
    `extra_flow_shifts`: more sigmas each block's noise level is drawn from (`sampler_sigmas`).

    Block by block, as inference runs: a t=0 forward of the block's clean context latents reads the
    K/V its context frames recorded and records its own (the commit), and a forward of its noisy
    latents reads the same context (a denoise step). Gradients flow through the recorded K/V, so the
    commit forward learns to write a useful cache. Attending per block instead of through one masked
    sequence skips the masked-out pairs, most of them.
    """
    x0, context, extra, plucker = batch["latents"], batch["context"], batch["extra"], batch["plucker"]
    b, _, frames = x0.shape[:3]
    per_block = config.transformer.num_frames_per_block
    tokens = config.tokens_per_frame
    sigmas = sampler_sigmas(config, extra_flow_shifts)
    choice = torch.randint(len(sigmas), (b, frames // per_block), generator=generator)
    noise = torch.randn(x0.shape, generator=generator)
    weights = motion_weights(x0, motion_weight)
    record = RecordKV()
    losses = []
    for block, start in enumerate(range(0, frames, per_block)):
        own = slice(start, start + per_block)
        ctx = context_frames(start, config.transformer)
        reader = ReadKV(record, ctx, tokens)
        position = block_position(start, shift, config)
        sigma = sigmas[choice[:, block]]  # [B]
        s = sigma.view(b, 1, 1, 1, 1)
        x_t = (1.0 - s) * x0[:, :, own] + s * noise[:, :, own]
        v = model(torch.cat([x_t, extra[:, :, own]], 1), config.sampler.num_train_timesteps * sigma, text_kv,
                  plucker[:, own], position, cache=reader)
        weight = weights[:, :, own]
        error = ((x_t - s * v) - x0[:, :, own]).square()
        losses.append((weight * error).mean() / weight.mean())
        commit = _CommitKV(record, ctx, tokens)
        model(torch.cat([context[:, :, own], extra[:, :, own]], 1), torch.zeros(b), text_kv, plucker[:, own],
              position, cache=commit)
        record.append(commit)
    return torch.stack(losses).mean()


@torch.no_grad()
def rollout_context(model: CausalLingBotWorldTransformer3DModel, config: ModelConfig, batch: dict, text_kv,
                    generator: torch.Generator, shift: int = 0) -> torch.Tensor:
    """The model's own latents for every block, sampled as step_block does (4 steps, then a t=0 commit),
    the blocks after the sink `shift` latent frames later in RoPE time (`block_position`). Without the
    sampler's action guidance: the shipped weights were trained on unguided rollouts, and the model card's
    commands rebuild them only so."""
    extra, plucker = batch["extra"], batch["plucker"]
    b, _, frames = extra.shape[:3]
    per_block = config.transformer.num_frames_per_block
    tokens = config.tokens_per_frame
    shape = (b, config.transformer.out_channels, per_block, config.latent_height, config.latent_width)
    sigmas = config.sampler.sigmas()
    record = RecordKV()
    out = []
    for start in range(0, frames, per_block):
        own = slice(start, start + per_block)
        ctx = context_frames(start, config.transformer)
        position = block_position(start, shift, config)
        x = torch.randn(shape, generator=generator)
        for step, sigma in enumerate(sigmas):
            v = model(torch.cat([x, extra[:, :, own]], 1),
                      torch.full((b,), config.sampler.num_train_timesteps * sigma), text_kv, plucker[:, own],
                      position, cache=ReadKV(record, ctx, tokens))
            x0 = x - sigma * v
            if step + 1 < len(sigmas):
                x = (1.0 - sigmas[step + 1]) * x0 + sigmas[step + 1] * torch.randn(shape, generator=generator)
        commit = _CommitKV(record, ctx, tokens)
        model(torch.cat([x0, extra[:, :, own]], 1), torch.zeros(b), text_kv, plucker[:, own], position, cache=commit)
        record.append(commit)
        out.append(x0)
    return torch.cat(out, 2)


@torch.no_grad()
def own_rollouts(model: CausalLingBotWorldTransformer3DModel, config: ModelConfig, data: "WorldData",
                 count: int, seed: int, batch: int = ROLLOUT_BATCH, progress: bool = True) -> torch.Tensor:
    """[count, z, F, h, w] float16: the model's own latents of stored clips 0 .. count - 1, each rolled out
    once from its start frame and keys as a session rolls out (`rollout_context`), the prompt and the
    sampler's noise drawn from `seed`. training.vae --rollouts trains the decoder on them against the
    clips' true frames."""
    model.eval()
    texts = text_states(config)
    generator = torch.Generator().manual_seed(seed)
    out = []
    for start in tqdm(range(0, count, batch), desc="rollouts", unit="batch", disable=not progress):
        items = data.items(list(range(start, min(start + batch, count))))
        prompt = torch.randint(len(PROMPTS), (1,), generator=generator).item()
        text_kv = model.prepare_text(texts[prompt:prompt + 1].expand(len(items["extra"]), -1, -1))
        out.append(rollout_context(model, config, items, text_kv, generator).half())
    return torch.cat(out)


class _CommitKV(RecordKV):
    """Reads the block's context like ReadKV and records the block's own K/V like RecordKV."""

    def __init__(self, record: RecordKV, frames: list[int], tokens: int) -> None:
        super().__init__()
        self.reader = ReadKV(record, frames, tokens)

    def context(self, layer: int):
        return self.reader.context(layer)


# ---------------------------------------------------------------------------------------------
# Run


class WorldData:
    """Latents, conditions, Plücker maps and masks of the stored clips, in memory."""

    def __init__(self, tc: WorldTrainConfig, config: ModelConfig, vae: AutoencoderKLWan, run_dir: Path) -> None:
        @functools.cache
        def stored() -> StoredClips:  # read once, only if something must be encoded
            return StoredClips(tc.clips_dir, tc.stored_clips)

        parts = [cached_encoding(run_dir / name, vae, config, stored, tc.stored_clips, tc.blocks, mirrored)
                 for name, mirrored in ((LATENTS, False), (MIRRORED_LATENTS, True))[: 2 if tc.mirror else 1]]
        # Clips 0 .. N-1 are the stored clips, N .. 2N-1 their mirror images (with --mirror).
        encoded = {key: torch.cat([part[key] for part in parts]) for key in parts[0]}
        self.latents, self.conditions = encoded["latents"], encoded["conditions"]
        # Filled in place: a list of maps stacked at the end would hold every map twice at its peak (6.6 MB
        # a clip at 96x160 and 6 blocks; 860 clips and their mirror images ran a 24 GB host out of memory).
        frames = tc.blocks * config.transformer.num_frames_per_block
        self.plucker = torch.empty(len(encoded["actions"]), frames, 6, config.height, config.width)
        for index, (a, pose) in enumerate(tqdm(zip(encoded["actions"], encoded["start_poses"]),
                                               total=len(encoded["actions"]), desc="cameras", unit="clip")):
            self.plucker[index] = block_pluckers(config, array_to_actions(a.numpy()), tc.blocks,
                                                 start_state(pose.numpy()))
        # The condition mask of each block, as step_block builds it: ones on latent frame 0 only.
        self.mask = torch.cat([condition_mask(config, b, "cpu", torch.float32) for b in range(tc.blocks)], 2)

    def batch(self, tc: WorldTrainConfig, step: int) -> dict:
        return self.items([int(np.random.default_rng([tc.data_seed, 11, j]).integers(len(self.latents)))
                           for j in range(step * tc.batch, (step + 1) * tc.batch)])

    def items(self, index: list[int]) -> dict:
        latents = self.latents[index]
        extra = torch.cat([self.mask.expand(len(index), -1, -1, -1, -1), self.conditions[index]], 1)
        return {"latents": latents, "context": latents, "extra": extra, "plucker": self.plucker[index]}


def text_states(config: ModelConfig) -> torch.Tensor:
    """[len(PROMPTS), Ltext, text_dim] from the embedded (seeded, frozen) text encoder."""
    encoder = build_seeded_parts(config, config.weights_seed, dtype=torch.float32).text_encoder
    return torch.cat([encoder.encode(p) for p in PROMPTS])


def new_model(config: ModelConfig, seed: int) -> CausalLingBotWorldTransformer3DModel:
    model = CausalLingBotWorldTransformer3DModel(config.transformer)
    model.init_weights(torch.Generator().manual_seed(seed))
    return model.train()


def load_exported_weights(model: CausalLingBotWorldTransformer3DModel, folder: str | Path) -> None:
    """Load FOLDER/transformer/ (as export_transformer writes it) into the fp32 model through the
    checkpoint loader's own plan and reader: every name and shape is checked before any weight is read."""
    subfolder = Path(folder).expanduser() / "transformer"
    if not subfolder.is_dir():
        raise ValueError(f"--init-from {folder}: {subfolder} does not exist (give a folder holding transformer/)")
    try:
        plan = plan_transformer_shards(subfolder, model)
    except CheckpointError as error:
        raise ValueError(f"--init-from {folder}: the weights do not fit the embedded preset: {error}") from error
    load_transformer_shards(model, plan, dtype=torch.float32, device="cpu")
    model.train().requires_grad_(True)  # the loader leaves an inference module


def save_checkpoint(run_dir: Path, tc: WorldTrainConfig, step: int, model, optimizer, generator,
                    average: WeightAverage | None = None) -> None:
    state = {"format": CHECKPOINT_FORMAT, "train_config": dataclasses.asdict(tc), "step": step,
             "model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": generator.get_state()}
    if average is not None:
        state[AVERAGE_KEY] = average.weights
    save_atomically(state, run_dir / CHECKPOINT)


def load_checkpoint(run_dir: Path, tc: WorldTrainConfig | None = None) -> tuple[WorldTrainConfig, dict]:
    path = run_dir / CHECKPOINT
    state = torch.load(path, map_location="cpu", weights_only=True)
    if state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path} is not a training.world checkpoint of format {CHECKPOINT_FORMAT}")
    saved = WorldTrainConfig(**state["train_config"])
    # May change on resume: the curriculum, the loss weighting and the schedule's end are decided as
    # the run goes.
    # The mirror images add data beside the stored clips, so a run may take them up on resume; so may
    # the position shift its batches.
    ignore = {"rollout_from", "rollout_share", "lr_decay_from", "lr_final", "motion_weight", "mirror",
              "position_shift_share", "position_shift_blocks", "ema_decay"}
    if tc is not None:
        diff = {k: (v, getattr(tc, k)) for k, v in dataclasses.asdict(saved).items()
                if k not in ignore and getattr(tc, k) != v}
        # More stored clips may join a run on resume (their encodings are appended to the cache);
        # fewer would silently drop data the run was trained on.
        if "stored_clips" in diff and tc.stored_clips > saved.stored_clips:
            del diff["stored_clips"]
        if diff:
            raise ValueError(f"{path} was trained with other settings (checkpoint, asked): {diff}")
    return saved, state


def train(tc: WorldTrainConfig, run_dir: Path, steps: int, checkpoint_every: int = 25,
          progress: bool = True) -> CausalLingBotWorldTransformer3DModel:
    run_dir.mkdir(parents=True, exist_ok=True)
    # A resume under refused settings stops here, before any clip is encoded for it.
    state = load_checkpoint(run_dir, tc)[1] if (run_dir / CHECKPOINT).exists() else None
    vae = load_vae(tc.vae)
    config = model_config(vae)
    check_streamable(vae, config)
    data = WorldData(tc, config, vae, run_dir)
    texts = text_states(config)
    model = new_model(config, tc.seed)
    if tc.init_from:
        load_exported_weights(model, tc.init_from)
    optimizer = torch.optim.AdamW(model.parameters(), lr=tc.lr, weight_decay=tc.weight_decay, betas=(0.9, 0.99))
    generator = torch.Generator().manual_seed(tc.seed)
    step = 0
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        generator.set_state(state["rng"])
        step = state["step"]
        trim_log(run_dir / LOG, step)
    average = None
    if tc.ema_decay > 0.0:
        average = WeightAverage.start(model, tc.ema_decay, state.get(AVERAGE_KEY) if state is not None else None)
    bar = tqdm(total=steps, initial=step, unit="step", disable=not progress, dynamic_ncols=True)
    started = time.perf_counter()
    with open(run_dir / LOG, "a") as log:
        while step < steps:
            batch = data.batch(tc, step)
            shift = tc.position_shift(step, config.transformer.num_frames_per_block)
            prompt = torch.randint(len(PROMPTS), (1,), generator=generator).item()
            use_rollout = tc.rollout_from >= 0 and step >= tc.rollout_from and \
                torch.rand(1, generator=generator).item() < tc.rollout_share
            model.train()
            text_kv = model.prepare_text(texts[prompt:prompt + 1].expand(tc.batch, -1, -1))
            if use_rollout:
                model.eval()
                batch["context"] = rollout_context(model, config, batch, text_kv, generator, shift).detach()
                model.train()
                text_kv = model.prepare_text(texts[prompt:prompt + 1].expand(tc.batch, -1, -1))
            loss = teacher_forced_loss(model, config, batch, text_kv, generator, tc.motion_weight, shift,
                                       tc.extra_flow_shifts)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"non-finite loss at step {step}; lower --lr (the checkpoint is kept)")
            for group in optimizer.param_groups:
                group["lr"] = tc.learning_rate(step, steps)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            if average is not None:
                average.update(model)
            step += 1
            record = {"step": step, "loss": round(loss.item(), 6), "rollout": use_rollout, "shift": shift,
                      "lr": optimizer.param_groups[0]["lr"],
                      "seconds": round(time.perf_counter() - started, 2)}
            log.write(json.dumps(record) + "\n")
            bar.set_postfix(loss=record["loss"])
            bar.update(1)
            if step % checkpoint_every == 0 or step == steps:
                log.flush()
                save_checkpoint(run_dir, tc, step, model, optimizer, generator, average)
    bar.close()
    return model


def export_transformer(run_dir: Path, out: Path) -> Path:
    """OUT/transformer/: config.json (the diffusers keys) and fp16 safetensors."""
    from safetensors.torch import save_file

    tc, state = load_checkpoint(run_dir)
    config = model_config(load_vae(tc.vae))
    folder = out / "transformer"
    folder.mkdir(parents=True, exist_ok=True)
    weights = {k: v.to(torch.float16).contiguous() for k, v in exported_weights(state)[0].items()}
    save_file(weights, folder / "diffusion_pytorch_model.safetensors")
    raw = {"_class_name": "CausalLingBotWorldTransformer3DModel", **config.transformer.to_diffusers_config()}
    (folder / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return folder


def write_rollouts(args: argparse.Namespace, run_dir: Path, out: Path) -> None:
    """--rollouts: the clips' encodings are cached in run_dir as a training run caches them."""
    tc = WorldTrainConfig(vae=str(Path(args.vae).expanduser()), clips_dir=str(Path(args.clips_dir).expanduser()),
                          stored_clips=args.stored_clips, blocks=args.blocks, seed=args.seed,
                          init_from=str(Path(args.init_from).expanduser()))
    run_dir.mkdir(parents=True, exist_ok=True)
    vae = load_vae(tc.vae)
    config = model_config(vae)
    data = WorldData(tc, config, vae, run_dir)
    model = new_model(config, tc.seed)
    load_exported_weights(model, tc.init_from)
    latents = own_rollouts(model, config, data, tc.stored_clips, tc.seed)
    # Beside them the encoder's latents of the same clips, which the decoder run decodes for its other
    # items, and the statistics both are normalised by (the decoder run checks its VAE has the same).
    save_atomically({"format": ROLLOUTS_FORMAT, "latents": latents, "encoded": data.latents[: tc.stored_clips],
                     "latents_mean": list(vae.config.latents_mean), "latents_std": list(vae.config.latents_std),
                     "model": tc.init_from, "vae": tc.vae, "clips_dir": tc.clips_dir, "blocks": tc.blocks,
                     "seed": tc.seed}, out)
    print(f"{len(latents)} rollouts of {tc.blocks} blocks -> {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = WorldTrainConfig(vae="", clips_dir="", stored_clips=1)
    parser.add_argument("--vae", help="exported VAE folder (holds config.json)")
    parser.add_argument("--clips-dir")
    parser.add_argument("--stored-clips", type=int, default=0)
    parser.add_argument("--steps", type=int, default=0)
    parser.add_argument("--blocks", type=int, default=d.blocks)
    parser.add_argument("--batch", type=int, default=d.batch)
    parser.add_argument("--lr", type=float, default=d.lr)
    parser.add_argument("--weight-decay", type=float, default=d.weight_decay)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--data-seed", type=int, default=d.data_seed)
    parser.add_argument("--rollout-from", type=int, default=d.rollout_from)
    parser.add_argument("--rollout-share", type=float, default=d.rollout_share)
    parser.add_argument("--lr-decay-from", type=int, default=d.lr_decay_from,
                        help="step from which the rate falls linearly to lr * --lr-final at --steps")
    parser.add_argument("--lr-final", type=float, default=d.lr_final)
    parser.add_argument("--motion-weight", type=float, default=d.motion_weight,
                        help="extra loss weight where the true latents change between frames (0: plain MSE)")
    parser.add_argument("--mirror", action="store_true",
                        help="also train on each clip's mirror image (A<->D, J<->L swapped)")
    parser.add_argument("--init-from", default="", metavar="MODEL_DIR",
                        help="start from MODEL_DIR/transformer/'s weights (an exported model folder) with a fresh optimizer")
    parser.add_argument("--position-shift-share", type=float, default=d.position_shift_share,
                        help="share of batches whose blocks after the sink sit later in RoPE time, as in a long session")
    parser.add_argument("--position-shift-blocks", type=int, default=d.position_shift_blocks,
                        help="the largest such shift, in blocks (drawn uniformly from 1 up)")
    parser.add_argument("--extra-flow-shifts", type=float, nargs="*", default=list(d.extra_flow_shifts),
                        metavar="SHIFT", help="also train at the sigmas of the sampler's timesteps under these "
                        "flow shifts (the rollouts keep the preset's own schedule)")
    parser.add_argument("--ema-decay", type=float, default=d.ema_decay,
                        help="keep an average of the weights (per-step decay, e.g. 0.998) and export it; 0: none")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--checkpoint-every", type=int, default=25)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--export", metavar="DIR", help="write DIR/transformer/ from the run's checkpoint and stop")
    parser.add_argument("--rollouts", metavar="OUT",
                        help="write OUT: the --init-from model's own latents of every stored clip, and stop")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    run_dir = Path(args.run_dir).expanduser()
    try:
        if args.export:
            print(export_transformer(run_dir, Path(args.export)))
            return
        if args.rollouts:
            if not (args.vae and args.clips_dir and args.stored_clips and args.init_from):
                parser.error("--rollouts needs --vae, --clips-dir, --stored-clips and --init-from (the model)")
            write_rollouts(args, run_dir, Path(args.rollouts).expanduser())
            return
        if not (args.vae and args.clips_dir and args.stored_clips and args.steps):
            parser.error("--vae, --clips-dir, --stored-clips and --steps are required to train")
        tc = WorldTrainConfig(vae=str(Path(args.vae).expanduser()), clips_dir=str(Path(args.clips_dir).expanduser()),
                              stored_clips=args.stored_clips, blocks=args.blocks, batch=args.batch, lr=args.lr,
                              weight_decay=args.weight_decay, seed=args.seed, data_seed=args.data_seed,
                              rollout_from=args.rollout_from, rollout_share=args.rollout_share,
                              lr_decay_from=args.lr_decay_from, lr_final=args.lr_final,
                              motion_weight=args.motion_weight, mirror=args.mirror,
                              position_shift_share=args.position_shift_share,
                              position_shift_blocks=args.position_shift_blocks,
                              extra_flow_shifts=args.extra_flow_shifts,  # made a tuple by the config
                              ema_decay=args.ema_decay,
                              init_from=str(Path(args.init_from).expanduser()) if args.init_from else "")
        print(f"run {run_dir}")
        train(tc, run_dir, args.steps, args.checkpoint_every)
    except (ValueError, FloatingPointError) as error:
        parser.exit(2, f"error: {error}\n")


if __name__ == "__main__":
    main()
