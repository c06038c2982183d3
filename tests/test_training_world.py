"""training/world.py trains the structure inference runs: its per-block forwards equal the paged-cache ones."""

import dataclasses

import pytest
import torch

from lingbot_core.config import tiny_config
from lingbot_core.blocks.kv_cache import KVPagePool, SessionKV
from lingbot_core.model.transformer import CausalLingBotWorldTransformer3DModel
from training.world import (RecordKV, WorldTrainConfig, _CommitKV, ReadKV, block_position, motion_weights,
                            rollout_context, sampler_sigmas, teacher_forced_loss)
from lingbot_core.model.attention import context_frames
from lingbot_core.blocks.pages import PageAllocator


def _model_and_inputs(blocks: int):
    # sink one block, window of 3 blocks: the context slides from block 3 on
    config = tiny_config(sink_size=3, sliding_window_num_frames=9)
    torch.manual_seed(0)
    model = CausalLingBotWorldTransformer3DModel(config.transformer)
    model.init_weights(torch.Generator().manual_seed(0))
    model.eval().requires_grad_(False)
    frames = blocks * config.transformer.num_frames_per_block
    t = config.transformer
    x0 = torch.randn(1, t.out_channels, frames, config.latent_height, config.latent_width)
    extra = torch.randn(1, t.in_channels - t.out_channels, frames, config.latent_height, config.latent_width)
    plucker = torch.randn(1, frames, t.camera_channels, config.height, config.width)
    text_kv = model.prepare_text(torch.randn(1, 4, t.text_dim))
    return config, model, x0, extra, plucker, text_kv


def test_training_forwards_equal_the_paged_cache_forwards_across_the_sliding_window():
    blocks = 5
    config, model, x0, extra, plucker, text_kv = _model_and_inputs(blocks)
    per_block, tokens = config.transformer.num_frames_per_block, config.tokens_per_frame
    pool = KVPagePool(config, 16, torch.float32, "cpu")
    page_ids = PageAllocator(pool.num_pages)
    table = SessionKV.empty()
    record = RecordKV()
    x_t = torch.randn_like(x0)
    timestep = torch.full((1,), 500.0)
    for block in range(blocks):
        start = block * per_block
        own = slice(start, start + per_block)
        inputs = torch.cat([x_t[:, :, own], extra[:, :, own]], 1)
        ctx = context_frames(start, config.transformer)
        paged = model(inputs, timestep, text_kv, plucker[:, own], start, cache=table.view(pool, config, start))
        trained = model(inputs, timestep, text_kv, plucker[:, own], start, cache=ReadKV(record, ctx, tokens))
        torch.testing.assert_close(trained, paged, rtol=1e-5, atol=1e-5)
        # commit the clean block both ways
        clean = torch.cat([x0[:, :, own], extra[:, :, own]], 1)
        pages = page_ids.allocate(per_block)
        model(clean, torch.zeros(1), text_kv, plucker[:, own], start, cache=table.view(pool, config, start, pages))
        table, dropped = table.after_commit(config, start, pages)
        page_ids.free(dropped)
        commit = _CommitKV(record, ctx, tokens)
        model(clean, torch.zeros(1), text_kv, plucker[:, own], start, cache=commit)
        record.append(commit)


