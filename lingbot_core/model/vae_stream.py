"""Streaming condition encoder and decoder over diffusers' `AutoencoderKLWan` (Wan 2.1 VAE).

A patched VAE (`patch_size`, pixels folded into channels before the encoder and unfolded after the
decoder, as diffusers' `_encode` / `_decode` do) streams the same way: patching is per frame, so each
chunk is patched on its own.

The VAE is causal in time: every causal conv keeps the last frames it saw (its "feature cache").
diffusers keeps that cache on the module (`_enc_feat_map`, `_feat_map`) and clears it around each
call. Here the cache belongs to the caller (a session), so one VAE serves many sessions and a block
can be retried: each call copies the committed cache list, lets the VAE write new tensors into the
copy, and returns it as a *pending* state. The caller keeps the pending state only when the whole
block succeeded; otherwise it keeps the committed one, which no call ever mutates.

We drive the VAE's own sub-modules (`encoder`, `quant_conv`, `post_quant_conv`, `decoder`) with
the same chunking as `AutoencoderKLWan._encode` / `_decode`, so streaming equals one-shot.

Public API
----------
- `build_vae(model_config, dtype, device, seed=None) -> AutoencoderKLWan`
- `check_streamable(vae, model_config=None)`: raises `VaeNotStreamableError` (a ValueError).
- `ConditionStream.start(image)`: condition encoder state of a session; `image` is [1, 3, H, W]
  in [-1, 1]. `encode_condition_block(vae, state, block_index, model_config) -> (cond, pending)`
  with `cond` [1, z_dim, num_frames_per_block, h, w], normalised per channel.
- `condition_mask(model_config, block_index, device, dtype) -> [1, mask_channels, F, h, w]`.
- `DecoderStream()`: decoder state of a session.
  `decode_block(vae, state, latents, decode_frame=decode_latent_frame) -> (frames, pending)`
  with `latents` [1, z_dim, F, h, w] normalised and `frames` [1, 3, T, H, W] in [-1, 1].
- `decode_latent_frame(vae, x, cache, first_chunk)`: decoder step for one latent frame;
  `compile_frame_decoder(**options)` returns a `torch.compile`d version to pass as `decode_frame`.
- Both states report `nbytes()`: bytes of the tensor storage they hold.

Commit protocol: `cond, pending = encode_condition_block(vae, state, k, cfg)`; when block k has
fully succeeded the caller replaces `state` with `pending`; on failure it drops `pending`. States
are frozen dataclasses; their cache lists are never written after they are returned.

Condition fixed point: after the image, the encoder only sees zero frames and its memory is
finite, so its cache eventually reproduces itself exactly. When a block ends with the same cache
it started with, every later block would produce the same condition: the state then keeps only
that condition (`fixed=True`), frees the cache, and later blocks cost no encoding. The test is
exact (`torch.equal` on every slot), so a backend whose convolutions are not bit-reproducible
simply never reaches the fixed point: it keeps encoding, and the results stay correct.
Returned tensors (conditions, frames) are shared with the state: treat them as read-only.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from diffusers import AutoencoderKLWan
from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d, patchify, unpatchify

from lingbot_core.config import ModelConfig
from lingbot_core.model.cpu_kernels import use_fast_cpu_kernels
from lingbot_core.model.held_bytes import held_bytes

# `AutoencoderKLWan._encode` slices pixel frames into chunks of this many frames (a literal in
# diffusers), so only a VAE whose temporal factor equals it encodes one latent frame per chunk.
DIFFUSERS_ENCODE_CHUNK_FRAMES = 4

# One feature-cache slot: a tensor of recent frames, None (nothing seen yet) or the string "Rep"
# (a temporal upsampler that has seen only the first chunk: pad with zeros next time).
CacheEntry = torch.Tensor | str | None
FeatureCache = list[CacheEntry]
FrameDecoder = Callable[[AutoencoderKLWan, torch.Tensor, FeatureCache, bool], torch.Tensor]


class VaeNotStreamableError(ValueError):
    """The VAE (or its pairing with the model config) cannot be driven block by block."""


class StreamOrderError(ValueError):
    """A block was requested out of order for a stream state."""


def build_vae(model_config: ModelConfig, dtype: torch.dtype, device: torch.device | str,
              seed: int | None = None) -> AutoencoderKLWan:
    """An `AutoencoderKLWan` from `model_config.vae`, in eval mode without gradients.

    Its convolutions and norms use the CPU kernels of `cpu_kernels.py` (a no-op on CUDA).
    With `seed`, the weights are the module's default init drawn from that seed (the global RNG is
    left untouched); without it, they come from the global RNG and are meant to be overwritten.
    """
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        vae = AutoencoderKLWan(**model_config.vae)
    # nn.Module.to, not ModelMixin.to: the latter warns about fp32-kept modules even though this
    # class keeps none (its list is empty), on every build.
    torch.nn.Module.to(vae, device=device, dtype=dtype)
    use_fast_cpu_kernels(vae)
    return vae.eval().requires_grad_(False)


def check_streamable(vae: AutoencoderKLWan, model_config: ModelConfig | None = None) -> None:
    """Refuse VAEs whose caching differs from the Wan 2.1 path (plain or patched) this module replays."""
    cfg = vae.config
    if vae.use_tiling:
        raise VaeNotStreamableError(
            "VAE tiling is enabled (vae.use_tiling); tiled encode/decode keeps one cache per tile and "
            "cannot be streamed: call vae.disable_tiling()")
    patch = _patch_size(vae)
    if patch < 1 or cfg.in_channels != 3 * patch * patch or cfg.out_channels != 3 * patch * patch:
        raise VaeNotStreamableError(
            f"VAE patch_size={cfg.patch_size} with in_channels={cfg.in_channels}, out_channels={cfg.out_channels}: "
            f"RGB frames need {3 * max(patch, 1) ** 2} of each")
    if cfg.is_residual:
        raise VaeNotStreamableError("residual VAE (config.is_residual=True, the Wan 2.2 VAE) is not supported")
    temporal_factor = 2 ** sum(bool(d) for d in cfg.temperal_downsample)
    if temporal_factor != DIFFUSERS_ENCODE_CHUNK_FRAMES:
        raise VaeNotStreamableError(
            f"VAE temporal factor is {temporal_factor} (temperal_downsample={list(cfg.temperal_downsample)}); "
            f"diffusers encodes chunks of {DIFFUSERS_ENCODE_CHUNK_FRAMES} frames, so exactly two levels must "
            "downsample in time")
    if model_config is None:
        return
    spatial_factor = 2 ** (len(cfg.dim_mult) - 1) * patch
    if model_config.vae_temporal_factor != temporal_factor:
        raise VaeNotStreamableError(
            f"model config vae_temporal_factor={model_config.vae_temporal_factor} but the VAE's is {temporal_factor}")
    if model_config.vae_spatial_factor != spatial_factor:
        raise VaeNotStreamableError(
            f"model config vae_spatial_factor={model_config.vae_spatial_factor} but the VAE's is {spatial_factor}")
    if model_config.transformer.out_channels != cfg.z_dim:
        raise VaeNotStreamableError(
            f"transformer out_channels={model_config.transformer.out_channels} but VAE z_dim={cfg.z_dim}")


# ---------------------------------------------------------------------------------------------
# Small helpers


def _new_cache(module: torch.nn.Module) -> FeatureCache:
    """One empty slot per causal conv, as `AutoencoderKLWan.clear_cache` sizes it."""
    return [None] * sum(isinstance(m, WanCausalConv3d) for m in module.modules())


def _latent_stats(vae: AutoencoderKLWan, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel latents_mean / latents_std from the VAE config, shaped [1, z_dim, 1, 1, 1]."""
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean, dtype=like.dtype, device=like.device).view(shape)
    std = torch.tensor(vae.config.latents_std, dtype=like.dtype, device=like.device).view(shape)
    return mean, std


