"""The causal transformer: block-by-block with a KV cache == one masked forward over all frames (fp64)."""

import copy
import os

import pytest
import torch

from lingbot_core.config import LINGBOT_WORLD_V2_14B, tiny_config
from lingbot_core.model.attention import block_causal_mask, context_frames
from lingbot_core.model.transformer import CausalLingBotWorldTransformer3DModel, TransformerInputError

# rope_max_seq_len=8 makes the 7-block rollout (21 frames) cross the RoPE table.
MODEL_CFG = tiny_config(rope_max_seq_len=8)
CFG = MODEL_CFG.transformer
BLOCK = CFG.num_frames_per_block
NUM_BLOCKS = 7
BATCH = 2
TEXT_LEN = 5
LATENT_HW = (MODEL_CFG.latent_height, MODEL_CFG.latent_width)
TOKENS = MODEL_CFG.tokens_per_frame
NOISY_T = 625.0

compile_only = pytest.mark.skipif(os.environ.get("LINGBOT_TEST_COMPILE") != "1",
                                  reason="cold torch.compile is slow; set LINGBOT_TEST_COMPILE=1")


class HistoryCache:
    """Test cache that keeps every frame's K/V; context() returns exactly the frames context_frames lists."""

    def __init__(self) -> None:
        self.frames: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (layer, frame) -> k, v
        self.start_frame = 0
        self.writes = False
        self.context_valid = None  # the context is exactly the frames context_frames lists, no padding
        self.stored: list[tuple[torch.Size, torch.dtype]] = []

    def context(self, layer: int):
        frames = context_frames(self.start_frame, CFG)
        if not frames:
            return None
        keys, values = zip(*(self.frames[(layer, f)] for f in frames))
        return torch.cat(keys, dim=1), torch.cat(values, dim=1)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.stored.append((k.shape, k.dtype))
        for i, (kf, vf) in enumerate(zip(k.split(TOKENS, dim=1), v.split(TOKENS, dim=1))):
            self.frames[(layer, self.start_frame + i)] = (kf, vf)


def _model(dtype=torch.float64) -> CausalLingBotWorldTransformer3DModel:
    model = CausalLingBotWorldTransformer3DModel(CFG).to(dtype).eval()
    model.init_weights(torch.Generator().manual_seed(0))
    return model


def _inputs(seed: int = 1):
    """Per-block latents [B, C, 3, h, w] and Plücker maps [B, 3, 6, H, W], plus prompt states."""
    gen = torch.Generator().manual_seed(seed)
    r = CFG.camera_unshuffle
    latents = [torch.randn(BATCH, CFG.in_channels, BLOCK, *LATENT_HW, generator=gen, dtype=torch.float64)
               for _ in range(NUM_BLOCKS)]
    pluckers = [torch.randn(BATCH, BLOCK, CFG.camera_channels, LATENT_HW[0] * r, LATENT_HW[1] * r, generator=gen,
                            dtype=torch.float64) for _ in range(NUM_BLOCKS)]
    text = torch.randn(BATCH, TEXT_LEN, CFG.text_dim, generator=gen, dtype=torch.float64)
    return latents, pluckers, text


def _rollout(model, latents, pluckers, text_kv, cache, timestep_of_last=0.0):
    """Blocks 0..N-1 at timestep 0, writing; the last one optionally at a noisy timestep without writing."""
    outs = []
    for b, (x, pl) in enumerate(zip(latents, pluckers)):
        last_noisy = b == len(latents) - 1 and timestep_of_last != 0.0
        cache.start_frame, cache.writes = b * BLOCK, not last_noisy
        t = torch.full((BATCH,), timestep_of_last if last_noisy else 0.0, dtype=torch.float64)
        outs.append(model(x, t, text_kv, pl, b * BLOCK, cache=cache))
    return torch.cat(outs, dim=2)


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model = _model()
    latents, pluckers, text = _inputs()
    with torch.no_grad():
        text_kv = model.prepare_text(text)
    return model, latents, pluckers, text_kv