@pytest.mark.parametrize("shift_blocks", [1, 7])
def test_a_shifted_training_block_attends_as_the_session_block_that_many_blocks_later(shift_blocks):
    """A window trained with its blocks after the sink moved m blocks later in RoPE time computes what a
    session computes m blocks later: the session holds the same sink and the same recent block (m filler
    blocks in between, which the window has slid past), so every forward from window block 2 on is equal.
    Unshifted, the session's sink is m blocks farther away and the forwards differ."""
    blocks = 4
    config, model, x0, extra, plucker, text_kv = _model_and_inputs(blocks)
    per_block, tokens = config.transformer.num_frames_per_block, config.tokens_per_frame
    assert config.transformer.recent_frames == per_block  # the window: the sink and one recent block
    shift = shift_blocks * per_block
    filler = torch.randn(1, x0.shape[1], shift, *x0.shape[3:])

    def session_block(j):  # the session's latents of block j: the window's block 0, filler, then the window
        if j == 0:
            return x0[:, :, :per_block]
        if j <= shift_blocks:
            return filler[:, :, (j - 1) * per_block:j * per_block]
        start = (j - shift_blocks) * per_block
        return x0[:, :, start:start + per_block]

    def window_slice(j):  # extra and plucker of session block j: the window's where the window has one
        w = 0 if j == 0 else max(j - shift_blocks, 1)
        return slice(w * per_block, (w + 1) * per_block)

    pool = KVPagePool(config, 16, torch.float32, "cpu")
    page_ids, table = PageAllocator(pool.num_pages), SessionKV.empty()
    timestep = torch.full((1,), 700.0)
    x_t = torch.randn(1, x0.shape[1], per_block, *x0.shape[3:])
    session_out = {}
    for j in range(blocks + shift_blocks):
        start, own = j * per_block, window_slice(j)
        session_out[j] = model(torch.cat([x_t, extra[:, :, own]], 1), timestep, text_kv, plucker[:, own], start,
                               cache=table.view(pool, config, start))
        pages = page_ids.allocate(per_block)
        model(torch.cat([session_block(j), extra[:, :, own]], 1), torch.zeros(1), text_kv, plucker[:, own], start,
              cache=table.view(pool, config, start, pages))
        table, dropped = table.after_commit(config, start, pages)
        page_ids.free(dropped)

    for moved in (shift, 0):
        record = RecordKV()
        for b in range(blocks):
            start, own = b * per_block, slice(b * per_block, (b + 1) * per_block)
            ctx, position = context_frames(start, config.transformer), block_position(start, moved, config)
            out = model(torch.cat([x_t, extra[:, :, own]], 1), timestep, text_kv, plucker[:, own], position,
                        cache=ReadKV(record, ctx, tokens))
            if b >= 2:
                session = session_out[b + shift_blocks]
                if moved:
                    torch.testing.assert_close(out, session, rtol=1e-5, atol=1e-5)
                else:
                    assert not torch.allclose(out, session, rtol=1e-5, atol=1e-5)  # the sink's distance counts
            commit = _CommitKV(record, ctx, tokens)
            model(torch.cat([x0[:, :, own], extra[:, :, own]], 1), torch.zeros(1), text_kv, plucker[:, own],
                  position, cache=commit)
            record.append(commit)


def test_position_shifts_are_whole_blocks_drawn_per_step_at_the_asked_share():
    tc = WorldTrainConfig(vae="v", clips_dir="c", stored_clips=1, position_shift_share=0.5, position_shift_blocks=64)
    shifts = [tc.position_shift(step, 3) for step in range(2000)]
    assert shifts == [tc.position_shift(step, 3) for step in range(2000)]  # a resumed run draws the same
    moved = [s for s in shifts if s]
    assert 0.45 < len(moved) / len(shifts) < 0.55
    assert all(s % 3 == 0 and 3 <= s <= 192 for s in moved) and {3, 192} <= set(moved)
    assert not any(WorldTrainConfig(vae="v", clips_dir="c", stored_clips=1).position_shift(s, 3) for s in range(200))
    config = _model_and_inputs(1)[0]
    assert [block_position(start, 6, config) for start in (0, 3, 6)] == [0, 9, 12]
    with pytest.raises(ValueError, match="whole number of blocks"):
        block_position(3, 4, config)
    with pytest.raises(ValueError, match="position_shift_share"):
        WorldTrainConfig(vae="v", clips_dir="c", stored_clips=1, position_shift_share=1.5)


