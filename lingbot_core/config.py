"""Frozen configuration for LingBot-World v2 and its named presets.

Every shape constant the model, the VAE stream, the camera path and the sampler use comes from
here. A preset is one `ModelConfig` passed whole; nothing else holds sizes.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class TransformerConfig:
    """The causal DiT. Field names follow the diffusers `transformer/config.json` of the real checkpoint."""

    patch_size: tuple[int, int, int] = (1, 2, 2)
    num_attention_heads: int = 40
    attention_head_dim: int = 128
    in_channels: int = 36  # noisy latent (out_channels) + condition mask + condition latent
    out_channels: int = 16
    text_dim: int = 4096
    freq_dim: int = 256
    ffn_dim: int = 13824
    num_layers: int = 40
    cross_attn_norm: bool = True
    eps: float = 1e-6
    rope_max_seq_len: int = 1024
    rope_theta: float = 10000.0
    num_frames_per_block: int = 3  # latent frames generated per block
    sink_size: int = 9  # latent frames kept forever (the first blocks)
    sliding_window_num_frames: int = 18  # sink + recent history + the current block
    camera_channels: int = 6  # Plücker map: ray origin xyz + ray direction xyz
    camera_unshuffle: int = 8  # pixel_unshuffle factor of the Plücker map (= VAE spatial factor)

    @property
    def dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def mask_channels(self) -> int:
        return self.in_channels - 2 * self.out_channels

    @property
    def camera_in_features(self) -> int:
        pt, ph, pw = self.patch_size
        return self.camera_channels * self.camera_unshuffle**2 * pt * ph * pw

    @property
    def recent_frames(self) -> int:
        """History frames outside the sink that a block still attends to."""
        return self.sliding_window_num_frames - self.sink_size - self.num_frames_per_block

    def __post_init__(self) -> None:
        if self.recent_frames < 0:
            raise ValueError(
                f"sliding_window_num_frames={self.sliding_window_num_frames} must cover sink_size="
                f"{self.sink_size} plus one block of {self.num_frames_per_block} frames"
            )
        if self.sink_size % self.num_frames_per_block:
            raise ValueError("sink_size must be a whole number of blocks")
        if self.mask_channels <= 0:
            raise ValueError("in_channels must exceed 2 * out_channels (latent + mask + condition)")

    # diffusers config.json keys that carry no shape information for this model
    _IGNORED_KEYS = ("_class_name", "_diffusers_version", "_name_or_path", "qk_norm", "image_dim",
                     "added_kv_proj_dim", "pos_embed_seq_len", "rope_max_seq_len_2d")

    @classmethod
    def from_diffusers_config(cls, raw: dict[str, Any]) -> "TransformerConfig":
        """Build from a checkpoint's transformer/config.json; unknown keys are refused by name."""
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        unknown = []
        for key, value in raw.items():
            if key in known:
                kwargs[key] = tuple(value) if isinstance(value, list) else value
            elif key not in cls._IGNORED_KEYS:
                unknown.append(key)
        for key in ("image_dim", "added_kv_proj_dim", "pos_embed_seq_len"):
            if raw.get(key) is not None:
                raise ValueError(f"transformer config sets {key}={raw[key]!r}; this model has no image branch")
        if unknown:
            raise ValueError(f"transformer config has keys this model does not know: {sorted(unknown)}")
        return cls(**kwargs)

    def to_diffusers_config(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["patch_size"] = list(self.patch_size)
        out.update(_class_name="CausalLingBotWorldTransformer3DModel", qk_norm="rms_norm_across_heads",
                   image_dim=None, added_kv_proj_dim=None, pos_embed_seq_len=None)
        return out


@dataclass(frozen=True)
class TextConfig:
    """Text path: UMT5 from a checkpoint, or the embedded encoder built from a seed."""

    max_length: int = 512  # tokens after pad + truncate
    max_prompt_chars: int = 2000  # longer prompts are refused rather than silently truncated
    # Embedded encoder only (a small UMT5 with random weights and a locally built byte vocabulary).
    embedded_d_model: int = 64
    embedded_num_layers: int = 2
    embedded_num_heads: int = 2
    embedded_d_ff: int = 128


@dataclass(frozen=True)
class SamplerConfig:
    """Few-step DMD flow matching: labels shifted by flow_shift, then one t=0 commit forward."""

    timesteps: tuple[float, ...] = (1000.0, 750.0, 500.0, 250.0)
    flow_shift: float = 5.0
    num_train_timesteps: float = 1000.0

    def sigmas(self) -> list[float]:
        out = []
        for t in self.timesteps:
            u = t / self.num_train_timesteps
            out.append(self.flow_shift * u / ((1.0 - u) + self.flow_shift * u))
        return out


@dataclass(frozen=True)
class CameraConfig:
    """Action integrator and intrinsics, in the 832x480 reference frame of the real model."""

    move_step: float = 0.05
    yaw_step_deg: float = 6.0
    pitch_step_deg: float = 4.0
    pitch_limit_deg: float = 85.0
    focal_px: float = 500.0
    reference_width: int = 832
    reference_height: int = 480
    max_trajectory_frames: int = 4096
    max_npy_header_bytes: int = 65536


@dataclass(frozen=True)
class ModelConfig:
    """One preset: everything needed to build (or check) a pipeline."""

    name: str
    transformer: TransformerConfig
    vae: dict[str, Any] = field(default_factory=dict)  # AutoencoderKLWan kwargs
    text: TextConfig = TextConfig()
    sampler: SamplerConfig = SamplerConfig()
    camera: CameraConfig = CameraConfig()
    height: int = 480
    width: int = 832
    fps: int = 16
    vae_spatial_factor: int = 8
    vae_temporal_factor: int = 4
    weights_seed: int | None = None  # embedded preset: weights drawn from this seed
    trained: bool = True  # False: the README and the app must say the weights are random

    @property
    def latent_height(self) -> int:
        return self.height // self.vae_spatial_factor

    @property
    def latent_width(self) -> int:
        return self.width // self.vae_spatial_factor

    @property
    def tokens_per_frame(self) -> int:
        _, ph, pw = self.transformer.patch_size
        return (self.latent_height // ph) * (self.latent_width // pw)

    @property
    def pixel_frames_per_block(self) -> int:
        return self.transformer.num_frames_per_block * self.vae_temporal_factor

    def pixel_frames_for_blocks(self, num_blocks: int) -> int:
        """The causal VAE maps pixel frame 0 alone, so N blocks decode to 12N - 3 frames."""
        return num_blocks * self.pixel_frames_per_block - (self.vae_temporal_factor - 1)

    def __post_init__(self) -> None:
        step = self.vae_spatial_factor * math.prod(self.transformer.patch_size[1:])
        if self.height % step or self.width % step:
            raise ValueError(f"height and width must be multiples of {step}; got {self.height}x{self.width}")
        if self.transformer.camera_unshuffle != self.vae_spatial_factor:
            raise ValueError("camera_unshuffle must equal the VAE spatial factor")


WAN21_VAE = dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                 temperal_downsample=[False, True, True], dropout=0.0)

LINGBOT_WORLD_V2_14B = ModelConfig(
    name="lingbot-world-v2-14b",
    transformer=TransformerConfig(),
    vae=dict(WAN21_VAE),
)

# CPU size: same architecture, random weights from a fixed seed, no download.
EMBEDDED = ModelConfig(
    name="embedded",
    transformer=TransformerConfig(
        num_attention_heads=4, attention_head_dim=64, text_dim=64, freq_dim=256, ffn_dim=1024,
        num_layers=4,
    ),
    # A narrow decoder: streaming decode dominates the CPU block time (base 16: ~760 ms of a 1080 ms block).
    vae=dict(WAN21_VAE, base_dim=16, decoder_base_dim=8),
    text=TextConfig(),
    height=128,
    width=224,
    weights_seed=0,
    trained=False,
)

PRESETS: dict[str, ModelConfig] = {c.name: c for c in (EMBEDDED, LINGBOT_WORLD_V2_14B)}


def tiny_config(**transformer_overrides: Any) -> ModelConfig:
    """A test-sized model: 2 layers, 2 heads, 32x64 pixels (2x4 tokens a frame)."""
    t = dict(num_attention_heads=2, attention_head_dim=24, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2,
             rope_max_seq_len=64)
    t.update(transformer_overrides)
    return ModelConfig(
        name="tiny",
        transformer=TransformerConfig(**t),
        vae=dict(WAN21_VAE, base_dim=8),
        text=TextConfig(max_length=16, embedded_d_model=32, embedded_num_layers=1, embedded_num_heads=2,
                        embedded_d_ff=32),
        height=32,
        width=64,
        weights_seed=0,
        trained=False,
    )