@torch.no_grad()
def test_blockwise_rollout_equals_one_masked_forward(setup):
    model, latents, pluckers, text_kv = setup
    cache = HistoryCache()
    blockwise = _rollout(model, latents, pluckers, text_kv, cache)
    frames = NUM_BLOCKS * BLOCK
    full = model(torch.cat(latents, 2), torch.zeros(BATCH, dtype=torch.float64), text_kv, torch.cat(pluckers, 1),
                 0, attn_mask=block_causal_mask(frames, TOKENS, CFG))
    assert full.shape == (BATCH, CFG.out_channels, frames, *LATENT_HW)
    assert (full - blockwise).abs().max().item() <= 1e-10
    # Every call stored this call's K (weight dtype) for every layer.
    assert cache.stored == [(torch.Size([BATCH, BLOCK * TOKENS, CFG.num_attention_heads, CFG.attention_head_dim]),
                             torch.float64)] * (NUM_BLOCKS * CFG.num_layers)


@torch.no_grad()
def test_noisy_block_reads_without_writing_and_equals_per_frame_timesteps(setup):
    model, latents, pluckers, text_kv = setup
    cache = HistoryCache()
    blockwise = _rollout(model, latents, pluckers, text_kv, cache, timestep_of_last=NOISY_T)
    assert len(cache.stored) == (NUM_BLOCKS - 1) * CFG.num_layers  # the noisy call wrote nothing
    frames = NUM_BLOCKS * BLOCK
    per_frame_t = torch.zeros(BATCH, frames, dtype=torch.float64)
    per_frame_t[:, -BLOCK:] = NOISY_T
    full = model(torch.cat(latents, 2), per_frame_t, text_kv, torch.cat(pluckers, 1), 0,
                 attn_mask=block_causal_mask(frames, TOKENS, CFG))
    assert (full - blockwise).abs().max().item() <= 1e-10
    clean_last = model(latents[-1], torch.zeros(BATCH, dtype=torch.float64), text_kv, pluckers[-1],
                       (NUM_BLOCKS - 1) * BLOCK, cache=cache)
    assert (clean_last - blockwise[:, :, -BLOCK:]).abs().max() > 1e-3  # the timestep matters


def test_context_frames_at_the_14b_window():
    cfg = LINGBOT_WORLD_V2_14B.transformer
    sink = list(range(cfg.sink_size))
    assert context_frames(0, cfg) == []
    assert context_frames(3, cfg) == [0, 1, 2]
    assert context_frames(9, cfg) == sink
    assert context_frames(12, cfg) == sink + [9, 10, 11]
    assert context_frames(18, cfg) == sink + list(range(12, 18))
    assert context_frames(3000, cfg) == sink + list(range(2994, 3000))
    longest = cfg.sliding_window_num_frames - cfg.num_frames_per_block
    assert max(len(context_frames(s, cfg)) for s in range(0, 600, 3)) == longest == 15
    with pytest.raises(ValueError):
        context_frames(-3, cfg)


def test_block_causal_mask_gives_each_block_its_window_and_itself():
    frames = NUM_BLOCKS * BLOCK
    mask = block_causal_mask(frames, TOKENS, CFG)
    assert mask.shape == (frames * TOKENS, frames * TOKENS) and mask.dtype == torch.bool
    for frame in range(frames):
        start = frame - frame % BLOCK
        allowed = set(context_frames(start, CFG)) | set(range(start, start + BLOCK))
        row = mask[frame * TOKENS].view(frames, TOKENS)
        assert row.all(1).tolist() == [f in allowed for f in range(frames)]
        assert row.any(1).tolist() == row.all(1).tolist()
    with pytest.raises(ValueError):
        block_causal_mask(frames + 1, TOKENS, CFG)


@torch.no_grad()
def test_meta_built_model_with_assigned_weights_matches(setup):
    model, latents, pluckers, text_kv = setup
    with torch.device("meta"):
        meta_model = CausalLingBotWorldTransformer3DModel(CFG)
    meta_model.load_state_dict(model.state_dict(), assign=True)
    t = torch.zeros(BATCH, dtype=torch.float64)
    with pytest.raises(TransformerInputError, match="materialize_buffers"):
        meta_model(latents[0], t, text_kv, pluckers[0], 0)
    meta_model.materialize_buffers("cpu")
    got = meta_model(latents[0], t, text_kv, pluckers[0], 0)
    assert torch.equal(got, model(latents[0], t, text_kv, pluckers[0], 0))


