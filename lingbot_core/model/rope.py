"""3-axis rotary position embedding (frame, row, column): a fixed table plus exact out-of-table frames.

The head dim is split [temporal, height, width] with height = width = 2 * (head_dim // 6) and the rest
temporal (128 -> 44 / 42 / 42). Angles are computed in float64 and stored as float32 cos/sin; rotation
acts on interleaved pairs (2i, 2i+1), i.e. a complex multiply by e^{i * angle} as in Wan's rope_apply.

Temporal positions are absolute latent-frame indices, so a long rollout outgrows the table. Such a
block gets cos/sin computed for its own frames from the same float64 frequencies; the table never
grows and nothing is cached, so memory stays fixed however long a session runs.
"""

from __future__ import annotations

import torch

from lingbot_core.config import TransformerConfig


class RopeRangeError(ValueError):
    """A position the rotary embedding cannot represent (negative, or a spatial grid beyond the table)."""


class Rope3D:
    """Rotary tables for one TransformerConfig.

    A plain object rather than an nn.Module with buffers on purpose: `Module.to(torch.bfloat16)` would cast
    buffers together with the weights, and these tables must stay float32. The owning model rebuilds them
    with `materialize(device)` (for example after weights were loaded onto a meta-device model).
    """

    def __init__(self, config: TransformerConfig, device: torch.device | str | None = None) -> None:
        head_dim = config.attention_head_dim
        spatial = 2 * (head_dim // 6)
        if head_dim % 2 or spatial == 0:
            raise RopeRangeError(f"attention_head_dim={head_dim} must be even and at least 6 for 3-axis RoPE")
        self.axis_dims = (head_dim - 2 * spatial, spatial, spatial)  # (temporal, height, width) real dims
        self.max_positions = config.rope_max_seq_len
        self.theta = config.rope_theta
        self.materialize(device)

    def materialize(self, device: torch.device | str | None) -> None:
        """(Re)build the float64 frequencies and the float32 tables on `device`."""
        # Per-axis inverse frequencies 1 / theta^(2i / d), float64: [d_axis // 2] each.
        self.axis_freqs = tuple(
            1.0 / self.theta ** (torch.arange(0, d, 2, dtype=torch.float64, device=device) / d)
            for d in self.axis_dims
        )
        positions = torch.arange(self.max_positions, dtype=torch.float64, device=device)
        angles = torch.outer(positions, torch.cat(self.axis_freqs))  # [max_positions, head_dim // 2]
        self.cos_table = angles.cos().float()
        self.sin_table = angles.sin().float()

    @property
    def device(self) -> torch.device:
        return self.cos_table.device

    def cos_sin(self, start_frame: int, num_frames: int, grid_h: int, grid_w: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin, each float32 [num_frames * grid_h * grid_w, head_dim // 2], tokens ordered (frame, row, col).

        Frame i sits at temporal position start_frame + i; rows and columns restart at 0 every frame.
        """
        if start_frame < 0 or num_frames < 1:
            raise RopeRangeError(f"need start_frame >= 0 and num_frames >= 1, got {start_frame}, {num_frames}")
        if grid_h > self.max_positions or grid_w > self.max_positions:
            raise RopeRangeError(
                f"spatial grid {grid_h}x{grid_w} exceeds rope_max_seq_len={self.max_positions}; "
                "spatial positions beyond the table are not supported"
            )
        t_half, h_half, _ = (d // 2 for d in self.axis_dims)
        end = start_frame + num_frames
        if end <= self.max_positions:
            t_cos = self.cos_table[start_frame:end, :t_half]
            t_sin = self.sin_table[start_frame:end, :t_half]
        else:
            # Beyond the table: exact angles for this block's frames only; never stored on the object.
            positions = torch.arange(start_frame, end, dtype=torch.float64, device=self.device)
            angles = torch.outer(positions, self.axis_freqs[0])  # [num_frames, t_half]
            t_cos, t_sin = angles.cos().float(), angles.sin().float()
        h_cols = slice(t_half, t_half + h_half)
        w_cols = slice(t_half + h_half, None)
        cos = _spread(t_cos, self.cos_table[:grid_h, h_cols], self.cos_table[:grid_w, w_cols])
        sin = _spread(t_sin, self.sin_table[:grid_h, h_cols], self.sin_table[:grid_w, w_cols])
        return cos, sin


def _spread(t: torch.Tensor, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per-axis rows [F, a], [H, b], [W, c] -> per-token rows [F * H * W, a + b + c], (frame, row, col) order."""
    f_len, h_len, w_len = t.shape[0], h.shape[0], w.shape[0]
    grid = (f_len, h_len, w_len, -1)
    per_token = torch.cat(
        [t[:, None, None].expand(grid), h[None, :, None].expand(grid), w[None, None, :].expand(grid)], dim=-1
    )  # [F, H, W, head_dim // 2]
    return per_token.reshape(f_len * h_len * w_len, -1)  # a fresh contiguous tensor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, L, H, D] by per-token angles (cos, sin [L, D // 2]); pairs are (2i, 2i+1).

    Computed in float32 (float64 for a float64 x) and returned in x.dtype.
    """
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    real, imag = x.to(compute).unflatten(-1, (-1, 2)).unbind(-1)  # [B, L, H, D // 2] each
    c = cos.to(compute)[:, None]  # [L, 1, D // 2], broadcast over heads
    s = sin.to(compute)[:, None]
    rotated = torch.stack((real * c - imag * s, real * s + imag * c), dim=-1)  # [B, L, H, D // 2, 2]
    return rotated.flatten(-2).to(x.dtype)
