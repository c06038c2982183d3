"""The ModelConfig a remote backend plays with, read without loading any weights.

The app needs the model's frame size, frame rate, block length and prompt limit to parse starts and
events and to encode video; a remote backend loads no model, so they come from:
- no --model (or the 14B preset's name, or a Hub id, which is never downloaded here): the real preset,
  lingbot-world-v2-14b at 832x480, as a remote SGLang or vLLM-Omni serves it;
- a preset name ("embedded", or "tiny" for tests): that preset (e.g. our own protocol server playing the
  embedded model at 160x96);
- a local diffusers folder: its transformer/config.json, at 832x480 with the Wan 2.1 VAE's factors.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from lingbot_core.blocks.model_source import read_transformer_config
from lingbot_core.config import LINGBOT_WORLD_V2_14B, PRESETS, TEST_PRESETS, WAN21_VAE, ModelConfig



def remote_model_config(model: str | None = None) -> ModelConfig:
    if model is None or not model.strip():
        return LINGBOT_WORLD_V2_14B
    model = model.strip()
    if model in PRESETS:
        return PRESETS[model]
    if model in TEST_PRESETS:
        return TEST_PRESETS[model]()
    folder = Path(model).expanduser()
    if (folder / "transformer" / "config.json").is_file():
        transformer = read_transformer_config(folder / "transformer")  # CheckpointError (a ValueError) says why
        return ModelConfig(name=folder.name, transformer=transformer, vae=dict(WAN21_VAE))
    if folder.exists():
        raise ValueError(f"{folder} has no transformer/config.json; name a diffusers folder, a preset "
                         f"({', '.join(sorted(PRESETS))}) or nothing (the 14B preset)")
    # A Hub id: the servers hold the weights; its config is the published preset's (nothing is downloaded).
    return dataclasses.replace(LINGBOT_WORLD_V2_14B, name=model)


def served_model_config(model: str | None, environ) -> ModelConfig:
    """The config of the model a remote backend plays: `model`, else $LINGBOT_MODEL, else $LINGBOT_TEST_PRESET (tests),
    else the 14B preset."""
    return remote_model_config(model or environ.get("LINGBOT_MODEL") or environ.get("LINGBOT_TEST_PRESET") or None)
