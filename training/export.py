"""Assemble the shipped embedded model folder from a VAE export and a world-model run.

    python -m training.export --vae DIR/vae --world-run RUN_DIR [--out lingbot_core/embedded_model]

RUN_DIR is a training.world run folder (its last checkpoint is exported: the average of its weights where the
run kept one, `--ema-decay`) or a committed stage folder that holds transformer/ (training/stages/world-*): a
stage ships on a machine that never held its run.

The folder has the real checkpoint's diffusers layout (model_index.json, transformer/, vae/,
text_encoder/, tokenizer/, scheduler/) in half precision, and `lingbot_core/blocks/loading.py` reads it with
the same code as the published checkpoint. The text encoder is the embedded preset's seeded UMT5 (the
world model was trained with it frozen), saved so that the folder is complete on its own.
The model card (README.md) is written by hand next to it; this command leaves it alone.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import diffusers
import torch
from diffusers import UniPCMultistepScheduler
from safetensors.torch import load_file, save_file

from lingbot_core.config import EMBEDDED
from lingbot_core.blocks.loading import TRANSFORMER_WEIGHTS, build_seeded_parts
from training.weight_average import exported_weights
from training.world import CHECKPOINT, load_checkpoint, load_vae, model_config

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "lingbot_core" / "embedded_model"

# The published checkpoint's model_index.json, verbatim (vLLM-Omni's fixture of the official index): a
# two-expert key set with the second expert and the image branch empty, and boundary_ratio 0.9, which
# selects nothing without transformer_2. The loader takes it as it is; the tests' checkpoints write it.
PUBLISHED_MODEL_INDEX = {
    "_class_name": "LingBotWorldCausalDMDPipeline",
    "_diffusers_version": "0.35.0.dev0",
    "boundary_ratio": 0.9,
    "image_encoder": [None, None],
    "image_processor": [None, None],
    "scheduler": ["diffusers", "UniPCMultistepScheduler"],
    "text_encoder": ["transformers", "UMT5EncoderModel"],
    "tokenizer": ["transformers", "T5TokenizerFast"],
    "transformer": ["diffusers", "CausalLingBotWorldTransformer3DModel"],
    "transformer_2": [None, None],
    "vae": ["diffusers", "AutoencoderKLWan"],
}
# An exported folder carries the same keys, with the diffusers version that wrote it.
MODEL_INDEX = dict(PUBLISHED_MODEL_INDEX, _diffusers_version=diffusers.__version__)


def world_weights(world: Path) -> tuple[dict[str, torch.Tensor], str]:
    """The transformer's weights and where they came from: a run folder's last checkpoint, or a stage folder's
    transformer/ (already half precision, so the export copies it exactly)."""
    if (world / CHECKPOINT).is_file():
        _, state = load_checkpoint(world)
        weights, which = exported_weights(state)
        return weights, f"world model step {state['step']}, {which}"
    if (world / "transformer" / TRANSFORMER_WEIGHTS).is_file():
        return load_file(world / "transformer" / TRANSFORMER_WEIGHTS), f"world model of {world}"
    raise ValueError(f"{world} holds neither a training.world checkpoint ({CHECKPOINT}) nor "
                     f"transformer/{TRANSFORMER_WEIGHTS}")


def export(vae_folder: Path, world_run: Path, out: Path) -> Path:
    trained, source = world_weights(world_run)
    vae = load_vae(vae_folder)
    config = model_config(vae)
    out.mkdir(parents=True, exist_ok=True)
    (out / "model_index.json").write_text(json.dumps(MODEL_INDEX, indent=2) + "\n")

    transformer = out / "transformer"
    transformer.mkdir(exist_ok=True)
    raw = dict(config.transformer.to_diffusers_config(), _diffusers_version=diffusers.__version__)
    (transformer / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    weights = {name: t.detach().to(torch.float16).contiguous() for name, t in sorted(trained.items())}
    save_file(weights, transformer / TRANSFORMER_WEIGHTS, metadata={"format": "pt"})

    # A new transformer exported beside the VAE it already ships with (--vae OUT/vae) keeps that VAE:
    # removing OUT/vae before copying would delete the source.
    if (out / "vae").resolve() != vae_folder.resolve():
        if (out / "vae").exists():
            shutil.rmtree(out / "vae")
        shutil.copytree(vae_folder, out / "vae")

    text = build_seeded_parts(EMBEDDED, EMBEDDED.weights_seed, dtype=torch.float32).text_encoder
    text.model.to(torch.float16).save_pretrained(out / "text_encoder")
    text.tokenizer.save_pretrained(out / "tokenizer")
    UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0,
                            num_train_timesteps=1000).save_pretrained(out / "scheduler")
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"{out}: {size / 2**20:.1f} MiB, {source}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vae", required=True, help="python -m training.vae --export OUT wrote OUT/vae")
    parser.add_argument("--world-run", required=True,
                        help="the training.world run folder, or a committed stage folder holding transformer/")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args()
    export(Path(args.vae).expanduser(), Path(args.world_run).expanduser(), Path(args.out))


if __name__ == "__main__":
    main()