def test_teacher_forced_loss_trains_and_rollout_context_has_the_latent_shape():
    config, model, x0, extra, plucker, text_kv = _model_and_inputs(3)
    model.train().requires_grad_(True)
    batch = {"latents": x0, "context": x0, "extra": extra, "plucker": plucker}
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(12):
        generator = torch.Generator().manual_seed(0)  # the same noise and sigmas each step
        kv = model.prepare_text(torch.ones(1, 4, config.transformer.text_dim))
        loss = teacher_forced_loss(model, config, batch, kv, generator)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]
    model.eval()
    kv = model.prepare_text(torch.ones(1, 4, config.transformer.text_dim))
    context = rollout_context(model, config, batch, kv, torch.Generator().manual_seed(1))
    assert context.shape == x0.shape and torch.isfinite(context).all()


@pytest.mark.parametrize("extra_flow_shifts", [(), (1.0,), (1.0, 5.0)])
def test_the_denoiser_trains_at_the_presets_sigmas_and_those_of_the_extra_flow_shifts(extra_flow_shifts):
    config = tiny_config()
    own = config.sampler.sigmas()
    other = dataclasses.replace(config.sampler, flow_shift=1.0).sigmas()  # 1, 0.75, 0.5, 0.25
    expected = own + ([s for s in other if s not in own] if extra_flow_shifts else [])
    assert sampler_sigmas(config, extra_flow_shifts).tolist() == pytest.approx(expected)
    assert len(expected) == (7 if extra_flow_shifts else 4)  # sigma 1 is in both schedules, once

    # The noisy forwards of teacher_forced_loss see every one of those timesteps and no other; the
    # commit forwards see t=0.
    t = config.transformer
    seen: list[float] = []

    def model(inputs, timestep, text_kv, plucker, position, cache):
        seen.extend(timestep.tolist())
        return torch.zeros(inputs.shape[0], t.out_channels, *inputs.shape[2:])

    blocks, batch = 4, 16
    frames = blocks * t.num_frames_per_block
    x0 = torch.randn(batch, t.out_channels, frames, config.latent_height, config.latent_width)
    data = {"latents": x0, "context": x0,
            "extra": torch.zeros(batch, t.in_channels - t.out_channels, *x0.shape[2:]),
            "plucker": torch.zeros(batch, frames, t.camera_channels, config.height, config.width)}
    teacher_forced_loss(model, config, data, None, torch.Generator().manual_seed(0),
                        extra_flow_shifts=extra_flow_shifts)
    noisy = sorted({round(x, 2) for x in seen if x > 0})  # float32 timesteps
    assert noisy == sorted({round(config.sampler.num_train_timesteps * s, 2) for s in expected})
    assert seen.count(0.0) == blocks * batch
    with pytest.raises(ValueError, match="flow shift"):
        WorldTrainConfig(vae="v", clips_dir="c", stored_clips=1, extra_flow_shifts=(0.0,))
    # A checkpoint stores them as a list; the run's settings compare equal to the command's tuple.
    assert WorldTrainConfig(vae="v", clips_dir="c", stored_clips=1, extra_flow_shifts=[5]).extra_flow_shifts == (5.0,)


def test_motion_weights_count_where_the_true_latents_change():
    x0 = torch.zeros(1, 2, 3, 2, 2)
    x0[:, :, 2, 0, 0] = 1.0  # one position of frame 2 differs from frame 1, in both channels
    weights = motion_weights(x0, 4.0)
    assert weights.shape == (1, 1, 3, 2, 2)
    # The mean change over the batch is 1/12, so the changed position weighs 1 + 4 * 12; the rest 1.
    assert weights[0, 0, 2, 0, 0].item() == pytest.approx(49.0)
    assert weights.sum().item() == pytest.approx(11 + 49.0)
    assert torch.equal(motion_weights(x0, 0.0), torch.ones_like(weights))  # 0: plain mean squared error


