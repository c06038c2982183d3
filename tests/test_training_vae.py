"""training/vae.py: the VAE learns, resuming is bit-exact, and the export loads through the real loader.

Tiny sizes (32x32 frames, base width 4, one block of 9 frames) on one thread, so the file runs in seconds.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from lingbot_core.config import tiny_config
from lingbot_core.blocks.loading import load_folder
from tests.checkpoint_writer import write_tiny_checkpoint
from training.data import make_clip
from training.vae import (CHECKPOINT, EXPORT_WEIGHTS, LOG, VaeTrainConfig, block_psnr, export_vae, load_checkpoint,
                          measured_latent_stats, new_optimizer, new_vae, psnr, start_latent_stats, stream_reconstruct,
                          train, train_step)

TINY = VaeTrainConfig(height=32, width=32, base_dim=4, decoder_base_dim=None, z_dim=4, blocks=1, batch=1,
                      lr=2e-3, supersample=1)


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    yield


def test_steps_lower_the_loss_on_a_fixed_batch():
    vae, video = new_vae(TINY), make_clip(0, 0, TINY.model_config(), 1, 1).video.unsqueeze(0)
    optimizer, generator = new_optimizer(vae, TINY), torch.Generator().manual_seed(0)
    first = train_step(vae, optimizer, video, TINY, generator)["rec"]
    for _ in range(5):
        last = train_step(vae, optimizer, video, TINY, generator)["rec"]
    assert last < 0.9 * first, (first, last)


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("straight")
    vae = train(TINY, run_dir, 3, checkpoint_every=1)
    return run_dir, vae


def test_resume_equals_straight_training_bit_exactly(tmp_path, straight_run):
    straight_dir, straight = straight_run
    vae = train(TINY, tmp_path, 1)
    assert (tmp_path / CHECKPOINT).exists()
    # A run that logged a step but died before saving it: the resumed run drops that line, then redoes the step.
    with open(tmp_path / LOG, "a") as log:
        log.write(json.dumps({"step": 2, "loss": 9.0}) + "\n")
    resumed = train(TINY, tmp_path, 3)
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), name
    assert not torch.equal(vae.encoder.conv_in.weight, resumed.encoder.conv_in.weight)  # it did train on
    assert _log_rows(tmp_path) == _log_rows(straight_dir)  # the stale line is gone, the rest is the same
    _, state = load_checkpoint(tmp_path, TINY)
    assert state["step"] == 3 and state["next_clip"] == 3


def _log_rows(run_dir) -> list[dict]:
    """The loss log without its wall-clock column."""
    return [{k: v for k, v in json.loads(line).items() if k != "seconds"}
            for line in (run_dir / LOG).read_text().splitlines()]


def test_resume_refuses_other_settings(tmp_path, straight_run):
    straight_dir, _ = straight_run
    shutil.copy(straight_dir / CHECKPOINT, tmp_path / CHECKPOINT)
    with pytest.raises(ValueError, match="lr"):
        train(VaeTrainConfig(**{**TINY.__dict__, "lr": 1e-4}), tmp_path, 5)
    assert load_checkpoint(tmp_path, TINY)[1]["step"] == 3  # the checkpoint is untouched


def test_export_loads_through_the_loader_and_reconstructs_the_same(tmp_path, straight_run):
    _, vae = straight_run
    mean, std = measured_latent_stats(vae, TINY, clips=2)
    exported = export_vae(vae, tmp_path / "export", mean, std)
    folder = tmp_path / "checkpoint"
    write_tiny_checkpoint(folder, TINY.model_config(base=tiny_config()), shards=1)
    shutil.rmtree(folder / "vae")
    shutil.copytree(exported, folder / "vae")
    weights = folder / "vae" / "diffusion_pytorch_model.safetensors"
    assert weights.exists()

    loaded = load_folder(folder, dtype=torch.float32).vae
    assert list(loaded.config.latents_std) == pytest.approx(std)
    from safetensors import safe_open
    with safe_open(weights, "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float16}

    config = TINY.model_config()
    video = make_clip(0, 0, config, 2, 1, world_seeds=range(1_000_000, 1_000_001)).video
    want_clip, want_image = stream_reconstruct(vae, config, video)
    got_clip, got_image = stream_reconstruct(loaded, config, video)
    assert (got_clip - want_clip).abs().max() < 2e-2
    assert (got_image - want_image).abs().max() < 2e-2
    # Not vacuous: a VAE with other weights reconstructs differently.
    other_clip, _ = stream_reconstruct(new_vae(TINY), config, video)
    assert (other_clip - want_clip).abs().max() > 0.1


def test_a_decoder_only_run_from_an_export_keeps_its_encoder_and_statistics(tmp_path, straight_run):
    """A machine without the VAE's run folder fine-tunes the decoder from the exported folder: the new export's
    encoder is the old one bit for bit, its latents statistics are the old ones (so a world model trained on
    the old export reads the same latents), and only the decoder changed."""
    _, vae = straight_run
    start = export_vae(vae, tmp_path / "start", [0.5, -0.25, 0.125, 1.0], [2.0, 0.5, 1.5, 0.75])
    tc = VaeTrainConfig(**{**TINY.__dict__, "init_from": str(start), "decoder_only": True, "posterior": "mean",
                           "lr": 1e-2})
    trained = train(tc, tmp_path / "run", 2)
    assert start_latent_stats(tc) == ([0.5, -0.25, 0.125, 1.0], [2.0, 0.5, 1.5, 0.75])
    again = export_vae(trained, tmp_path / "again", *start_latent_stats(tc))

    from safetensors.torch import load_file
    before, after = load_file(start / EXPORT_WEIGHTS), load_file(again / EXPORT_WEIGHTS)
    assert before.keys() == after.keys()
    encoder = [k for k in before if k.startswith(("encoder.", "quant_conv."))]
    decoder = [k for k in before if k.startswith(("decoder.", "post_quant_conv."))]
    assert encoder and decoder
    assert all(torch.equal(before[k], after[k]) for k in encoder)
    assert any(not torch.equal(before[k], after[k]) for k in decoder)
    config = json.loads((again / "config.json").read_text())
    assert config["latents_mean"] == [0.5, -0.25, 0.125, 1.0] and config["latents_std"] == [2.0, 0.5, 1.5, 0.75]
    # A run that trains the encoder too, or starts from a run folder, measures its statistics instead.
    assert start_latent_stats(VaeTrainConfig(**{**tc.__dict__, "decoder_only": False})) is None


def test_an_export_of_another_size_is_refused_by_name(tmp_path, straight_run):
    _, vae = straight_run
    start = export_vae(vae, tmp_path / "start", [0.0] * 4, [1.0] * 4)
    wider = VaeTrainConfig(**{**TINY.__dict__, "base_dim": 8, "init_from": str(start), "decoder_only": True})
    with pytest.raises(ValueError, match="another size"):
        train(wider, tmp_path / "run", 1)
    assert not (tmp_path / "run" / CHECKPOINT).exists()


def test_block_psnr_scores_each_block_of_the_streamed_clip(straight_run):
    _, vae = straight_run
    config = TINY.model_config()
    clips = [make_clip(0, i, config, 2, 1, world_seeds=range(1_000_000, 1_000_002)).video for i in range(2)]
    want = []
    for video in clips:
        recon, _ = stream_reconstruct(vae, config, video)
        want.append([psnr(recon[:, :9], video[:, :9]), psnr(recon[:, 9:21], video[:, 9:21])])
    assert video.shape[1] == 21
    assert block_psnr(vae, TINY, clips) == pytest.approx([(a + b) / 2 for a, b in zip(*want)])


def _stored_clips(folder, count: int, config) -> None:
    """`count` clips of one block in training.data's layout: clip i a grey ramp from left to right (so a
    mirrored window differs) whose mean level, 20 i + 25.5, names the clip."""
    import numpy as np

    frames = config.pixel_frames_for_blocks(1)
    ramp = np.arange(config.width).reshape(1, 1, -1, 1) * 32 // config.width
    for i in range(count):
        video = np.broadcast_to(20 * i + 10 + ramp, (frames, config.height, config.width, 3)).astype(np.uint8)
        np.savez(folder / f"clip_{i:07d}.npz", video=video,
                 actions=np.zeros((3, 8), dtype=np.uint8), latent_poses=np.zeros((3, 4, 4)),
                 intrinsics=np.zeros(4), world_seed=np.int64(i))


def test_a_decoder_only_run_decodes_the_world_models_own_latents_of_a_share_of_its_clips(tmp_path, straight_run):
    """training.vae --rollouts: each item is a whole stored clip, unmirrored, with the rollouts file's
    latents of that clip to decode (the world model's own for a share of the items, the encoder's for
    the rest), taken back to the VAE's scale by the start export's statistics; item j depends on
    (data_seed, j) only; the loss decodes those latents against the clip's frames."""
    from training.data import StoredClips
    from training.vae import ROLLOUTS_FORMAT, decode_unclamped, losses, stored_batches

    _, vae = straight_run
    mean, std = [0.5, -0.25, 0.125, 1.0], [2.0, 0.5, 1.5, 0.75]
    start = export_vae(vae, tmp_path / "start", mean, std)
    clips = tmp_path / "clips"
    clips.mkdir()
    _stored_clips(clips, 6, TINY.model_config())
    own, encoded = torch.randn(8, 4, 3, 4, 4).half(), torch.randn(8, 4, 3, 4, 4)  # 8 clips of 1 block
    stats = {"latents_mean": mean, "latents_std": std}
    torch.save({"format": ROLLOUTS_FORMAT, "latents": own, "encoded": encoded, **stats}, tmp_path / "rollouts.pt")
    tc = VaeTrainConfig(**{**TINY.__dict__, "init_from": str(start), "decoder_only": True, "posterior": "mean",
                           "clips_dir": str(clips), "stored_clips": 6, "loss": "mse",
                           "rollouts": str(tmp_path / "rollouts.pt"), "rollout_share": 0.5})

    def scaled(latents):
        return latents.float() * torch.tensor(std).view(4, 1, 1, 1) + torch.tensor(mean).view(4, 1, 1, 1)

    batches, used, seen = list(stored_batches(tc, 0, 60)), 0, set()
    for batch in batches:
        video, (latents,) = batch.video, batch.latents
        index = round(((float(video.mean()) + 1.0) * 127.5 - 25.5) / 20)  # the clip, by its mean level
        assert torch.equal(video[0], StoredClips(clips, 6).video(index))  # its whole clip, unmirrored
        is_own = torch.equal(latents, scaled(own[index]))
        assert is_own or torch.equal(latents, scaled(encoded[index]))
        used += is_own
        seen.add(index)
    assert 15 <= used <= 45 and seen == set(range(6)), (used, seen)
    resumed = list(stored_batches(tc, 40, 42))  # a resumed run draws the same items
    assert all(torch.equal(a.latents, b.latents) and torch.equal(a.video, b.video)
               for a, b in zip(resumed, batches[40:42]))

    batch = batches[0]
    with torch.no_grad():
        terms = losses(vae, batch.video, tc, torch.Generator(), batch.latents)
        want = (decode_unclamped(vae, batch.latents) - batch.video).square().mean()
    assert float(terms["rec"]) == pytest.approx(float(want), rel=1e-6) and float(terms["kl"]) == 0.0

    with pytest.raises(ValueError, match="decoder-only"):
        VaeTrainConfig(**{**tc.__dict__, "decoder_only": False})
    torch.save({"format": ROLLOUTS_FORMAT, "latents": own[:4], "encoded": encoded[:4], **stats}, tmp_path / "few.pt")
    with pytest.raises(ValueError, match="holds 4 clips"):
        next(stored_batches(VaeTrainConfig(**{**tc.__dict__, "rollouts": str(tmp_path / "few.pt")}), 0, 1))
    torch.save({"format": ROLLOUTS_FORMAT, "latents": own, "encoded": encoded, "latents_mean": [0.0] * 4,
                "latents_std": std}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="exported vae/ folder"):  # a run folder has no statistics to undo
        next(stored_batches(VaeTrainConfig(**{**tc.__dict__, "init_from": str(tmp_path / "clips")}), 0, 1))
    with pytest.raises(ValueError, match="other latent statistics"):
        next(stored_batches(VaeTrainConfig(**{**tc.__dict__, "rollouts": str(tmp_path / "other.pt")}), 0, 1))


