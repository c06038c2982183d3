"""Attention over (sink + recent window + current block): the one SDPA entry point and the window rule.

`context_frames` is the single definition of which earlier latent frames a block sees; the KV cache,
the full-sequence mask below and the tests all derive from it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lingbot_core.config import TransformerConfig


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Scaled dot-product attention on [B, L, H, D] tensors; mask is bool [Lq, Lk] or [1, Lk], True = may attend.

    Every query must be allowed at least one key (a fully masked row is NaN)."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    return out.transpose(1, 2)  # [B, H, Lq, D] -> [B, Lq, H, D]


def context_frames(start_frame: int, cfg: TransformerConfig) -> list[int]:
    """Absolute latent frames a block starting at `start_frame` attends to besides its own, increasing.

    The sink frames [0, sink_size) that precede the block, plus the most recent `cfg.recent_frames`
    frames before it that are not in the sink (14B: at most 9 + 6 = 15 frames).
    """
    if start_frame < 0:
        raise ValueError(f"start_frame must be >= 0, got {start_frame}")
    sink = range(min(cfg.sink_size, start_frame))
    recent = range(max(cfg.sink_size, start_frame - cfg.recent_frames), start_frame)
    return [*sink, *recent]


def block_causal_mask(num_frames: int, tokens_per_frame: int, cfg: TransformerConfig) -> torch.Tensor:
    """bool [L, L] (True = may attend), L = num_frames * tokens_per_frame, for the one-shot oracle forward.

    Every block of cfg.num_frames_per_block frames sees exactly its context_frames plus itself,
    non-causally inside the block.
    """
    block = cfg.num_frames_per_block
    if num_frames < 1 or num_frames % block:
        raise ValueError(f"num_frames={num_frames} must be a positive multiple of num_frames_per_block={block}")
    frame_mask = torch.zeros(num_frames, num_frames, dtype=torch.bool)
    for start in range(0, num_frames, block):
        own = list(range(start, start + block))
        frame_mask[start:start + block, context_frames(start, cfg) + own] = True
    # [F, F] -> [F * T, F * T]: every token inherits its frame's row and column.
    return frame_mask.repeat_interleave(tokens_per_frame, 0).repeat_interleave(tokens_per_frame, 1)