def _caches_equal(a: FeatureCache, b: FeatureCache) -> bool:
    """Exact equality: same None / "Rep" structure and bit-equal tensors (shapes included)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True


def _vae_param(vae: AutoencoderKLWan) -> torch.Tensor:
    return next(vae.parameters())


def _patch_size(vae: AutoencoderKLWan) -> int:
    """Pixels per side of a patch folded into channels before the encoder (diffusers' `patchify`), 1 for
    the Wan 2.1 VAE. A patched VAE's full-resolution work happens at 1/patch of the frame size."""
    return vae.config.patch_size or 1


# ---------------------------------------------------------------------------------------------
# Condition encoder


@dataclass(frozen=True)
class ConditionStream:
    """A session's condition-encoder state after `next_block` blocks.

    image:     [1, 3, 1, H, W] pixel frame 0; held only until block 0 has been encoded.
    history:   the encoder's feature cache; None before block 0 and once `fixed`.
    condition: [1, z_dim, F, h, w] the last encoded block (normalised); None before block 0.
    fixed:     the history reproduced itself, so `condition` is every later block's condition.
    """

    image: torch.Tensor | None
    history: FeatureCache | None
    condition: torch.Tensor | None
    next_block: int
    fixed: bool = False
    shared: SharedCondition | None = None  # set: the blocks come from this shared stream, nothing is private

    @classmethod
    def start(cls, image: torch.Tensor) -> ConditionStream:
        if image.ndim != 4 or image.shape[0] != 1 or image.shape[1] != 3:
            raise ValueError(f"condition image must be [1, 3, H, W]; got {list(image.shape)}")
        if not image.is_floating_point():
            raise ValueError(f"condition image must be floating point in [-1, 1]; got {image.dtype}")
        # Once per session, so the host sync is cheap; catches images left in [0, 1] or [0, 255].
        if not torch.isfinite(image).all() or image.abs().max() > 1.0 + 1e-3:
            raise ValueError("condition image must hold finite values in [-1, 1]")
        # A private copy: the caller's tensor may change or be a view of a larger batch.
        return cls(image=image.unsqueeze(2).clone(), history=None, condition=None, next_block=0)  # [1, 3, 1, H, W]

    @classmethod
    def reading(cls, shared: SharedCondition) -> ConditionStream:
        """A session's stream that reads its blocks from `shared` (computing each only if no one has)."""
        return cls(image=None, history=None, condition=None, next_block=0, shared=shared)

    def nbytes(self) -> int:
        """Bytes this state holds privately; a shared stream's blocks are counted once, by its cache."""
        return held_bytes([self.image, self.condition, *(self.history or [])])


class SharedCondition:
    """The condition blocks of one start image, encoded once and read by every session that starts from it.

    The condition stream is a function of the start image alone (not of keys, prompt or seed), and until the
    encoder reaches its fixed point every block costs a full encoder pass. Blocks are computed in order by
    whichever session first needs them and kept; `frontier` is the encoder state after the last one and is
    dropped at the fixed point, after which the last block stands for every later one. A failed encode
    leaves it as it was. Appending a correct block is not a session's state change, so a session whose
    own block later fails leaves the shared stream as it is.
    """

    def __init__(self, image: torch.Tensor) -> None:
        self._frontier: ConditionStream | None = ConditionStream.start(image)
        self._blocks: list[torch.Tensor] = []
        self._lock = threading.Lock()  # sessions of one engine step on one thread; scripts may not
        self.encoded = 0  # encoder passes run (each block once)
        # Kept current under the lock, read without it: admission and telemetry must never wait for an
        # encoder pass (seconds on a CPU) that another session is running.
        self._nbytes = self._count_bytes()

    @property
    def fixed(self) -> bool:
        return self._frontier is None

    @property
    def blocks_known(self) -> int:
        return len(self._blocks)

    def block(self, vae: AutoencoderKLWan, block_index: int, model_config: ModelConfig) -> torch.Tensor:
        with self._lock:
            if block_index < len(self._blocks):
                return self._blocks[block_index]
            if self._frontier is None:  # fixed point: every later block is the last one
                return self._blocks[-1]
            condition, frontier = encode_condition_block(vae, self._frontier, block_index, model_config)
            self.encoded += 1
            self._blocks.append(condition)
            self._frontier = None if frontier.fixed else frontier
            self._nbytes = self._count_bytes()
            return condition

    def nbytes(self) -> int:
        """Bytes held (blocks so far and the encoder frontier); never waits for a running encode."""
        return self._nbytes

    def _count_bytes(self) -> int:
        frontier = self._frontier
        return held_bytes([*self._blocks, *([frontier.image, frontier.condition, *(frontier.history or [])]
                                             if frontier is not None else [])])


def _condition_pixel_chunks(vae: AutoencoderKLWan, state: ConditionStream, block_index: int,
                            model_config: ModelConfig, like: torch.Tensor) -> list[torch.Tensor]:
    """The pixel chunks of one block, as `_encode` slices them: block 0 = image + zero groups."""
    group = model_config.vae_temporal_factor
    latent_frames = model_config.transformer.num_frames_per_block
    size = (model_config.height, model_config.width)
    patch = _patch_size(vae)
    # Zero frames, already in the encoder's (patched) layout: a patched zero frame is zeros.
    zeros = torch.zeros(1, vae.config.in_channels, group, size[0] // patch, size[1] // patch, dtype=like.dtype,
                        device=like.device)
    if block_index > 0:
        return [zeros] * latent_frames  # the encoder never writes into its input
    if tuple(state.image.shape[-2:]) != size:
        raise ValueError(f"condition image is {tuple(state.image.shape[-2:])} (HxW) but the model runs at {size}")
    # The causal VAE maps pixel frame 0 alone to latent frame 0.
    image = patchify(state.image.to(dtype=like.dtype, device=like.device), patch)
    return [image] + [zeros] * (latent_frames - 1)


@torch.no_grad()
def encode_condition_block(vae: AutoencoderKLWan, state: ConditionStream, block_index: int,
                           model_config: ModelConfig) -> tuple[torch.Tensor, ConditionStream]:
    """Condition latents of block `block_index` and the pending state after it.

    Equals frames [F*k, F*(k+1)) of `vae.encode([image, 0, 0, ...]).latent_dist.mean`, normalised
    with the VAE's latents_mean / latents_std. `state` is not modified.
    """
    if block_index != state.next_block:
        raise StreamOrderError(f"condition stream expects block {state.next_block}, got block {block_index}")
    if state.shared is not None:
        return state.shared.block(vae, block_index, model_config), dataclasses.replace(state, next_block=block_index + 1)
    if state.fixed:
        # Fixed point: the encoder would reproduce the same history and the same latents.
        return state.condition, dataclasses.replace(state, next_block=block_index + 1)
    check_streamable(vae, model_config)

    like = _vae_param(vae)
    history = list(state.history) if state.history is not None else _new_cache(vae.encoder)
    latents = []
    for chunk in _condition_pixel_chunks(vae, state, block_index, model_config, like):
        # A fresh conv index per chunk, as in `_encode`; the VAE assigns new tensors into `history`.
        latents.append(vae.encoder(chunk, feat_cache=history, feat_idx=[0]))
    moments = vae.quant_conv(torch.cat(latents, dim=2))  # [1, 2*z_dim, F, h, w]: mean, logvar
    mean, std = _latent_stats(vae, moments)
    condition = (moments[:, : vae.config.z_dim] - mean) / std  # [1, z_dim, F, h, w]

    fixed = state.history is not None and _caches_equal(state.history, history)
    pending = ConditionStream(image=None, history=None if fixed else history, condition=condition,
                              next_block=block_index + 1, fixed=fixed)
    return condition, pending


def condition_mask(model_config: ModelConfig, block_index: int, device: torch.device | str,
                   dtype: torch.dtype) -> torch.Tensor:
    """[1, mask_channels, F, h, w]: 1 on every mask channel of the rollout's latent frame 0, else 0."""
    mask = torch.zeros(1, model_config.transformer.mask_channels, model_config.transformer.num_frames_per_block,
                       model_config.latent_height, model_config.latent_width, device=device, dtype=dtype)
    if block_index == 0:
        mask[:, :, 0] = 1
    return mask


# ---------------------------------------------------------------------------------------------
# Decoder


@dataclass(frozen=True)
class DecoderStream:
    """A session's decoder state: the feature cache after `latent_frames_decoded` latent frames."""

    cache: FeatureCache | None = None
    latent_frames_decoded: int = 0

    @property
    def started(self) -> bool:
        return self.latent_frames_decoded > 0

    def nbytes(self) -> int:
        return held_bytes(self.cache or [])


def decode_latent_frame(vae: AutoencoderKLWan, x: torch.Tensor, cache: FeatureCache,
                        first_chunk: bool) -> torch.Tensor:
    """Decode one post-quant latent frame [1, z_dim, 1, h, w], updating `cache` in place.

    Returns [1, 3, 1, H, W] for the rollout's first frame, [1, 3, temporal_factor, H, W] after.
    """
    return vae.decoder(x, feat_cache=cache, feat_idx=[0], first_chunk=first_chunk)


def standardise_cache_strides(cache: FeatureCache) -> None:
    """Some cache entries are views whose (size-1) batch stride depends on how many frames the tensor
    they were cut from had, in eager and in a compiled step's outputs alike. The values do not care, but
    a compiled step guards on its inputs' strides and would build a new graph each time one changes:
    copies with standard strides keep one graph. Compiled paths call it just before the compiled step
    (outside it, so it sees the real strides); eager needs no copies."""
    for index, entry in enumerate(cache):
        if isinstance(entry, torch.Tensor) and entry.stride() != _standard_strides(entry.shape):
            cache[index] = entry.clone(memory_format=torch.contiguous_format)


def _standard_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def compile_frame_decoder(**compile_options: Any) -> FrameDecoder:
    """`decode_latent_frame` under `torch.compile` (static shapes); pass it to `decode_block`.

    Recompiles only while the cache fills: the first frame, the second, then it is stable.
    """
    compile_options.setdefault("dynamic", False)
    compiled = torch.compile(decode_latent_frame, **compile_options)

    def step(vae: AutoencoderKLWan, x: torch.Tensor, cache: FeatureCache, first_chunk: bool) -> torch.Tensor:
        standardise_cache_strides(cache)
        return compiled(vae, x, cache, first_chunk)

    return step


@torch.no_grad()
def decode_block(vae: AutoencoderKLWan, state: DecoderStream, latents: torch.Tensor,
                 decode_frame: FrameDecoder = decode_latent_frame,
                 on_frames: Callable[[torch.Tensor], None] | None = None) -> tuple[torch.Tensor, DecoderStream]:
    """Decode normalised latents [1, z_dim, F, h, w] to frames [1, 3, T, H, W] in [-1, 1].

    T = 1 + 4 (F - 1) for the rollout's first block and 4 F after; equals the matching slice of
    one-shot `vae.decode(latents * std + mean)`. `state` is not modified. on_frames: called with each latent
    frame's pixel frames [1, 3, n, H, W] as soon as they are decoded (the same values as their slice of the
    result), so a viewer can be shown them before the block's last frame is done.
    """
    check_streamable(vae)
    if latents.ndim != 5 or latents.shape[0] != 1 or latents.shape[1] != vae.config.z_dim:
        raise ValueError(f"latents must be [1, {vae.config.z_dim}, F, h, w]; got {list(latents.shape)}")
    if latents.shape[2] == 0:
        raise ValueError("latents hold no frames")

    like = _vae_param(vae)
    latents = latents.to(dtype=like.dtype, device=like.device)
    mean, std = _latent_stats(vae, latents)
    x = vae.post_quant_conv(latents * std + mean)  # [1, z_dim, F, h, w]

    cache = list(state.cache) if state.cache is not None else _new_cache(vae.decoder)
    frames = []
    for i in range(x.shape[2]):
        # As `_decode` passes it; only the residual (Wan 2.2) up-blocks read the flag, the 2.1 path
        # handles the first frame through its "Rep" cache slots.
        first_chunk = not state.started and i == 0
        frames.append(decode_frame(vae, x[:, :, i : i + 1], cache, first_chunk))
        if on_frames is not None:  # per frame, as the whole is made below: unpatchify works frame by frame
            on_frames(unpatchify(frames[-1], _patch_size(vae)).clamp(-1.0, 1.0))
    # [1, 3, T, H, W]; a patched VAE's decoder returns [1, 3 * patch^2, T, H / patch, W / patch]
    out = unpatchify(torch.cat(frames, dim=2), _patch_size(vae)).clamp(-1.0, 1.0)
    pending = DecoderStream(cache=cache, latent_frames_decoded=state.latent_frames_decoded + x.shape[2])
    return out, pending


# ---------------------------------------------------------------------------------------------
# State sizes, measured on a small frame


@dataclass(frozen=True)
class StreamBytes:
    """Peak bytes of one session's condition and decoder states, and the most pixel frames a block decodes."""

    condition: int
    decoder: int
    pixel_frames: int


def probe_stream_bytes(vae: AutoencoderKLWan, model_config: ModelConfig, blocks: int = 2) -> StreamBytes:
    """Peak bytes of the condition and decoder states over `blocks` blocks at the model's frame size.

    Every tensor these states hold (the frame, feature-cache slots, condition latents) is [.., H / 2^l,
    W / 2^l] at some level l of the VAE, and the Wan VAE halves even sizes exactly, so their bytes are
    proportional to the frame's area. The probe therefore streams real blocks through the real VAE on
    the smallest frame the config allows and scales by the ratio of the areas: the same figures as streaming full frames (tests/test_session.py checks it) at a
    negligible cost, where two full blocks took 19 s on a 2-core AVX2 CPU. Two blocks suffice: block 0
    fills the caches, block 1 is the first full-length one, later ones hold the same shapes or less.
    """
    # The smallest frame a model config accepts: one square of its size step (the VAE factor times the patch).
    step = model_config.vae_spatial_factor * math.prod(model_config.transformer.patch_size[1:])
    small = dataclasses.replace(model_config, height=step, width=step)
    scale = (model_config.height // step) * (model_config.width // step)  # exact: sizes are multiples of step
    like = _vae_param(vae)
    image = torch.zeros(1, 3, small.height, small.width, dtype=like.dtype, device=like.device)
    condition, decoder = ConditionStream.start(image), DecoderStream()
    latents = torch.zeros(1, vae.config.z_dim, small.transformer.num_frames_per_block, small.latent_height,
                          small.latent_width, dtype=like.dtype, device=like.device)
    peak_condition, peak_decoder, pixel_frames = condition.nbytes(), 0, 0
    # Hundreds of tiny kernels: on one thread they do not wait at a team barrier for a thread the OS has
    # descheduled (on 2 busy cores: 1.5 s on one thread against 11 s on two).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for block in range(blocks):
            _, condition = encode_condition_block(vae, condition, block, small)
            frames, decoder = decode_block(vae, decoder, latents)
            peak_condition = max(peak_condition, condition.nbytes())
            peak_decoder = max(peak_decoder, decoder.nbytes())
            pixel_frames = max(pixel_frames, frames.shape[2])
    finally:
        torch.set_num_threads(threads)
    return StreamBytes(peak_condition * scale, peak_decoder * scale, pixel_frames)