def test_a_patched_vae_learns_exports_and_streams_through_the_real_loader(tmp_path):
    """`--patch-size 2` (diffusers' patch_size, one halving fewer): the same latent grid, trained, exported,
    loaded by the loader and streamed by the session's encoder and decoder as the trained module does."""
    tc = dataclasses.replace(TINY, patch_size=2)
    config = tc.model_config()
    assert (config.vae["patch_size"], config.vae["dim_mult"], config.vae["in_channels"]) == (2, [1, 2, 4], 12)
    vae, video = new_vae(tc), make_clip(0, 0, config, 1, 1).video.unsqueeze(0)
    optimizer, generator = new_optimizer(vae, tc), torch.Generator().manual_seed(0)
    first = train_step(vae, optimizer, video, tc, generator)["rec"]
    for _ in range(5):
        last = train_step(vae, optimizer, video, tc, generator)["rec"]
    assert last < 0.9 * first, (first, last)

    mean, std = measured_latent_stats(vae, tc, clips=1)
    folder = tmp_path / "checkpoint"
    write_tiny_checkpoint(folder, tc.model_config(base=tiny_config()), shards=1)
    shutil.rmtree(folder / "vae")
    shutil.copytree(export_vae(vae, tmp_path / "export", mean, std), folder / "vae")
    loaded = load_folder(folder, dtype=torch.float32).vae
    assert loaded.config.patch_size == 2
    held_out = make_clip(0, 0, config, 2, 1, world_seeds=range(1_000_000, 1_000_001)).video
    want_clip, want_image = stream_reconstruct(vae, config, held_out)
    got_clip, got_image = stream_reconstruct(loaded, config, held_out)
    assert got_clip.shape == (3, config.pixel_frames_for_blocks(2), 32, 32)
    assert (got_clip - want_clip).abs().max() < 2e-2 and (got_image - want_image).abs().max() < 2e-2
    with pytest.raises(ValueError, match="patch_size must be 1 or 2"):
        dataclasses.replace(TINY, patch_size=4)

    # training.world reads the model's config off the exported VAE; the VAE that config builds (the
    # seeded parts behind its text states) must be the patched one, or the spatial factors disagree.
    from lingbot_core.model.vae_stream import build_vae, check_streamable
    from training.world import model_config as world_model_config

    world = world_model_config(loaded)
    rebuilt = build_vae(world, torch.float32, "cpu", seed=0)
    for key in ("patch_size", "in_channels", "out_channels", "dim_mult", "temperal_downsample", "z_dim"):
        assert rebuilt.config[key] == loaded.config[key], key
    check_streamable(rebuilt)


def test_the_world_trainer_reads_an_unpatched_vae_config_as_before():
    """The shipped (unpatched) VAE gives the embedded preset's VAE config with its own statistics."""
    from lingbot_core.config import EMBEDDED
    from training.world import load_vae, model_config as world_model_config

    shipped = load_vae(Path(__file__).resolve().parents[1] / "lingbot_core" / "embedded_model" / "vae")
    assert world_model_config(shipped).vae == dict(EMBEDDED.vae, latents_mean=list(shipped.config.latents_mean),
                                                  latents_std=list(shipped.config.latents_std))
