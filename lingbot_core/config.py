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
    sliding_window_num_frames: int = 18  # the cache window: sink + recent history + the current block
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

    @classmethod
    def from_diffusers_config(cls, raw: dict[str, Any]) -> "TransformerConfig":
        """Build from a checkpoint's transformer/config.json, which must carry the published key set.

        Refused, by name: a key outside PUBLISHED_KEYS and METADATA_KEYS, a published key that is missing,
        a `_class_name` other than the causal LingBot transformer, a qk_norm this model does not implement,
        an image branch, and a `local_attn_size` that is neither -1 nor a window holding the sink plus one
        block. A positive `local_attn_size` is upstream's cache window in latent frames: it becomes this
        config's `sliding_window_num_frames`, the one window every part of the project reads.
        """
        unknown = sorted(set(raw) - set(PUBLISHED_KEYS) - set(METADATA_KEYS))
        if unknown:
            raise ValueError(f"transformer config has keys this model does not know: {unknown}")
        missing = [key for key in PUBLISHED_KEYS if key not in raw]
        if missing:
            raise ValueError(f"transformer config lacks keys the published config carries: {missing}")
        class_name = raw.get("_class_name", TRANSFORMER_CLASS_NAME)
        if class_name != TRANSFORMER_CLASS_NAME:
            raise ValueError(f"transformer config _class_name is {class_name!r}; this model is {TRANSFORMER_CLASS_NAME}")
        if raw["qk_norm"] != QK_NORM:
            raise ValueError(f"transformer config qk_norm={raw['qk_norm']!r}; this model implements {QK_NORM!r} "
                             "(one RMSNorm over all heads, on q and k)")
        for key in ("image_dim", "added_kv_proj_dim", "pos_embed_seq_len"):
            if raw[key] is not None:
                raise ValueError(f"transformer config sets {key}={raw[key]!r}; this model has no image branch")
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name in raw:
                kwargs[f.name] = _checked_value(f.name, raw[f.name], f.default)
        kwargs["sliding_window_num_frames"] = _cache_window(raw["local_attn_size"], kwargs)
        return cls(**kwargs)

    def to_diffusers_config(self) -> dict[str, Any]:
        """The published key set (plus `_class_name`), as a checkpoint's transformer/config.json holds it.

        The window is written as upstream's checkpoints write it: `sliding_window_num_frames` with
        `local_attn_size` -1. Fields the published config does not carry (rope_theta, camera_channels,
        camera_unshuffle) are fixed by the architecture; a config that changes them cannot be written.
        """
        for name in ("rope_theta", "camera_channels", "camera_unshuffle"):
            if getattr(self, name) != getattr(TransformerConfig, name):
                raise ValueError(f"{name}={getattr(self, name)} is not expressible in a published transformer config")
        out: dict[str, Any] = {"_class_name": TRANSFORMER_CLASS_NAME}
        for key in PUBLISHED_KEYS:
            out[key] = getattr(self, key, None)
        out.update(patch_size=list(self.patch_size), qk_norm=QK_NORM, local_attn_size=-1)
        return out


TRANSFORMER_CLASS_NAME = "CausalLingBotWorldTransformer3DModel"
QK_NORM = "rms_norm_across_heads"
# Every key of the published transformer/config.json (robbyant/lingbot-world-v2-14b-causal-fast-diffusers),
# in its order. All must be present; nothing else may be, except METADATA_KEYS.
PUBLISHED_KEYS: tuple[str, ...] = (
    "patch_size", "num_attention_heads", "attention_head_dim", "in_channels", "out_channels", "text_dim",
    "freq_dim", "ffn_dim", "num_layers", "cross_attn_norm", "eps", "image_dim", "added_kv_proj_dim",
    "rope_max_seq_len", "pos_embed_seq_len", "qk_norm", "sink_size", "num_frames_per_block",
    "sliding_window_num_frames", "local_attn_size",
)
METADATA_KEYS: tuple[str, ...] = ("_class_name", "_diffusers_version", "_name_or_path")


def _checked_value(name: str, value: Any, default: Any) -> Any:
    """A config.json value with the type of the dataclass default (bool is not an int here)."""
    if isinstance(default, tuple):
        if not (isinstance(value, (list, tuple)) and len(value) == len(default)
                and all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
            raise ValueError(f"transformer config {name}={value!r} must be a list of {len(default)} integers")
        return tuple(value)
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ValueError(f"transformer config {name}={value!r} must be true or false")
        return value
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"transformer config {name}={value!r} must be a positive integer")
        return value
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"transformer config {name}={value!r} must be a positive number")
        return float(value)
    return value


def _cache_window(local_attn_size: Any, kwargs: dict[str, Any]) -> int:
    """Upstream's meaning: -1 keeps sliding_window_num_frames; a positive value is the window itself."""
    window = kwargs.get("sliding_window_num_frames", TransformerConfig.sliding_window_num_frames)
    if isinstance(local_attn_size, bool) or not isinstance(local_attn_size, int):
        raise ValueError(f"transformer config local_attn_size={local_attn_size!r} must be an integer: -1 or a "
                         "window in latent frames")
    if local_attn_size == -1:
        return window
    sink = kwargs.get("sink_size", TransformerConfig.sink_size)
    block = kwargs.get("num_frames_per_block", TransformerConfig.num_frames_per_block)
    if local_attn_size < sink + block:
        raise ValueError(f"transformer config local_attn_size={local_attn_size} must be -1 (use "
                         f"sliding_window_num_frames={window}) or a window of at least sink_size + "
                         f"num_frames_per_block = {sink + block} latent frames")
    return local_attn_size


