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


def test_a_run_that_kept_an_average_of_its_weights_exports_the_average(tmp_path):
    """--ema-decay: the parameters come from the checkpoint's average, buffers from the model."""
    from training.weight_average import WeightAverage

    out, run = tmp_path / "model", tmp_path / "run"
    run.mkdir()
    model = new_model(EMBEDDED, seed=3)
    average = WeightAverage.start(model, 0.9)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    average.update(model)  # every parameter 0.1 of the way to weights one higher
    tc = WorldTrainConfig(vae=str(DEFAULT_OUT / "vae"), clips_dir="unused", stored_clips=1, ema_decay=0.9)
    torch.save({"format": CHECKPOINT_FORMAT, "train_config": dataclasses.asdict(tc), "step": 7,
                "model": model.state_dict(), "ema": average.weights}, run / CHECKPOINT)
    export(DEFAULT_OUT / "vae", run, out)
    weights = load_file(out / "transformer" / TRANSFORMER_WEIGHTS)
    parameters = dict(model.named_parameters())
    assert weights.keys() == model.state_dict().keys()
    for name, value in model.state_dict().items():
        if name in parameters:  # 0.9 below the last step's weights, to half precision's rounding
            torch.testing.assert_close(weights[name].float(), value - 0.9, atol=2e-3, rtol=2e-3)
        else:
            assert torch.equal(weights[name], value.to(torch.float16)), name
