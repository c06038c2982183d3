"""The committed stages of the retrain (training/stages/) stay usable as the code changes: the next session
resumes from them on whatever machine it gets, so a stage that no longer loads would cost a retrain.

A world-model stage trained on the latents of the VAE its STAGE.md command names (`--vae training/stages/...`)."""
import re
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lingbot_core.blocks.loading import TRANSFORMER_WEIGHTS
from lingbot_core.model.vae_stream import check_streamable
from training.export import export
from training.world import load_exported_weights, load_vae, model_config, new_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import eval_world  # noqa: E402

STAGES = Path(__file__).resolve().parents[1] / "training" / "stages"


def _stages(prefix: str) -> list[Path]:
    return sorted(p for p in STAGES.iterdir() if p.is_dir() and p.name.startswith(prefix))


def _vae_of(world_stage: Path) -> Path:
    """The VAE stage a world stage's own command trained on."""
    named = re.findall(r"--vae training/stages/([\w.-]+)/vae", (world_stage / "STAGE.md").read_text())
    assert len(set(named)) == 1, f"{world_stage.name}: its STAGE.md command must name one committed VAE stage"
    return STAGES / named[0] / "vae"


def test_every_stage_has_its_record_and_every_world_stage_a_committed_vae():
    stages = _stages("")
    assert stages, f"no stage under {STAGES}"
    for stage in stages:
        assert (stage / "STAGE.md").is_file(), f"{stage.name} has no STAGE.md (command, seeds, figures)"
    for stage in _stages("world-"):
        assert _vae_of(stage).is_dir(), f"{stage.name}: {_vae_of(stage)} is not committed"


@pytest.mark.parametrize("stage", [p.name for p in _stages("vae-")])
def test_a_vae_stage_loads_and_streams_with_the_embedded_preset(stage):
    vae = load_vae(STAGES / stage / "vae")
    check_streamable(vae, model_config(vae))  # raises if the streamed decoder could not run it


@pytest.mark.parametrize("stage", [p.name for p in _stages("world-")])
def test_a_world_stage_starts_a_run_with_its_exact_weights(stage):
    """--init-from STAGE: every weight of the committed (fp16) transformer lands in the run's model."""
    vae = load_vae(_vae_of(STAGES / stage))
    model = new_model(model_config(vae), seed=0)
    load_exported_weights(model, STAGES / stage)
    saved = load_file(STAGES / stage / "transformer" / TRANSFORMER_WEIGHTS)
    state = model.state_dict()
    assert set(saved) == set(state)
    for name, value in saved.items():
        assert value.dtype == torch.float16, f"{stage}: {name} is not half precision"
        torch.testing.assert_close(state[name], value.float(), rtol=0, atol=0)
        assert torch.isfinite(state[name]).all(), f"{stage}: {name} is not finite"


def test_the_newest_world_stage_exports_and_plays_a_held_out_world(tmp_path):
    """`training.export --world-run STAGE` on a machine that never held the stage's run: the folder it writes
    carries the stage's weights bit for bit, loads through the checkpoint loader the app uses (every config,
    name and shape checked, the VAE streamable) and plays block 0 of a held-out world near the truth (stage
    world-p2-s6: 24.9 dB; a random frame of the world gives about 11 dB)."""
    from lingbot_core.world import HELD_OUT_SEEDS, key_path, held_keys, make_world
    from lingbot_core.world.metrics import psnr

    stage = _stages("world-")[-1]
    folder = export(_vae_of(stage), stage, tmp_path / "model")
    assert (folder / "transformer" / TRANSFORMER_WEIGHTS).read_bytes() == \
        (stage / "transformer" / TRANSFORMER_WEIGHTS).read_bytes()
    pipe = eval_world.load_model(str(folder), "fp32")
    config = pipe.config
    assert (config.height, config.width) == (96, 160) and pipe.vae.config.get("patch_size") == 2

    world = make_world(HELD_OUT_SEEDS[0])
    standing = eval_world.Script("standing", ("",), 1)
    frames = eval_world.roll_out(pipe, eval_world._start_picture(world, config), standing, set()).frames
    path = key_path(held_keys(standing.keys_per_block, config.transformer.num_frames_per_block), config)
    truth = eval_world.ground_truth(world, path, config, eval_world.block_frames(config, 0))
    assert frames.shape == truth.shape
    assert float(psnr(frames, truth).mean()) > 20.0