@torch.no_grad()
def test_bf16_weights_track_fp64_and_keep_fp32_islands(setup):
    model, latents, pluckers, text_kv = setup
    low = copy.deepcopy(model).to(torch.bfloat16)
    assert low.rope.cos_table.dtype == torch.float32  # .to(dtype) leaves the RoPE tables alone
    _, _, text = _inputs()
    cache = HistoryCache()
    cache.writes = True
    t = torch.full((BATCH,), NOISY_T, dtype=torch.float64)
    out = low(latents[0], t, low.prepare_text(text), pluckers[0], 0, cache=cache)
    reference = model(latents[0], t, text_kv, pluckers[0], 0)
    assert out.dtype == torch.float32
    assert cache.stored[0][1] == torch.bfloat16
    rel = (out.double() - reference).norm() / reference.norm()
    assert rel < 0.05


@torch.no_grad()
def test_untrained_output_is_finite_and_depends_on_every_condition(setup):
    model, latents, pluckers, text_kv = setup
    _, _, text = _inputs()
    t = torch.full((BATCH,), NOISY_T, dtype=torch.float64)
    base = model(latents[0], t, text_kv, pluckers[0], 0)
    assert torch.isfinite(base).all() and base.std() > 1e-2
    variants = {
        "latent": model(latents[1], t, text_kv, pluckers[0], 0),
        "timestep": model(latents[0], t / 2, text_kv, pluckers[0], 0),
        # (Not text.flip(1): cross-attention has no positions, so it is invariant to token order.)
        "text": model(latents[0], t, model.prepare_text(text.roll(1, dims=-1)), pluckers[0], 0),
        "camera": model(latents[0], t, text_kv, pluckers[1], 0),
    }
    for name, out in variants.items():
        assert (out - base).abs().max() > 1e-4, name
    # RoPE is relative: with no context, moving the whole block (here beyond the table) changes only rounding.
    shifted = model(latents[0], t, text_kv, pluckers[0], 30)
    assert (shifted - base).abs().max() < 1e-6
    # Batch rows are independent: row 1 alone gives what it gives inside the batch.
    single = model(latents[0][1:], t[1:], type(text_kv)(tuple(k[1:] for k in text_kv.keys),
                                                       tuple(v[1:] for v in text_kv.values)), pluckers[0][1:], 0)
    torch.testing.assert_close(single, base[1:], rtol=0, atol=1e-12)


@torch.no_grad()
def test_init_weights_is_deterministic_and_follows_the_recipe():
    a, b = _model(), _model()
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    other = CausalLingBotWorldTransformer3DModel(CFG).double()
    other.init_weights(torch.Generator().manual_seed(1))
    assert not torch.equal(other.blocks[0].self_attn.q.weight, a.blocks[0].self_attn.q.weight)
    for name, p in a.named_parameters():
        if name.endswith(("norm_q.weight", "norm_k.weight", "norm3.weight")):
            assert torch.equal(p, torch.ones_like(p)), name
        elif name.endswith("bias"):
            assert torch.equal(p, torch.zeros_like(p)), name
        elif name.endswith("modulation"):
            assert abs(p.std().item() * CFG.dim**0.5 - 1) < 0.2, name
        else:
            assert abs(p.std().item() / 0.02 - 1) < 0.2, name


def test_bad_inputs_raise_typed_errors(setup):
    model, latents, pluckers, text_kv = setup
    t = torch.zeros(BATCH, dtype=torch.float64)
    with pytest.raises(TransformerInputError, match="plucker"):
        model(latents[0], t, text_kv, pluckers[0][..., :-8], 0)
    with pytest.raises(TransformerInputError, match="timestep"):
        model(latents[0], torch.zeros(BATCH, 2 * BLOCK), text_kv, pluckers[0], 0)
    with pytest.raises(TransformerInputError, match="hidden_states"):
        model(latents[0][:, 1:], t, text_kv, pluckers[0], 0)
    with pytest.raises(TransformerInputError, match="start_frame"):
        model(latents[0], t, text_kv, pluckers[0], -3)
    with pytest.raises(TransformerInputError, match="text_states"):
        model.prepare_text(torch.zeros(BATCH, TEXT_LEN, CFG.text_dim + 1))


def _bf16_rollout(model, latents, pluckers, text_kv, blocks):
    """Clean rollout over `blocks` (start frames 3b), each block: one noisy read-only call + one writing call."""
    cache, outs = HistoryCache(), []
    for b in blocks:
        x, pl = latents[b % NUM_BLOCKS].bfloat16(), pluckers[b % NUM_BLOCKS].bfloat16()
        cache.start_frame = b * BLOCK
        for t, writes in ((NOISY_T, False), (0.0, True)):
            cache.writes = writes
            outs.append(model(x, torch.full((BATCH,), t), text_kv, pl, b * BLOCK, cache=cache))
    return outs, cache


