"""The shipped embedded model: the trained folder in the real layout, read by the real checkpoint loader."""

from pathlib import Path

import torch
from safetensors.torch import load_file

from lingbot_core import loading
from lingbot_core.config import EMBEDDED


def test_shipped_folder_is_small_half_precision_and_loads_through_the_checkpoint_loader():
    folder = loading.EMBEDDED_FOLDER
    assert (folder / "model_index.json").is_file(), "the trained embedded model must ship with the repository"
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    assert size <= 50 * 2**20
    stored = load_file(folder / "transformer" / loading.TRANSFORMER_WEIGHTS)
    assert {t.dtype for t in stored.values()} == {torch.float16}
    assert (folder / "README.md").is_file()  # the model card

    parts = loading.load_pipeline_parts("embedded", dtype=torch.float32)
    assert parts.config.trained and parts.config.name == EMBEDDED.name
    assert (parts.config.height, parts.config.width) == (EMBEDDED.height, EMBEDDED.width)
    assert parts.config.camera == EMBEDDED.camera  # the preset's own camera convention, not the real checkpoint's
    weights = parts.transformer.state_dict()
    for name, tensor in stored.items():
        assert torch.equal(weights[name], tensor.float()), name


def test_without_the_folder_embedded_falls_back_to_seeded_random_weights_and_says_so(monkeypatch, tmp_path):
    monkeypatch.setattr(loading, "EMBEDDED_FOLDER", Path(tmp_path) / "absent")
    parts = loading.load_pipeline_parts("embedded", dtype=torch.float32)
    assert not parts.config.trained and parts.config.weights_seed == EMBEDDED.weights_seed
