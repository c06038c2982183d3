"""Rope3D against a direct float64 polar computation, in and beyond the fixed table."""

import pytest
import torch

from lingbot_core.config import LINGBOT_WORLD_V2_14B, TransformerConfig
from lingbot_core.model.rope import Rope3D, RopeRangeError, apply_rope

CFG = LINGBOT_WORLD_V2_14B.transformer
GRID_H = LINGBOT_WORLD_V2_14B.latent_height // CFG.patch_size[1]
GRID_W = LINGBOT_WORLD_V2_14B.latent_width // CFG.patch_size[2]
FRAMES = CFG.num_frames_per_block


def _direct_polar(start: int, frames: int, grid_h: int, grid_w: int, axis_dims) -> torch.Tensor:
    """e^{i * angle} per token (frame, row, col) and frequency, from scratch in float64: [L, head_dim // 2]."""
    f, r, c = torch.meshgrid(torch.arange(start, start + frames), torch.arange(grid_h), torch.arange(grid_w),
                             indexing="ij")
    parts = []
    for pos, d in zip((f, r, c), axis_dims):
        inv_freq = torch.tensor([CFG.rope_theta ** (-(2.0 * i) / d) for i in range(d // 2)], dtype=torch.float64)
        angle = pos.reshape(-1, 1).double() * inv_freq
        parts.append(torch.polar(torch.ones_like(angle), angle))
    return torch.cat(parts, dim=1)


def test_head_dim_split_is_temporal_height_width():
    assert Rope3D(CFG).axis_dims == (44, 42, 42)
    assert sum(Rope3D(TransformerConfig(attention_head_dim=24)).axis_dims) == 24


@pytest.mark.parametrize("start", [0, 1021, 1023, 1024, 21600])
def test_cos_sin_equal_direct_polar_and_table_never_grows(start):
    rope = Rope3D(CFG)
    cos_table, sin_table = rope.cos_table, rope.sin_table
    cos, sin = rope.cos_sin(start, FRAMES, GRID_H, GRID_W)
    expected = _direct_polar(start, FRAMES, GRID_H, GRID_W, rope.axis_dims)
    assert cos.dtype == sin.dtype == torch.float32
    assert cos.shape == sin.shape == (FRAMES * GRID_H * GRID_W, CFG.attention_head_dim // 2)
    torch.testing.assert_close(cos.double(), expected.real, rtol=0, atol=2e-7)
    torch.testing.assert_close(sin.double(), expected.imag, rtol=0, atol=2e-7)
    # The fixed table is the same object, same size, same values: nothing was appended or cached.
    assert rope.cos_table is cos_table and rope.sin_table is sin_table
    assert cos_table.shape == (CFG.rope_max_seq_len, CFG.attention_head_dim // 2)
    assert torch.equal(cos_table, Rope3D(CFG).cos_table)
    assert set(vars(rope)) == set(vars(Rope3D(CFG)))


def test_in_table_and_beyond_table_values_agree_where_they_overlap():
    rope = Rope3D(CFG)
    last = CFG.rope_max_seq_len - 1
    straddling, _ = rope.cos_sin(last - 1, FRAMES, 1, 1)  # frames 1022, 1023, 1024: computed directly
    inside, _ = rope.cos_sin(last - 2, FRAMES, 1, 1)  # frames 1021..1023: from the table
    torch.testing.assert_close(straddling[:2], inside[1:], rtol=0, atol=0)


def test_spatial_overflow_and_negative_start_raise():
    rope = Rope3D(CFG)
    with pytest.raises(RopeRangeError, match="spatial"):
        rope.cos_sin(0, 1, CFG.rope_max_seq_len + 1, 1)
    with pytest.raises(RopeRangeError, match="spatial"):
        rope.cos_sin(0, 1, 1, CFG.rope_max_seq_len + 1)
    with pytest.raises(RopeRangeError):
        rope.cos_sin(-1, 1, 1, 1)


@pytest.mark.parametrize("start", [5, 2000])
def test_apply_rope_is_a_complex_multiply_on_interleaved_pairs(start):
    rope = Rope3D(CFG)
    cos, sin = rope.cos_sin(start, 2, 3, 4)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, cos.shape[0], 3, CFG.attention_head_dim, generator=gen, dtype=torch.float64)
    rotated = apply_rope(x, cos, sin)
    phase = torch.complex(cos.double(), sin.double())[:, None]  # [L, 1, D/2]
    expected = torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (-1, 2))) * phase).flatten(-2)
    assert rotated.dtype == torch.float64
    torch.testing.assert_close(rotated, expected, rtol=0, atol=1e-12)
    # Low-precision input is rotated in float32 and returned in its own dtype.
    low = apply_rope(x.bfloat16(), cos, sin)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.double(), expected, rtol=2e-2, atol=2e-2)
