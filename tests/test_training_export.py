"""training.export writes a loadable diffusers-layout folder from a world run and a VAE folder."""

import dataclasses
import shutil

import torch
from safetensors.torch import load_file

from lingbot_core.config import EMBEDDED
from lingbot_core.blocks.loading import TRANSFORMER_WEIGHTS
from training.export import DEFAULT_OUT, export
from training.world import CHECKPOINT, CHECKPOINT_FORMAT, WorldTrainConfig, new_model


def test_exporting_a_new_transformer_beside_the_folders_own_vae_keeps_that_vae(tmp_path):
    """`--vae OUT/vae` (a retrained transformer shipped with the VAE it trained on) once deleted OUT/vae
    before copying it onto itself; the VAE must come out byte for byte as it went in."""
    out = tmp_path / "model"
    shutil.copytree(DEFAULT_OUT / "vae", out / "vae")
    before = {p.name: p.read_bytes() for p in (out / "vae").iterdir()}
    run = tmp_path / "run"
    run.mkdir()
    model = new_model(EMBEDDED, seed=3)
    tc = WorldTrainConfig(vae=str(out / "vae"), clips_dir="unused", stored_clips=1)
    torch.save({"format": CHECKPOINT_FORMAT, "train_config": dataclasses.asdict(tc), "step": 7,
                "model": model.state_dict()}, run / CHECKPOINT)
    export(out / "vae", run, out)
    assert {p.name: p.read_bytes() for p in (out / "vae").iterdir()} == before
    weights = load_file(out / "transformer" / TRANSFORMER_WEIGHTS)
    assert weights.keys() == model.state_dict().keys()
    assert all(torch.equal(weights[k], v.to(torch.float16)) for k, v in model.state_dict().items())


def test_a_folder_with_neither_a_run_nor_a_transformer_is_refused_before_anything_is_written(tmp_path):
    import pytest

    with pytest.raises(ValueError, match="neither a training.world checkpoint"):
        export(DEFAULT_OUT / "vae", tmp_path / "empty", tmp_path / "out")
    assert not (tmp_path / "out").exists()
