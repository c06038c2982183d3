"""Oracle tests: the streaming Wan VAE equals diffusers' one-shot encode / decode."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from diffusers import AutoencoderKLWan

from lingbot_core.config import patched_vae, tiny_config
from lingbot_core.model.vae_stream import (
    ConditionStream,
    DecoderStream,
    StreamOrderError,
    VaeNotStreamableError,
    build_vae,
    check_streamable,
    compile_frame_decoder,
    condition_mask,
    decode_block,
    decode_latent_frame,
    encode_condition_block,
)

CFG = tiny_config()
# The same spatial factor as a patched VAE (diffusers' patch_size, as the Wan 2.2 VAE folds pixels into
# channels): 2x2 patches, then two halvings instead of three.
PATCHED_VAE = patched_vae(CFG.vae)
LAYOUTS = {"plain": CFG, "patched": dataclasses.replace(CFG, vae=PATCHED_VAE)}
LATENT_FRAMES = CFG.transformer.num_frames_per_block
CONDITION_BLOCKS = 14  # the tiny VAE reaches its fixed point at block 10; check blocks past it


def _stats(vae, like):
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean, dtype=like.dtype).view(shape)
    std = torch.tensor(vae.config.latents_std, dtype=like.dtype).view(shape)
    return mean, std


def _image(dtype):
    g = torch.Generator().manual_seed(1)
    return torch.rand(1, 3, CFG.height, CFG.width, generator=g, dtype=dtype) * 2 - 1


def _latents(num_frames, dtype, seed=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, CFG.transformer.out_channels, num_frames, CFG.latent_height, CFG.latent_width,
                       generator=g, dtype=dtype)


pytestmark = pytest.mark.usefixtures("single_thread")  # conftest: one intra-op thread for tiny tensors


@pytest.fixture(scope="module", params=[(torch.float64, "plain"), (torch.float32, "plain"), (torch.float64, "patched")],
                ids=["fp64", "fp32", "fp64-patched"])
def vae(request):
    dtype, layout = request.param
    return build_vae(LAYOUTS[layout], dtype, "cpu", seed=0)


@pytest.fixture(scope="module", params=["plain", "patched"])
def vae64(request):
    return build_vae(LAYOUTS[request.param], torch.float64, "cpu", seed=0)


def _one_shot_condition(vae, image, num_blocks):
    """Reference: encode [image, 0, 0, ...] at once, posterior mean, normalised per channel."""
    clip = torch.zeros(1, 3, CFG.pixel_frames_for_blocks(num_blocks), CFG.height, CFG.width, dtype=image.dtype)
    clip[:, :, 0] = image
    with torch.no_grad():
        mu = vae.encode(clip).latent_dist.mean
    mean, std = _stats(vae, mu)
    return (mu - mean) / std


# ---------------------------------------------------------------------------------------------
# Condition encoder


def test_condition_stream_equals_one_shot_and_reaches_fixed_point(vae):
    dtype = next(vae.parameters()).dtype
    image = _image(dtype)
    reference = _one_shot_condition(vae, image, CONDITION_BLOCKS)
    assert reference.shape[2] == CONDITION_BLOCKS * LATENT_FRAMES

    encoder_calls = []
    hook = vae.encoder.register_forward_pre_hook(lambda *_: encoder_calls.append(1))
    try:
        state = ConditionStream.start(image)
        fixed_at = None
        for k in range(CONDITION_BLOCKS):
            calls_before = len(encoder_calls)
            cond, state = encode_condition_block(vae, state, k, CFG)
            assert cond.shape == (1, vae.config.z_dim, LATENT_FRAMES, CFG.latent_height, CFG.latent_width)
            expected = reference[:, :, k * LATENT_FRAMES : (k + 1) * LATENT_FRAMES]
            if dtype == torch.float64:
                assert torch.equal(cond, expected), f"block {k}"
            else:
                torch.testing.assert_close(cond, expected, rtol=0, atol=1e-5, msg=f"block {k}")
            assert state.image is None  # the image is not needed after block 0

            if fixed_at is not None:
                # Past the fixed point: no encoder call, only the condition is held.
                assert state.fixed and state.history is None
                assert len(encoder_calls) == calls_before
                assert state.nbytes() == cond.nbytes
            elif state.fixed:
                fixed_at = k
                assert state.history is None and state.nbytes() == cond.nbytes
            else:
                assert len(encoder_calls) - calls_before == LATENT_FRAMES  # one chunk per latent frame
                assert state.nbytes() > cond.nbytes  # history is held until the fixed point
    finally:
        hook.remove()

    assert fixed_at is not None, "the encoder history never reproduced itself"
    assert fixed_at >= 1  # block 0's history is new by definition
    assert fixed_at <= CONDITION_BLOCKS - 3, "need blocks past the fixed point to check them"


def test_condition_pending_never_mutates_committed(vae64):
    image = _image(torch.float64)
    _, committed = encode_condition_block(vae64, ConditionStream.start(image), 0, CFG)
    history_before = list(committed.history)
    snapshot = [e.clone() if isinstance(e, torch.Tensor) else e for e in committed.history]

    cond_a, pending_a = encode_condition_block(vae64, committed, 1, CFG)
    del pending_a  # the block "failed": drop pending, retry from the committed state
    cond_b, pending_b = encode_condition_block(vae64, committed, 1, CFG)

    assert torch.equal(cond_a, cond_b)
    assert committed.next_block == 1 and pending_b.next_block == 2
    assert pending_b.history is not committed.history
    assert all(a is b for a, b in zip(committed.history, history_before))  # no slot reassigned
    for kept, saved in zip(committed.history, snapshot):
        assert (kept is None) == (saved is None)
        if kept is not None:
            assert torch.equal(kept, saved)  # no tensor written in place
    # The retried pending state moved on: it differs from the committed history.
    assert any(not torch.equal(a, b) for a, b in zip(committed.history, pending_b.history) if a is not None)


def test_condition_blocks_must_come_in_order(vae64):
    state = ConditionStream.start(_image(torch.float64))
    with pytest.raises(StreamOrderError, match="expects block 0, got block 1"):
        encode_condition_block(vae64, state, 1, CFG)


def test_condition_inputs_are_checked(vae64):
    with pytest.raises(ValueError, match=r"\[1, 3, H, W\]"):
        ConditionStream.start(torch.zeros(3, CFG.height, CFG.width))
    with pytest.raises(ValueError, match=r"in \[-1, 1\]"):
        ConditionStream.start(torch.full((1, 3, CFG.height, CFG.width), 255.0))
    small = ConditionStream.start(torch.zeros(1, 3, CFG.height // 2, CFG.width, dtype=torch.float64))
    with pytest.raises(ValueError, match="model runs at"):
        encode_condition_block(vae64, small, 0, CFG)


def test_condition_mask_marks_latent_frame_zero_only():
    first = condition_mask(CFG, 0, "cpu", torch.float32)
    later = condition_mask(CFG, 1, "cpu", torch.float32)
    shape = (1, CFG.transformer.mask_channels, LATENT_FRAMES, CFG.latent_height, CFG.latent_width)
    assert first.shape == later.shape == shape
    assert torch.equal(first[:, :, 0], torch.ones_like(first[:, :, 0]))
    assert not first[:, :, 1:].any() and not later.any()


# ---------------------------------------------------------------------------------------------
# Decoder


def test_decode_stream_equals_one_shot(vae64):
    blocks = 5
    latents = _latents(blocks * LATENT_FRAMES, torch.float64)
    mean, std = _stats(vae64, latents)
    with torch.no_grad():
        reference = vae64.decode(latents * std + mean).sample
    assert reference.abs().max() > 0.1  # not a degenerate all-zero video

    state = DecoderStream()
    outputs = []
    for k in range(blocks):
        frames, state = decode_block(vae64, state, latents[:, :, k * LATENT_FRAMES : (k + 1) * LATENT_FRAMES])
        expected_frames = (CFG.pixel_frames_for_blocks(1) if k == 0 else CFG.pixel_frames_per_block)
        assert frames.shape == (1, 3, expected_frames, CFG.height, CFG.width)
        assert frames.abs().max() <= 1.0
        outputs.append(frames)
    assert torch.equal(torch.cat(outputs, dim=2), reference)


def test_decode_pending_never_mutates_committed(vae64):
    latents = _latents(2 * LATENT_FRAMES, torch.float64)
    _, committed = decode_block(vae64, DecoderStream(), latents[:, :, :LATENT_FRAMES])
    snapshot = [e.clone() if isinstance(e, torch.Tensor) else e for e in committed.cache]

    frames_a, _ = decode_block(vae64, committed, latents[:, :, LATENT_FRAMES:])
    frames_b, pending = decode_block(vae64, committed, latents[:, :, LATENT_FRAMES:])

    assert torch.equal(frames_a, frames_b)
    assert frames_a.shape[2] == CFG.pixel_frames_per_block  # not restarted as a first chunk
    assert committed.latent_frames_decoded == LATENT_FRAMES
    assert pending.latent_frames_decoded == 2 * LATENT_FRAMES
    for kept, saved in zip(committed.cache, snapshot):
        if isinstance(saved, torch.Tensor):
            assert torch.equal(kept, saved)
        else:
            assert kept == saved


def test_decoder_state_is_bounded():
    vae = build_vae(CFG, torch.float32, "cpu", seed=0)
    state = DecoderStream()
    sizes = []
    for k in range(20):
        _, state = decode_block(vae, state, _latents(LATENT_FRAMES, torch.float32, seed=10 + k))
        sizes.append(state.nbytes())
        # Each causal conv keeps at most two frames of its input.
        assert all(e.shape[2] <= 2 for e in state.cache if isinstance(e, torch.Tensor))
    assert sizes[1] > 0
    assert len(set(sizes[1:])) == 1, sizes


def test_decode_rejects_bad_latents(vae64):
    with pytest.raises(ValueError, match="latents must be"):
        decode_block(vae64, DecoderStream(), torch.zeros(1, 4, 3, CFG.latent_height, CFG.latent_width))


def _decode_blocks_with(vae, decode_frame, blocks=3):
    state, outputs = DecoderStream(), []
    latents = _latents(blocks * LATENT_FRAMES, torch.float32)
    for k in range(blocks):
        frames, state = decode_block(vae, state, latents[:, :, k * LATENT_FRAMES : (k + 1) * LATENT_FRAMES],
                                     decode_frame=decode_frame)
        outputs.append(frames)
    return torch.cat(outputs, dim=2), state


@pytest.mark.slow  # a minute or more on 2 cores: .ci/run runs it, the fast suite does not
def test_frame_decoder_traces_as_one_graph():
    """Dynamo captures the whole one-frame step (fullgraph: no graph break) and replays it exactly."""
    torch._dynamo.reset()
    vae = build_vae(CFG, torch.float32, "cpu", seed=0)
    eager, _ = _decode_blocks_with(vae, decode_latent_frame)
    traced, _ = _decode_blocks_with(vae, compile_frame_decoder(backend="eager", fullgraph=True))
    assert torch.equal(traced, eager)


@pytest.mark.skipif(os.environ.get("LINGBOT_TEST_COMPILE") != "1", reason="set LINGBOT_TEST_COMPILE=1 (slow)")
def test_compiled_frame_decoder_matches_eager():
    torch._dynamo.reset()
    vae = build_vae(CFG, torch.float32, "cpu", seed=0)
    eager, _ = _decode_blocks_with(vae, decode_latent_frame)
    compiled, _ = _decode_blocks_with(vae, compile_frame_decoder())
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# Building and refusing VAEs


def test_build_vae_is_deterministic_and_leaves_global_rng_alone():
    rng_before = torch.get_rng_state()
    a = build_vae(CFG, torch.float32, "cpu", seed=3).state_dict()
    b = build_vae(CFG, torch.float32, "cpu", seed=3).state_dict()
    c = build_vae(CFG, torch.float32, "cpu", seed=4).state_dict()
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)
    assert all(v.dtype == torch.float32 for v in a.values())


def _tiny_vae(**overrides):
    kwargs = dict(CFG.vae, base_dim=4)
    kwargs.update(overrides)
    return AutoencoderKLWan(**kwargs)


def test_refuses_tiled_vae(vae64):
    vae = _tiny_vae()
    vae.enable_tiling()
    with pytest.raises(VaeNotStreamableError, match="tiling"):
        check_streamable(vae)
    with pytest.raises(VaeNotStreamableError, match="tiling"):
        decode_block(vae, DecoderStream(), _latents(LATENT_FRAMES, torch.float32))
    with pytest.raises(VaeNotStreamableError, match="tiling"):
        encode_condition_block(vae, ConditionStream.start(_image(torch.float32)), 0, CFG)


def test_patched_vae_streams_and_refuses_a_patch_that_is_not_rgb():
    vae = _tiny_vae(**{k: PATCHED_VAE[k] for k in ("dim_mult", "temperal_downsample", "patch_size", "in_channels",
                                                   "out_channels")})
    check_streamable(vae, CFG)  # 2x2 patches x 4 = the model's spatial factor 8
    with pytest.raises(VaeNotStreamableError, match="patch_size=2 with in_channels=3"):
        check_streamable(_tiny_vae(patch_size=2, dim_mult=[1, 2, 4], temperal_downsample=[True, True]))
    with pytest.raises(VaeNotStreamableError, match="vae_spatial_factor=8 but the VAE's is 16"):
        check_streamable(_tiny_vae(patch_size=2, in_channels=12, out_channels=12), CFG)  # three halvings too


def test_refuses_residual_vae():
    with pytest.raises(VaeNotStreamableError, match="is_residual"):
        check_streamable(_tiny_vae(is_residual=True))


@pytest.mark.parametrize("temporal", [[False, False, True], [True, True, True], [False, False, False]])
def test_refuses_wrong_temporal_factor(temporal):
    with pytest.raises(VaeNotStreamableError, match="temporal factor"):
        check_streamable(_tiny_vae(temperal_downsample=temporal))


def test_refuses_vae_that_does_not_match_the_model_config(vae64):
    check_streamable(vae64, CFG)  # the matching pair passes
    wrong_latent = dataclasses.replace(CFG, transformer=dataclasses.replace(CFG.transformer, out_channels=8,
                                                                           in_channels=20))
    with pytest.raises(VaeNotStreamableError, match="z_dim"):
        check_streamable(vae64, wrong_latent)
    with pytest.raises(VaeNotStreamableError, match="vae_temporal_factor"):
        check_streamable(vae64, dataclasses.replace(CFG, vae_temporal_factor=8))


def test_a_shared_streams_byte_count_never_waits_for_a_running_encode(monkeypatch):
    """Engine.stats() (every block, every viewer) asks the shared streams for their bytes while holding the
    engine's lock; if that waited for another session's encoder pass (seconds on a CPU), every viewer's
    next message, key press and admission would wait too."""
    import threading

    from lingbot_core.model import vae_stream

    config = CFG
    encoding, release = threading.Event(), threading.Event()
    real_encode = vae_stream.encode_condition_block

    def held_encode(*args, **kwargs):
        encoding.set()
        release.wait(60)
        return real_encode(*args, **kwargs)

    monkeypatch.setattr(vae_stream, "encode_condition_block", held_encode)
    vae = build_vae(config, torch.float32, "cpu", seed=0)
    shared = vae_stream.SharedCondition(_image(torch.float32))
    before = shared.nbytes()
    encoder = threading.Thread(target=shared.block, args=(vae, 0, config))
    encoder.start()
    try:
        assert encoding.wait(60)
        counted: list[int] = []
        reader = threading.Thread(target=lambda: counted.append(shared.nbytes()))
        reader.start()
        reader.join(30)
        assert counted == [before], "nbytes waited for the encode (or changed before the block was kept)"
    finally:
        release.set()
        encoder.join(60)
    assert shared.blocks_known == 1 and shared.nbytes() > before