@dataclass(frozen=True)
class TextConfig:
    """Text path: UMT5 from a checkpoint, or the embedded encoder built from a seed."""

    max_length: int = 512  # tokens after pad + truncate
    # A bound on a prompt's raw characters, against abuse (a longer one is refused before any work). Below it
    # the model reads the first max_length tokens of the cleaned text, as upstream truncates.
    max_prompt_chars: int = 16384
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
    # Action guidance: classifier-free guidance on the camera. On the first `action_guidance_steps`
    # steps the velocity is v_still + action_guidance * (v - v_still), where v_still is the same forward
    # with the camera held still (the Plücker map of a block without keys, which training shows as
    # often as any key). The first step lays out where the picture moves, so guiding it alone
    # strengthens the keys' motion for one more forward a block (none in a block without keys, whose
    # camera is the still one). 1.0 (or 0 steps): off.
    action_guidance: float = 1.0
    action_guidance_steps: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.action_guidance) and self.action_guidance >= 0):
            raise ValueError(f"action_guidance must be a finite number >= 0; got {self.action_guidance!r}")
        if not 0 <= self.action_guidance_steps <= len(self.timesteps):
            raise ValueError(f"action_guidance_steps must be 0..{len(self.timesteps)} (the sampler's steps); "
                             f"got {self.action_guidance_steps!r}")

    @property
    def guided_steps(self) -> int:
        """How many of the first steps run the still-camera forward as well (0 when guidance is off)."""
        return self.action_guidance_steps if self.action_guidance != 1.0 else 0

    def sigmas(self) -> list[float]:
        out = []
        for t in self.timesteps:
            u = t / self.num_train_timesteps
            out.append(self.flow_shift * u / ((1.0 - u) + self.flow_shift * u))
        return out


@dataclass(frozen=True)
class CameraConfig:
    """Action integrator, key-input intrinsics, and the reference frame of trajectory-file intrinsics."""

    move_step: float = 0.05
    yaw_step_deg: float = 6.0
    pitch_step_deg: float = 4.0
    pitch_limit_deg: float = 85.0  # a pitch step that would pass it is dropped whole (so 84 with 4-degree steps)
    focal_px: float = 500.0
    # Where focal_px holds for key input. "target": fx = fy = focal_px in pixels of the output frame at any
    # size, as upstream's realtime code does for the real checkpoint. "reference": focal_px in the
    # reference_width x reference_height frame, scaled with the output size (the same field of view at
    # every size; the embedded preset's own convention).
    focal_at: str = "target"
    # Trajectory files give (fx, fy, cx, cy) in this frame; they are scaled to the output size.
    reference_width: int = 832
    reference_height: int = 480
    # A pose or intrinsics file is bounded by its size in bytes, never by a frame count (upstream validated
    # a 4,125-frame rollout); 64 MiB is 524,288 float64 poses.
    max_trajectory_file_bytes: int = 64 * 2**20
    max_npy_header_bytes: int = 65536

    def __post_init__(self) -> None:
        if self.focal_at not in ("target", "reference"):
            raise ValueError(f"focal_at must be 'target' or 'reference'; got {self.focal_at!r}")


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


def patched_vae(vae: dict[str, Any]) -> dict[str, Any]:
    """`vae` (AutoencoderKLWan kwargs) patched as the Wan 2.2 VAE is: 2x2 pixels folded into channels
    before the encoder (diffusers' `patch_size`) and one spatial halving fewer, so the spatial factor and
    the latent grid stay the same; both remaining halvings halve time too. Its full-resolution layers
    run at half the frame size."""
    return dict(vae, dim_mult=list(vae["dim_mult"][:-1]), temperal_downsample=[True, True], patch_size=2,
                in_channels=12, out_channels=12)

LINGBOT_WORLD_V2_14B = ModelConfig(
    name="lingbot-world-v2-14b",
    transformer=TransformerConfig(),
    vae=dict(WAN21_VAE),
)

# CPU size: same architecture, sized so a whole block runs in realtime on 2 AVX2 cores in fp32
# (benchmarks/bench_block.py prints the split). 96x160 pixels = 6x10 tokens a frame; the cache keeps
# one sink block and two recent blocks, so a rollout starts sliding its window at block 4.
EMBEDDED = ModelConfig(
    name="embedded",
    transformer=TransformerConfig(
        num_attention_heads=4, attention_head_dim=64, text_dim=64, freq_dim=256, ffn_dim=1024,
        num_layers=4, sink_size=3, sliding_window_num_frames=12,
    ),
    # A narrow decoder: streaming decode is paid every block (base 16 / decoder 8: ~350 ms of 12 frames).
    vae=dict(WAN21_VAE, base_dim=16, decoder_base_dim=8),
    text=TextConfig(),
    # The real model's four sigmas; the first step guided away from a still camera (x3), which keeps
    # held keys moving once the view leaves the start picture (README, "Action guidance"), for one
    # more forward a block.
    sampler=SamplerConfig(action_guidance=3.0, action_guidance_steps=1),
    # Our own preset keeps the real model's field of view at 832x480 (fx = 500 * 160 / 832 here).
    camera=CameraConfig(focal_at="reference"),
    height=96,
    width=160,
    weights_seed=0,  # the fallback weights when the trained folder is absent (loading.EMBEDDED_FOLDER)
    trained=True,  # the shipped folder holds trained weights; the loader says False when it falls back
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
        camera=CameraConfig(focal_at="reference"),
        height=32,
        width=64,
        weights_seed=0,
        trained=False,
    )


# Test-only presets by name ($LINGBOT_TEST_PRESET, `create_engine(preset=...)`): the embedded model at a test size.
TEST_PRESETS = {"tiny": tiny_config}