def test_a_mirrored_clip_has_the_mirrored_keys_and_the_mirrored_camera():
    """--mirror trains on each clip flipped left to right under A<->D, J<->L. That is an exact clip only
    if the camera path of the swapped keys is the mirror image of the original's: the Plücker map of
    the mirrored keys must equal the original's flipped along x, with the x components of the ray
    origin and direction negated."""
    from training.data import actions_to_array, array_to_actions, mirror_actions
    from training.world import block_pluckers

    script = [frozenset(), frozenset(), frozenset(),
              frozenset("j"), frozenset("jw"), frozenset("l"),
              frozenset("a"), frozenset("dk"), frozenset("wi"),
              frozenset("lw"), frozenset("s"), frozenset()]
    mirrored = array_to_actions(mirror_actions(actions_to_array(script)))
    swap = str.maketrans("adjl", "dalj")
    assert mirrored == tuple(frozenset(k.translate(swap) for k in keys) for keys in script)
    array = actions_to_array(script)
    assert (mirror_actions(mirror_actions(array)) == array).all()  # a mirror of a mirror is the clip

    config = tiny_config()
    original = block_pluckers(config, script, blocks=4)
    image = block_pluckers(config, mirrored, blocks=4)
    expected = original.flip(-1)
    expected[:, [0, 3]] *= -1  # origin x, direction x
    torch.testing.assert_close(image, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(image, original, atol=1e-3)  # the turns make the two paths differ
    # From a start that is pitched and turned (a pitched clip; encode_clips mirrors its start pose as
    # mirror_poses) the mirrored keys from the mirrored start are the mirror image too.
    import numpy as np

    from lingbot_core.model import camera
    from training.data import mirror_poses, pitched_state, start_state

    start_pose = camera.integrate_actions(pitched_state(36.0), [frozenset("l")] * 2, config.camera)[1].pose
    mirrored_start = mirror_poses(torch.from_numpy(start_pose)).numpy()
    original = block_pluckers(config, script, 4, start_state(start_pose))
    image = block_pluckers(config, mirrored, 4, start_state(mirrored_start))
    expected = original.flip(-1)
    expected[:, [0, 3]] *= -1
    torch.testing.assert_close(image, expected, rtol=1e-5, atol=1e-5)
    assert not np.allclose(start_pose, mirrored_start)


def test_mirrored_clips_encode_as_their_flipped_frames_with_mirrored_keys():
    """encode_clips(mirrored=True) equals the plain encode of clips whose frames are flipped and whose
    keys are mirrored (the latents, the start frame's condition stream and the key array)."""
    import numpy as np

    from lingbot_core.blocks.loading import build_seeded_parts
    from lingbot_core.model import camera
    from training.data import mirror_actions, pitched_state
    from training.world import encode_clips

    config = tiny_config()
    vae = build_seeded_parts(config, 0).vae
    frames = config.pixel_frames_for_blocks(2)
    rng = np.random.default_rng(0)

    class Clips:
        def __init__(self, flipped: bool) -> None:
            self.videos = [v[:, :, ::-1].copy() if flipped else v for v in videos]
            mirror = np.diag([-1.0, 1.0, 1.0, 1.0])  # a pose seen through x -> -x
            self.items = [{"actions": mirror_actions(a) if flipped else a,
                           "latent_poses": (mirror @ p @ mirror) if flipped else p} for a, p in zip(actions, poses)]

        def __len__(self) -> int:
            return len(self.videos)

        def video(self, index: int, start: int, count: int) -> torch.Tensor:
            return torch.from_numpy(self.videos[index][start:start + count]).permute(3, 0, 1, 2).float() / 127.5 - 1

    videos = [rng.integers(0, 256, (frames, config.height, config.width, 3), dtype=np.uint8) for _ in range(3)]
    actions = [rng.integers(0, 2, (6, 8), dtype=np.uint8) for _ in range(3)]
    # start poses pitched and turned (training.data --start-pitch, then keys), one per clip
    poses = [camera.integrate_actions(pitched_state(p), [frozenset("j")] * 2, config.camera)[0]
             for p in (-48.0, 0.0, 20.0)]
    mirrored = encode_clips(vae, config, Clips(flipped=False), 2, batch=2, mirrored=True)
    reference = encode_clips(vae, config, Clips(flipped=True), 2, batch=2)
    for key in ("latents", "conditions", "actions", "start_poses"):
        torch.testing.assert_close(mirrored[key], reference[key], rtol=0, atol=0)
    plain = encode_clips(vae, config, Clips(flipped=False), 2, batch=2)
    assert not torch.equal(plain["latents"], mirrored["latents"])


def test_init_from_loads_the_exported_weights_and_refuses_a_model_of_another_shape(tmp_path):
    """--init-from starts a run from an exported transformer folder: the run's model then holds the
    export's (fp16) weights exactly; a folder of another size is refused by name, not half loaded."""
    import dataclasses
    from safetensors.torch import save_file

    from training.world import load_exported_weights

    config = tiny_config()
    source = CausalLingBotWorldTransformer3DModel(config.transformer)
    source.init_weights(torch.Generator().manual_seed(1))
    folder = tmp_path / "model" / "transformer"
    folder.mkdir(parents=True)
    save_file({k: v.to(torch.float16).contiguous() for k, v in source.state_dict().items()},
              folder / "diffusion_pytorch_model.safetensors")
    target = CausalLingBotWorldTransformer3DModel(config.transformer)
    target.init_weights(torch.Generator().manual_seed(2))
    load_exported_weights(target, tmp_path / "model")
    for name, value in source.state_dict().items():
        torch.testing.assert_close(target.state_dict()[name], value.to(torch.float16).to(value.dtype), rtol=0, atol=0)

    wider = dataclasses.replace(config.transformer, ffn_dim=config.transformer.ffn_dim * 2)
    other = CausalLingBotWorldTransformer3DModel(wider)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(ValueError, match="do not fit"):
        load_exported_weights(other, tmp_path / "model")
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())
    with pytest.raises(ValueError, match="does not exist"):
        load_exported_weights(target, tmp_path / "nowhere")


