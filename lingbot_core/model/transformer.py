"""The causal, camera-controlled DiT of LingBot-World v2 (Wan 2.x backbone), one block of frames per call.

Parameter names and shapes equal the diffusers checkpoint `transformer/` folder. Precision policy:
Linear/Conv inputs are cast to their weight dtype (bf16 weights run bf16 matmuls); the residual stream,
the camera stream, the norms and the adaLN modulation are fp32 islands (float64 for a float64 model).

The KV cache is not owned here. `forward` reads `cache.context(layer)` (with `cache.context_valid`, the mask
of a fixed-size context window) and, when `cache.writes`, hands this call's RoPE-rotated K/V to
`cache.store(layer, k, v)`; both happen outside `CausalBlock.forward`, which is a pure tensor function and
therefore safe to torch.compile (one graph per context shape and mask presence: kv_cache.BlockKV has one
shape, masked while it fills and unmasked once full, so two graphs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from lingbot_core.config import TransformerConfig
from lingbot_core.model.attention import attend
from lingbot_core.model.rope import Rope3D, apply_rope


TIMESTEP_BASE = 10000.0  # base of Wan's sinusoidal timestep embedding (not the RoPE theta)


class TransformerInputError(ValueError):
    """An input tensor or argument whose shape or value the transformer cannot take."""


def island_dtype(dtype: torch.dtype) -> torch.dtype:
    """The fp32 island dtype: float32, or float64 when the model itself runs in float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def fp32_layer_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Affine-free LayerNorm over the last dim, computed in the island dtype."""
    return F.layer_norm(x.to(island_dtype(x.dtype)), x.shape[-1:], eps=eps)


class Linear(nn.Linear):
    """nn.Linear that casts its input to the weight dtype, so an fp32 island feeds a bf16 matmul."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.to(self.weight.dtype))


class Conv3d(nn.Conv3d):
    """nn.Conv3d that casts its input to the weight dtype (the patch embedding)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.to(self.weight.dtype))


class RMSNorm(nn.Module):
    """RMSNorm over the full projection width (all heads), weight only; normalised in the island dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(island_dtype(x.dtype))
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight.to(x.dtype)


class FP32LayerNorm(nn.LayerNorm):
    """Affine LayerNorm (`norm3`) computed in the island dtype whatever the dtype of its parameters."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = island_dtype(x.dtype)
        return F.layer_norm(x.to(dt), self.normalized_shape, self.weight.to(dt), self.bias.to(dt), self.eps)


@dataclass(frozen=True)
class TextKV:
    """Cross-attention keys and values per layer, each [B, Ltext, H, D]; computed once per prompt."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]