@pytest.mark.compile
@compile_only
@torch.no_grad()
def test_compiled_blocks_match_eager_and_do_not_recompile_in_steady_state(setup):
    from torch._dynamo.utils import counters

    model, latents, pluckers, _ = setup
    _, _, text = _inputs()
    eager = copy.deepcopy(model).to(torch.bfloat16)
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    graphs_before = counters["stats"]["unique_graphs"]
    compiled.compile_blocks()
    text_kv = eager.prepare_text(text.bfloat16())

    # Warm-up: the context grows 0, 3, ..., 15 frames over the first blocks (one graph per length).
    warm = range(NUM_BLOCKS)
    got, _ = _bf16_rollout(compiled, latents, pluckers, text_kv, warm)
    want, _ = _bf16_rollout(eager, latents, pluckers, text_kv, warm)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=3e-2, atol=3e-2)
    graphs = counters["stats"]["unique_graphs"] - graphs_before
    distinct_context_lengths = len({len(context_frames(b * BLOCK, CFG)) for b in warm})
    assert 0 < graphs <= distinct_context_lengths  # all layers share one graph per context length

    # Steady state (full window, RoPE beyond its table, new timesteps): no new graphs.
    _bf16_rollout(compiled, latents, pluckers, text_kv, range(NUM_BLOCKS + 3))
    assert counters["stats"]["unique_graphs"] - graphs_before == graphs


# Checkpoint name (ours) -> diffusers WanTransformer3DModel name, for the pieces the two models share.
_WAN_RENAMES = [
    ("head.head.", "proj_out."), ("head.modulation", "scale_shift_table"),
    ("time_embedding.0.", "condition_embedder.time_embedder.linear_1."),
    ("time_embedding.2.", "condition_embedder.time_embedder.linear_2."),
    ("time_projection.1.", "condition_embedder.time_proj."),
    ("text_embedding.0.", "condition_embedder.text_embedder.linear_1."),
    ("text_embedding.2.", "condition_embedder.text_embedder.linear_2."),
    (".self_attn.o.", ".attn1.to_out.0."), (".cross_attn.o.", ".attn2.to_out.0."),
    (".self_attn.", ".attn1.to_"), (".cross_attn.", ".attn2.to_"),
    (".to_norm_", ".norm_"), (".norm3.", ".norm2."), (".ffn.0.", ".ffn.net.0.proj."), (".ffn.2.", ".ffn.net.2."),
    (".modulation", ".scale_shift_table"),
]


@torch.no_grad()
def test_without_camera_and_cache_it_is_the_diffusers_wan_transformer(setup):
    """Camera scale/shift zeroed -> injection is the identity; the rest must be Wan (order, rope, head, unpatchify)."""
    from diffusers import WanTransformer3DModel

    model, latents, pluckers, text_kv = setup
    ours = copy.deepcopy(model)
    for block in ours.blocks:
        for layer in (block.cam_scale_layer, block.cam_shift_layer):
            layer.weight.zero_()
            layer.bias.zero_()
    wan = WanTransformer3DModel(
        patch_size=CFG.patch_size, num_attention_heads=CFG.num_attention_heads,
        attention_head_dim=CFG.attention_head_dim, in_channels=CFG.in_channels, out_channels=CFG.out_channels,
        text_dim=CFG.text_dim, freq_dim=CFG.freq_dim, ffn_dim=CFG.ffn_dim, num_layers=CFG.num_layers,
        cross_attn_norm=CFG.cross_attn_norm, eps=CFG.eps, rope_max_seq_len=CFG.rope_max_seq_len,
    ).double().eval()
    renamed = {}
    for name, tensor in ours.state_dict().items():
        if "cam" in name or "c2ws" in name:
            continue
        for old, new in _WAN_RENAMES:
            name = name.replace(old, new)
        renamed[name] = tensor
    wan.load_state_dict(renamed, strict=True)

    _, _, text = _inputs()
    t = torch.tensor([0.5, 3.0], dtype=torch.float64)  # small: diffusers builds the sinusoid in float32
    got = ours(latents[0], t, ours.prepare_text(text), pluckers[0], 0)
    want = wan(latents[0], t, text, return_dict=False)[0]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert (want - model(latents[0], t, text_kv, pluckers[0], 0)).abs().max() > 1e-3  # the camera path matters