def test_a_grown_encoding_cache_equals_encoding_all_clips_at_once(tmp_path):
    """A run resumed with more stored clips appends the new clips' encodings to its cache; the result
    equals a fresh encode of all of them, and the clips are read only when something is missing."""
    import numpy as np

    from lingbot_core.blocks.loading import build_seeded_parts
    from training.data import StoredClips
    from training.world import cached_encoding, encode_clips

    config = tiny_config()
    vae = build_seeded_parts(config, 0).vae
    frames = config.pixel_frames_for_blocks(2)
    rng = np.random.default_rng(0)
    for i in range(5):
        np.savez(tmp_path / f"clip_{i:07d}.npz",
                 video=rng.integers(0, 256, (frames, config.height, config.width, 3), dtype=np.uint8),
                 actions=rng.integers(0, 2, (6, 8), dtype=np.uint8), latent_poses=np.zeros((6, 4, 4)),
                 intrinsics=np.zeros(4), world_seed=np.int64(i))
    cache = tmp_path / "latents.pt"
    encoded = []  # the clips whose frames were read, one list per call of the clip source

    class CountingClips(StoredClips):
        def video(self, index, start=0, frames=None):
            encoded[-1].append(index)
            return super().video(index, start, frames)

    def stored(count):
        def read():
            encoded.append([])
            return CountingClips(tmp_path, count)
        return read

    for mirrored in (False, True):
        cache.unlink(missing_ok=True)
        first = cached_encoding(cache, vae, config, stored(3), 3, 2, mirrored)
        assert len(first["latents"]) == 3
        grown = cached_encoding(cache, vae, config, stored(5), 5, 2, mirrored)
        assert sorted(set(encoded[-1])) == [3, 4]  # only the new clips were encoded
        reference = encode_clips(vae, config, StoredClips(tmp_path, 5), 2, mirrored=mirrored)
        for key in ("latents", "conditions", "actions"):
            torch.testing.assert_close(grown[key], reference[key], rtol=1e-5, atol=1e-5)
        assert torch.equal(grown["latents"][:3], first["latents"])  # the cached clips are kept as they were
        calls = len(encoded)
        again = cached_encoding(cache, vae, config, stored(5), 5, 2, mirrored)
        assert torch.equal(again["latents"], grown["latents"]) and len(encoded) == calls  # nothing read
        # A cache grown by a run that stopped before its first checkpoint under the new count.
        fewer = cached_encoding(cache, vae, config, stored(4), 4, 2, mirrored)
        assert len(encoded) == calls and all(torch.equal(fewer[k], grown[k][:4]) for k in grown)


