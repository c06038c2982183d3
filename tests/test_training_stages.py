"""The committed stages of the retrain (training/stages/) stay usable as the code changes: the next session
resumes from them on whatever machine it gets, so a stage that no longer loads would cost a retrain.

Each world-model stage is paired with the VAE whose latents it was trained on (its STAGE.md names it)."""
import shutil
import sys
from pathlib import Path

import pytest
import torch

from lingbot_core.blocks.model_source import EMBEDDED_FOLDER
from lingbot_core.model.vae_stream import check_streamable
from training.world import load_exported_weights, load_vae, model_config, new_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import eval_world  # noqa: E402

STAGES = Path(__file__).resolve().parents[1] / "training" / "stages"
VAE_OF_WORLD_STAGE = {"world-p2-s1": "vae-p2-b24-s2", "world-p2-s2": "vae-p2-b24-s2"}


def _stages(prefix: str) -> list[Path]:
    return sorted(p for p in STAGES.iterdir() if p.is_dir() and p.name.startswith(prefix))


def test_every_stage_has_its_record_and_every_world_stage_names_its_vae():
    stages = _stages("")
    assert stages, f"no stage under {STAGES}"
    for stage in stages:
        assert (stage / "STAGE.md").is_file(), f"{stage.name} has no STAGE.md (command, seeds, figures)"
    for stage in _stages("world-"):
        assert stage.name in VAE_OF_WORLD_STAGE, f"{stage.name}: add the VAE it was trained on to this test"
        vae_name = VAE_OF_WORLD_STAGE[stage.name]
        assert (STAGES / vae_name / "vae").is_dir()
        assert f"training/stages/{vae_name}/vae" in (stage / "STAGE.md").read_text()


@pytest.mark.parametrize("stage", [p.name for p in _stages("vae-")])
def test_a_vae_stage_loads_and_streams_with_the_embedded_preset(stage):
    vae = load_vae(STAGES / stage / "vae")
    check_streamable(vae, model_config(vae))  # raises if the streamed decoder could not run it


@pytest.mark.parametrize("stage", [p.name for p in _stages("world-")])
def test_a_world_stage_starts_a_run_with_its_exact_weights(stage):
    """--init-from STAGE: every weight of the committed (fp16) transformer lands in the run's model."""
    from safetensors.torch import load_file

    vae = load_vae(STAGES / VAE_OF_WORLD_STAGE[stage] / "vae")
    model = new_model(model_config(vae), seed=0)
    load_exported_weights(model, STAGES / stage)
    saved = load_file(STAGES / stage / "transformer" / "diffusion_pytorch_model.safetensors")
    state = model.state_dict()
    assert set(saved) == set(state)
    for name, value in saved.items():
        assert value.dtype == torch.float16, f"{stage}: {name} is not half precision"
        torch.testing.assert_close(state[name], value.float(), rtol=0, atol=0)
        assert torch.isfinite(state[name]).all(), f"{stage}: {name} is not finite"


def test_the_newest_world_stage_plays_a_held_out_world_through_the_apps_loader(tmp_path):
    """What an export of the stage would ship: the embedded folder with the stage's transformer and VAE, read
    by the checkpoint loader (every config, name and shape checked, the VAE streamable), plays block 0 of a
    held-out world near the truth (stage world-p2-s2: 22.8 dB; a random frame of the world gives about 11 dB)."""
    from lingbot_core.boundary.requests import BlockControl
    from lingbot_core.world import HELD_OUT_SEEDS, held_keys, key_path, make_world
    from lingbot_core.world.metrics import psnr

    stage = _stages("world-")[-1]
    folder = tmp_path / "model"
    shutil.copytree(EMBEDDED_FOLDER, folder, ignore=shutil.ignore_patterns("transformer", "vae"))
    shutil.copytree(stage / "transformer", folder / "transformer")
    shutil.copytree(STAGES / VAE_OF_WORLD_STAGE[stage.name] / "vae", folder / "vae")
    pipe = eval_world.load_model(str(folder), "fp32")
    config = pipe.config
    assert (config.height, config.width) == (96, 160) and pipe.vae.config.get("patch_size") == 2

    world = make_world(HELD_OUT_SEEDS[0])
    path = key_path(held_keys([""], config.transformer.num_frames_per_block), config)
    image = eval_world._start_picture(world, config)
    actions = held_keys([""], config.transformer.num_frames_per_block)
    (output,) = list(pipe.rollout(image, "a world", 0, [BlockControl(actions=actions)]))
    frames = ((output.frames[0].float().permute(1, 0, 2, 3) + 1.0) / 2.0).clamp(0, 1)
    truth = eval_world.ground_truth(world, path, config, eval_world.block_frames(config, 0))
    assert frames.shape == truth.shape
    assert float(psnr(frames, truth).mean()) > 20.0