class Attention(nn.Module):
    """q/k/v/o projections with RMSNorm on q and k (before RoPE); used for self- and cross-attention."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        dim = cfg.dim
        self.heads = cfg.num_attention_heads
        self.q, self.k, self.v, self.o = (Linear(dim, dim) for _ in range(4))
        self.norm_q = RMSNorm(dim, cfg.eps)
        self.norm_k = RMSNorm(dim, cfg.eps)

    def project_kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, L, dim] -> k, v [B, L, H, D] in the weight dtype (k normalised, not rotated)."""
        k = self.norm_k(self.k(x)).unflatten(-1, (self.heads, -1))
        v = self.v(x).unflatten(-1, (self.heads, -1))
        return k, v

    def project_q(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm_q(self.q(x)).unflatten(-1, (self.heads, -1))  # [B, L, H, D]

    def out(self, attended: torch.Tensor) -> torch.Tensor:
        return self.o(attended.flatten(2))  # [B, L, H, D] -> [B, L, dim]


class CausalBlock(nn.Module):
    """adaLN block: self-attention -> camera injection -> cross-attention -> FFN."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        dim = cfg.dim
        self.eps = cfg.eps
        self.self_attn = Attention(cfg)
        self.cross_attn = Attention(cfg)
        self.norm3 = FP32LayerNorm(dim, cfg.eps, elementwise_affine=True) if cfg.cross_attn_norm else nn.Identity()
        self.ffn = nn.Sequential(Linear(dim, cfg.ffn_dim), nn.GELU(approximate="tanh"), Linear(cfg.ffn_dim, dim))
        self.modulation = nn.Parameter(torch.randn(1, 6, dim) / dim**0.5)
        self.cam_injector_layer1 = Linear(dim, dim)
        self.cam_injector_layer2 = Linear(dim, dim)
        self.cam_scale_layer = Linear(dim, dim)
        self.cam_shift_layer = Linear(dim, dim)

    def forward(self, x: torch.Tensor, e0: torch.Tensor, text_k: torch.Tensor, text_v: torch.Tensor,
                cam: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx_k: torch.Tensor | None = None,
                ctx_v: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x, cam [B, F, T, dim] (island dtype); e0 [B, F, 1, 6, dim]; text_k/v, ctx_k/v [B, L*, H, D];
        cos/sin [F*T, D//2]. Returns the new x and this call's rotated k, v [B, F*T, H, D]."""
        # adaLN parameters per frame, each [B, F, 1, dim] (fp32 island).
        shift_sa, scale_sa, gate_sa, shift_ff, scale_ff, gate_ff = (self.modulation.to(x.dtype) + e0).unbind(-2)

        # 1. Self-attention over the cached context + this call's frames (non-causal within that set).
        h = (fp32_layer_norm(x, self.eps) * (1 + scale_sa) + shift_sa).flatten(1, 2)  # [B, F*T, dim]
        q = apply_rope(self.self_attn.project_q(h), cos, sin)
        k, v = self.self_attn.project_kv(h)
        k = apply_rope(k, cos, sin)
        keys = k if ctx_k is None else torch.cat([ctx_k, k], dim=1)
        values = v if ctx_v is None else torch.cat([ctx_v, v], dim=1)
        y = self.self_attn.out(attend(q, keys, values, attn_mask)).view_as(x)
        x = x + y * gate_sa

        # 2. Camera injection: a per-token scale and shift of the residual stream.
        f = self.cam_injector_layer2(F.silu(self.cam_injector_layer1(cam))) + cam
        x = (1 + self.cam_scale_layer(f)) * x + self.cam_shift_layer(f)

        # 3. Cross-attention to the prompt, plain residual.
        q = self.cross_attn.project_q(self.norm3(x).flatten(1, 2))
        x = x + self.cross_attn.out(attend(q, text_k, text_v)).view_as(x)

        # 4. Feed-forward, gated residual.
        y = self.ffn(fp32_layer_norm(x, self.eps) * (1 + scale_ff) + shift_ff)
        x = x + y * gate_ff
        return x, k, v


class Head(nn.Module):
    """Output LayerNorm (no affine) -> modulate with the time embedding -> Linear(dim, prod(patch) * out)."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.eps = cfg.eps
        self.head = Linear(cfg.dim, cfg.out_channels * math.prod(cfg.patch_size))
        self.modulation = nn.Parameter(torch.randn(1, 2, cfg.dim) / cfg.dim**0.5)

    def forward(self, x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """x [B, F, T, dim], e [B, F, 1, dim] -> [B, F, T, prod(patch) * out_channels]."""
        shift, scale = (self.modulation.to(x.dtype) + e.unsqueeze(-2)).unbind(-2)  # [B, F, 1, dim] each
        return self.head(fp32_layer_norm(x, self.eps) * (1 + scale) + shift)


class CausalLingBotWorldTransformer3DModel(nn.Module):
    """The DiT; the constructor is the config. See `forward` for one call and the module doc for the cache."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        dim = config.dim
        self.patch_embedding = Conv3d(config.in_channels, dim, kernel_size=config.patch_size,
                                      stride=config.patch_size)
        self.text_embedding = nn.Sequential(Linear(config.text_dim, dim), nn.GELU(approximate="tanh"),
                                            Linear(dim, dim))
        self.time_embedding = nn.Sequential(Linear(config.freq_dim, dim), nn.SiLU(), Linear(dim, dim))
        self.time_projection = nn.Sequential(nn.SiLU(), Linear(dim, 6 * dim))
        self.patch_embedding_wancamctrl = Linear(config.camera_in_features, dim)
        self.c2ws_hidden_states_layer1 = Linear(dim, dim)
        self.c2ws_hidden_states_layer2 = Linear(dim, dim)
        self.blocks = nn.ModuleList(CausalBlock(config) for _ in range(config.num_layers))
        self.head = Head(config)
        self.rope = Rope3D(config, device=self.patch_embedding.weight.device)

    # ---- state that is not a parameter -------------------------------------------------------------

    def materialize_buffers(self, device: torch.device | str) -> None:
        """Rebuild the RoPE tables on `device` (after weights were assigned to a meta-built model)."""
        self.rope.materialize(device)

    def _apply(self, fn: Any, recurse: bool = True) -> "CausalLingBotWorldTransformer3DModel":
        # .to()/.cuda() move parameters only; the RoPE tables follow the device but stay float32.
        super()._apply(fn, recurse)
        device = self.patch_embedding.weight.device
        if self.rope.device != device:
            self.materialize_buffers(device)
        return self

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        """Deterministic random weights: N(0, 0.02) matrices, zero biases, N(0, 1/dim) modulation, unit norms.

        The draws are made on the generator's device: a CPU generator gives the same weights on every device
        (the seeded embedded model); a CUDA one fills a full-size model without a host copy (bench_gpu.py)."""
        draw = dict(generator=generator, dtype=torch.float64, device=generator.device)
        for name, param in self.named_parameters():
            owner, _, leaf = name.rpartition(".")
            if leaf == "modulation":
                value = torch.randn(param.shape, **draw) / math.sqrt(self.config.dim)
            elif owner.rpartition(".")[2].startswith("norm"):  # norm_q, norm_k, norm3
                value = torch.ones(param.shape) if leaf == "weight" else torch.zeros(param.shape)
            elif leaf == "bias":
                value = torch.zeros(param.shape)
            else:
                value = torch.randn(param.shape, **draw) * 0.02
            param.copy_(value)

    def compile_blocks(self, **compile_kwargs: Any) -> None:
        """torch.compile each block's forward (a pure function of tensors). Eager stays the default."""
        options = {"dynamic": False, **compile_kwargs}
        for block in self.blocks:
            block.compile(**options)

    # ---- inputs --------------------------------------------------------------------------------------

    def prepare_text(self, text_states: torch.Tensor) -> TextKV:
        """text_states [B, Ltext, text_dim] -> per-layer cross-attention (k, v), each [B, Ltext, H, D]."""
        if text_states.ndim != 3 or text_states.shape[-1] != self.config.text_dim:
            raise TransformerInputError(
                f"text_states must be [B, Ltext, {self.config.text_dim}], got {tuple(text_states.shape)}")
        context = self.text_embedding(text_states)  # [B, Ltext, dim]
        kv = [block.cross_attn.project_kv(context) for block in self.blocks]
        return TextKV(keys=tuple(k.contiguous() for k, _ in kv), values=tuple(v.contiguous() for _, v in kv))

    def _time_embed(self, timestep: torch.Tensor, num_frames: int, dtype: torch.dtype):
        """timestep [B] or [B, F] -> e [B, F, 1, dim] (head) and e0 [B, F, 1, 6, dim] (blocks)."""
        batch = timestep.shape[0]
        if timestep.ndim == 1:
            timestep = timestep[:, None].expand(batch, num_frames)
        # Sinusoid in float64, [cos, sin], base 10000: [B, F, freq_dim].
        half = self.config.freq_dim // 2
        freqs = TIMESTEP_BASE ** (-torch.arange(half, dtype=torch.float64, device=timestep.device) / half)
        angles = timestep.to(torch.float64)[..., None] * freqs
        sinusoid = torch.cat([angles.cos(), angles.sin()], dim=-1)
        e = self.time_embedding(sinusoid)  # [B, F, dim]
        e0 = self.time_projection(e).unflatten(-1, (6, self.config.dim))  # [B, F, 6, dim]
        return e.to(dtype).unsqueeze(2).contiguous(), e0.to(dtype).unsqueeze(2).contiguous()

    def _camera_embed(self, plucker: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Plücker [B, F, C, H*r, W*r] -> camera stream [B, F', T, dim] (island dtype)."""
        batch, frames = plucker.shape[:2]
        pt, ph, pw = self.config.patch_size
        cam = F.pixel_unshuffle(plucker.flatten(0, 1), self.config.camera_unshuffle)  # [B*F, C*r*r, h, w]
        cam = cam.unflatten(0, (batch, frames)).transpose(1, 2)  # [B, C*r*r, F, h, w]
        channels, _, h, w = cam.shape[1:]
        cam = cam.reshape(batch, channels, frames // pt, pt, h // ph, ph, w // pw, pw)
        cam = cam.permute(0, 2, 4, 6, 1, 3, 5, 7)  # [B, F', h', w', C*r*r, pt, ph, pw]
        cam = cam.reshape(batch, frames // pt, (h // ph) * (w // pw), -1)  # [B, F', T, camera_in_features]
        cam = self.patch_embedding_wancamctrl(cam).to(dtype)
        return cam + self.c2ws_hidden_states_layer2(F.silu(self.c2ws_hidden_states_layer1(cam)))

    def _check_inputs(self, hidden_states, timestep, text_kv, plucker, start_frame) -> None:
        cfg = self.config
        pt, ph, pw = cfg.patch_size
        if hidden_states.ndim != 5 or hidden_states.shape[1] != cfg.in_channels:
            raise TransformerInputError(
                f"hidden_states must be [B, {cfg.in_channels}, F, h, w], got {tuple(hidden_states.shape)}")
        batch, _, frames, h, w = hidden_states.shape
        if frames % pt or h % ph or w % pw:
            raise TransformerInputError(f"latent F, h, w = {frames}, {h}, {w} must divide by patch {cfg.patch_size}")
        if tuple(timestep.shape) not in ((batch,), (batch, frames // pt)):
            raise TransformerInputError(
                f"timestep must be [{batch}] or [{batch}, {frames // pt}], got {tuple(timestep.shape)}")
        r = cfg.camera_unshuffle
        want = (batch, frames, cfg.camera_channels, h * r, w * r)
        if tuple(plucker.shape) != want:
            raise TransformerInputError(f"plucker must be {list(want)}, got {list(plucker.shape)}")
        if len(text_kv.keys) != cfg.num_layers or text_kv.keys[0].shape[0] != batch:
            raise TransformerInputError(
                f"text_kv must hold {cfg.num_layers} layers of batch {batch}; "
                f"got {len(text_kv.keys)} layers of batch {text_kv.keys[0].shape[0]}")
        if not isinstance(start_frame, int) or start_frame < 0:
            raise TransformerInputError(f"start_frame must be an int >= 0, got {start_frame!r}")
        if self.rope.device != hidden_states.device:
            raise TransformerInputError(
                f"RoPE tables are on {self.rope.device}, inputs on {hidden_states.device}: "
                "call materialize_buffers(device) after assigning weights")

    # ---- forward -------------------------------------------------------------------------------------

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, text_kv: TextKV,
                plucker: torch.Tensor, start_frame: int, cache: Any = None,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """hidden_states [B, in_channels, F, h, w] -> prediction [B, out_channels, F, h, w].

        timestep: model timestep (0..1000), [B] for all frames or [B, F] per latent frame.
        plucker: [B, F, camera_channels, h * camera_unshuffle, w * camera_unshuffle].
        start_frame: absolute latent index of frame 0 (its RoPE temporal position).
        cache: duck-typed `context(layer) -> (k, v) | None` ([1 or B, Lctx, H, D] each), `context_valid`
            (bool [Lctx], False on context slots to ignore; None: all count), `writes: bool`, `store(layer, k, v)`.
        attn_mask: bool [L, Lctx + L] for a cache without `context_valid`; the one-shot oracle forward passes
            [L, L] (attention.block_causal_mask).
        The output is float32 (float64 for a float64 model).
        """
        self._check_inputs(hidden_states, timestep, text_kv, plucker, start_frame)
        pt, ph, pw = self.config.patch_size
        batch, _, frames, h, w = hidden_states.shape
        grid = (frames // pt, h // ph, w // pw)
        dtype = island_dtype(self.patch_embedding.weight.dtype)

        # 1. Patch embedding: [B, C, F, h, w] -> residual stream [B, F', T, dim].
        x = self.patch_embedding(hidden_states).flatten(3).permute(0, 2, 3, 1).to(dtype).contiguous()

        # 2. Conditioning: time (per frame), camera (per token), rotary angles (absolute frames).
        e, e0 = self._time_embed(timestep, grid[0], dtype)
        cam = self._camera_embed(plucker, dtype).contiguous()
        cos, sin = self.rope.cos_sin(start_frame, *grid)

        # 3. Blocks; the cache is read and written here so that a block stays a pure (compilable) function.
        #    A fixed-size context hides its empty slots with a key mask: [1, Lctx + L], the same for every query;
        #    a full one (context_valid None) needs none.
        valid = None if cache is None else cache.context_valid
        if valid is not None:
            if attn_mask is not None:
                raise TransformerInputError("attn_mask is for the one-shot forward; a cache with a context masks it")
            own = torch.ones(grid[0] * grid[1] * grid[2], dtype=torch.bool, device=valid.device)
            attn_mask = torch.cat([valid, own])[None]
        for layer, block in enumerate(self.blocks):
            context = cache.context(layer) if cache is not None else None
            ctx_k, ctx_v = (None, None) if context is None else (t.contiguous() for t in context)
            x, k, v = block(x, e0, text_kv.keys[layer], text_kv.values[layer], cam, cos, sin,
                            ctx_k, ctx_v, attn_mask)
            if cache is not None and cache.writes:
                cache.store(layer, k, v)

        # 4. Head and unpatchify: the head's outputs per token are ordered (pt, ph, pw, c).
        out = self.head(x, e)  # [B, F', T, pt*ph*pw*c]
        out = out.to(dtype).view(batch, *grid, pt, ph, pw, self.config.out_channels)
        out = out.permute(0, 7, 1, 4, 2, 5, 3, 6)  # [B, c, F', pt, h', ph, w', pw]
        return out.reshape(batch, self.config.out_channels, frames, h, w)