def test_a_run_may_resume_with_more_stored_clips_but_not_fewer(tmp_path):
    from training.world import CHECKPOINT, CHECKPOINT_FORMAT, load_checkpoint

    tc = WorldTrainConfig(vae="v", clips_dir="c", stored_clips=380)
    torch.save({"format": CHECKPOINT_FORMAT, "train_config": dataclasses.asdict(tc)}, tmp_path / CHECKPOINT)
    saved, _ = load_checkpoint(tmp_path, dataclasses.replace(tc, stored_clips=540))
    assert saved.stored_clips == 380
    with pytest.raises(ValueError, match="stored_clips"):
        load_checkpoint(tmp_path, dataclasses.replace(tc, stored_clips=300))
    with pytest.raises(ValueError, match="blocks"):
        load_checkpoint(tmp_path, dataclasses.replace(tc, stored_clips=540, blocks=8))


def test_cameras_of_a_pitched_clip_are_integrated_from_its_start_pose():
    """A clip that starts pitched (training.data --start-pitch) trains on the Plücker maps a session
    builds once it has reached that pitch: each block anchored on the previous block's last pose, from
    the clip's own start. Its walk moves horizontally and its turn about the vertical, so a path
    integrated from the level start would give other maps."""
    import numpy as np

    from lingbot_core.model import camera
    from training.data import mirror_poses, pitched_state, start_state
    from training.world import block_pluckers

    config = tiny_config()
    cfg, per_block = config.camera, config.transformer.num_frames_per_block
    script = [frozenset()] * per_block + [frozenset("w")] * per_block + [frozenset("jw")] * per_block
    start = pitched_state(-48.0)
    poses, _ = camera.integrate_actions(start, script, cfg)
    recovered = start_state(poses[0])
    maps = block_pluckers(config, script, blocks=3, start=recovered)
    intrinsics = camera.reference_intrinsics(cfg, per_block, config.width, config.height)
    for block in range(3):
        anchor = start.pose if block == 0 else poses[block * per_block - 1]
        expected = camera.plucker_block(anchor, poses[block * per_block:(block + 1) * per_block], intrinsics,
                                        config.width, config.height, cfg)
        torch.testing.assert_close(maps[block * per_block:(block + 1) * per_block], expected, rtol=1e-5, atol=1e-5)
    level = block_pluckers(config, script, blocks=3)
    assert not torch.allclose(maps[per_block:], level[per_block:], atol=1e-3)
    assert torch.equal(block_pluckers(config, script, 3, start_state(np.eye(4))), level)


