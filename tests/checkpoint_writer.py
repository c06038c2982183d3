"""Test helper: write a tiny checkpoint in the real diffusers layout, from seeded in-memory modules.

The loader tests read it back through the same path a downloaded checkpoint takes, and compare
against the modules returned here.
"""

from __future__ import annotations

import json
from pathlib import Path

import diffusers
import torch
from diffusers import UniPCMultistepScheduler
from safetensors.torch import save_file

from lingbot_core.config import ModelConfig
from lingbot_core.loading import TRANSFORMER_INDEX, TRANSFORMER_WEIGHTS, LoadedParts, build_seeded_parts

MODEL_INDEX = {
    "_class_name": "LingBotWorldCausalPipeline",
    "_diffusers_version": diffusers.__version__,
    "scheduler": ["diffusers", "UniPCMultistepScheduler"],
    "text_encoder": ["transformers", "UMT5EncoderModel"],
    "tokenizer": ["transformers", "T5TokenizerFast"],
    "transformer": ["diffusers", "CausalLingBotWorldTransformer3DModel"],
    "transformer_2": [None, None],
    "vae": ["diffusers", "AutoencoderKLWan"],
}


def write_tiny_checkpoint(path: str | Path, model_config: ModelConfig, shards: int = 2, seed: int = 0) -> LoadedParts:
    """Write `model_config` with weights from `seed` to `path`; return the float32 modules written."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    parts = build_seeded_parts(model_config, seed, dtype=torch.float32, device="cpu")

    (path / "model_index.json").write_text(json.dumps(MODEL_INDEX, indent=2))
    write_transformer(path / "transformer", model_config, parts.transformer.state_dict(), shards)
    parts.vae.save_pretrained(path / "vae")
    parts.text_encoder.model.save_pretrained(path / "text_encoder")
    parts.text_encoder.tokenizer.save_pretrained(path / "tokenizer")
    UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0,
                            num_train_timesteps=1000).save_pretrained(path / "scheduler")
    return parts


def write_transformer(subfolder: Path, model_config: ModelConfig, state: dict[str, torch.Tensor],
                      shards: int) -> None:
    """config.json plus F32 safetensors: one file, or `shards` files and the index diffusers writes."""
    subfolder.mkdir(parents=True, exist_ok=True)
    raw = dict(model_config.transformer.to_diffusers_config(), _diffusers_version=diffusers.__version__)
    (subfolder / "config.json").write_text(json.dumps(raw, indent=2))

    tensors = {name: t.detach().to(torch.float32).contiguous() for name, t in sorted(state.items())}
    if shards == 1:
        save_file(tensors, subfolder / TRANSFORMER_WEIGHTS, metadata={"format": "pt"})
        return
    names = list(tensors)
    if not 1 <= shards <= len(names):
        raise ValueError(f"shards={shards} must be between 1 and the tensor count {len(names)}")
    weight_map = {}
    for k in range(shards):
        filename = TRANSFORMER_WEIGHTS.replace(".safetensors", f"-{k + 1:05d}-of-{shards:05d}.safetensors")
        chunk = names[k * len(names) // shards:(k + 1) * len(names) // shards]
        save_file({n: tensors[n] for n in chunk}, subfolder / filename, metadata={"format": "pt"})
        weight_map.update({n: filename for n in chunk})
    total_size = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (subfolder / TRANSFORMER_INDEX).write_text(json.dumps(index, indent=2))