def test_world_data_holds_each_clips_cameras_from_its_start_pose_mirror_images_included(tmp_path):
    """WorldData's Plücker maps (filled clip by clip, so the host never holds them twice) are, for every
    stored clip and every mirror image, block_pluckers of that clip's keys from its start pose; a batch
    hands out the maps of the clips it draws."""
    import numpy as np

    from lingbot_core.blocks.loading import build_seeded_parts
    from lingbot_core.model import camera
    from training.data import actions_to_array, array_to_actions, pitched_state, start_state
    from training.world import WorldData, block_pluckers

    config = tiny_config()
    vae = build_seeded_parts(config, 0).vae
    blocks, per_block = 2, config.transformer.num_frames_per_block
    frames = config.pixel_frames_for_blocks(blocks)
    rng = np.random.default_rng(1)
    for i, pitch in enumerate((0.0, -24.0, 36.0)):
        keys = [frozenset("jw"), frozenset("i"), frozenset("d")][i]
        script = [frozenset()] * per_block + [keys] * per_block
        poses, _ = camera.integrate_actions(pitched_state(pitch), script, config.camera)
        actions = actions_to_array(script)
        np.savez(tmp_path / f"clip_{i:07d}.npz",
                 video=rng.integers(0, 256, (frames, config.height, config.width, 3), dtype=np.uint8),
                 actions=actions, latent_poses=poses, intrinsics=np.zeros(4), world_seed=np.int64(i))
    tc = WorldTrainConfig(vae="v", clips_dir=str(tmp_path), stored_clips=3, blocks=blocks, mirror=True, batch=4)
    data = WorldData(tc, config, vae, tmp_path)
    assert data.plucker.shape == (6, blocks * per_block, 6, config.height, config.width)
    cached = torch.load(tmp_path / "latents.pt", weights_only=True)
    mirrored = torch.load(tmp_path / "latents_mirrored.pt", weights_only=True)
    for index, part in enumerate((cached, mirrored)):
        for clip in range(3):
            expected = block_pluckers(config, array_to_actions(part["actions"][clip].numpy()), blocks,
                                      start_state(part["start_poses"][clip].numpy()))
            assert torch.equal(data.plucker[3 * index + clip], expected)
    assert not torch.allclose(data.plucker[0], data.plucker[3])  # a turn's mirror image turns the other way
    batch = data.batch(tc, 0)
    drawn = [int(np.random.default_rng([tc.data_seed, 11, j]).integers(6)) for j in range(tc.batch)]
    assert torch.equal(batch["plucker"], data.plucker[drawn])


def test_own_rollouts_roll_out_every_clip_in_order_from_its_own_condition_and_keys(monkeypatch):
    """training.world --rollouts: one rollout per stored clip, clips 0 .. count - 1 in order, each from its
    own condition and cameras (clip i's rollout is rollout_context of clip i's inputs), in half precision."""
    import training.world as world

    config, model, _, extra, plucker, _ = _model_and_inputs(2)
    monkeypatch.setattr(world, "text_states", lambda c: torch.randn(len(world.PROMPTS), 4, c.transformer.text_dim,
                                                                     generator=torch.Generator().manual_seed(3)))
    clips = 5
    extras = extra.repeat(clips, 1, 1, 1, 1) + torch.arange(clips).view(-1, 1, 1, 1, 1)  # each clip its own
    pluckers = plucker.repeat(clips, 1, 1, 1, 1)

    class Data:
        asked: list[list[int]] = []

        def items(self, index):
            self.asked.append(index)
            return {"extra": extras[index], "plucker": pluckers[index]}

    data = Data()
    got = world.own_rollouts(model, config, data, clips, seed=4, batch=2, progress=False)
    assert data.asked == [[0, 1], [2, 3], [4]] and got.dtype == torch.float16
    assert got.shape == (clips, config.transformer.out_channels, *extra.shape[2:])
    # The second batch alone, drawn as own_rollouts draws it: after the first batch's prompt and noise,
    # its prompt, then its sampler noise.
    generator = torch.Generator().manual_seed(4)
    texts = world.text_states(config)
    for index in ([0, 1], [2, 3]):
        prompt = torch.randint(len(world.PROMPTS), (1,), generator=generator).item()
        want = world.rollout_context(model, config, data.items(index),
                                     model.prepare_text(texts[prompt:prompt + 1].expand(2, -1, -1)), generator)
    assert torch.equal(got[2:4], want.half())
    assert not torch.equal(got[2], got[3])
