"""What a model source names and its ModelConfig, read from the checkpoint's config files alone.

The loader (blocks/loading.py) builds the config through `config_from_parts` from the VAE it has built;
`planned_config` builds the same config from the JSON before any weights, torch kernels, diffusers or
transformers are loaded, so the page (app.py) can come up while the model loads (serving/starting.py).
Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Mapping

from lingbot_core.config import EMBEDDED, TEST_PRESETS, ModelConfig, TransformerConfig

EMBEDDED_SOURCE = "embedded"
# The trained embedded model ships in the repository in the real checkpoint's layout (training/export.py
# writes it; its README is the model card). Without it, "embedded" falls back to seeded random weights.
EMBEDDED_FOLDER = Path(__file__).resolve().parents[1] / "embedded_model"


def choose_source(model: str | None = None, preset: str | None = None,
                  environ: Mapping[str, str] = os.environ) -> tuple[str, ModelConfig | None]:
    """The source to load (`model`, else $LINGBOT_MODEL, else embedded) and the test preset's config to load it
    at (`preset`, else $LINGBOT_TEST_PRESET, else None: its own size)."""
    source = model or environ.get("LINGBOT_MODEL") or EMBEDDED_SOURCE
    preset = preset or environ.get("LINGBOT_TEST_PRESET") or None
    if preset is None:
        return source, None
    if preset not in TEST_PRESETS or source != EMBEDDED_SOURCE:
        raise ValueError(f"test preset {preset!r}: the presets are {sorted(TEST_PRESETS)}, "
                         "for the embedded model only")
    return source, TEST_PRESETS[preset]()


class CheckpointError(ValueError):
    """A source that cannot be turned into model parts; the message says what was tried and how to fix it."""


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"missing file {path}; a diffusers-format checkpoint folder needs it")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"cannot read {path}: {error}") from error
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def read_transformer_config(subfolder: Path) -> TransformerConfig:
    raw = read_json(subfolder / "config.json")
    try:
        return TransformerConfig.from_diffusers_config(raw)
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{subfolder / 'config.json'}: {error}") from error


def with_size(config: ModelConfig, height: int | None, width: int | None) -> ModelConfig:
    if height is None and width is None:
        return config
    return dataclasses.replace(config, height=config.height if height is None else height,
                               width=config.width if width is None else width)


def embedded_choice(preset_hint: ModelConfig | None, height: int | None, width: int | None,
                    folder: Path) -> tuple[ModelConfig, Path | None]:
    """"embedded": the config to load with, and the trained folder to load it from (None: seeded weights,
    whose config is the returned one)."""
    config = with_size(preset_hint if preset_hint is not None and preset_hint.weights_seed is not None
                       else EMBEDDED, height, width)
    # The shipped weights fit the embedded preset only (a hint of another size gets seeded weights).
    shipped = preset_hint is None or dataclasses.replace(preset_hint, trained=EMBEDDED.trained) == EMBEDDED
    if shipped and (folder / "model_index.json").is_file():
        return config, folder
    return dataclasses.replace(config, trained=False), None


def config_from_parts(vae_config: Mapping[str, Any], transformer_config: TransformerConfig,
                      hint: ModelConfig | None, height: int | None, width: int | None,
                      folder: Path) -> ModelConfig:
    """The checkpoint's transformer and VAE configs, everything else from the hint (or defaults)."""
    vae_kwargs = {key: (list(value) if isinstance(value, tuple) else value)
                  for key, value in vae_config.items() if not key.startswith("_")}
    spatial = vae_config.get("scale_factor_spatial") or 2 ** (len(vae_config["dim_mult"]) - 1)
    temporal = vae_config.get("scale_factor_temporal") or 2 ** sum(map(bool, vae_config["temperal_downsample"]))
    base = hint if hint is not None else ModelConfig(name=folder.name, transformer=transformer_config)
    try:
        config = dataclasses.replace(base, transformer=transformer_config, vae=vae_kwargs,
                                     vae_spatial_factor=spatial, vae_temporal_factor=temporal,
                                     weights_seed=None, trained=True)
        return with_size(config, height, width)
    except ValueError as error:
        raise CheckpointError(f"checkpoint {folder} does not make a valid model config: {error}") from error


def folder_config(folder: Path, preset_hint: ModelConfig | None = None, height: int | None = None,
                  width: int | None = None) -> ModelConfig:
    """A checkpoint folder's config from its transformer/ and vae/ config.json, as the loader will build it
    (diffusers completes a VAE config that leaves out fields with its defaults: those keys of `vae` may
    differ; nothing else does)."""
    vae_config = read_json(folder / "vae" / "config.json")
    # AutoencoderKLWan's own defaults for the two fields the scale factors fall back on.
    vae_config = {"dim_mult": [1, 2, 4, 4], "temperal_downsample": [False, True, True], **vae_config}
    return config_from_parts(vae_config, read_transformer_config(folder / "transformer"), preset_hint, height,
                             width, folder)


def planned_config(source: str, preset_hint: ModelConfig | None = None, height: int | None = None,
                   width: int | None = None, embedded_folder: Path = EMBEDDED_FOLDER) -> ModelConfig | None:
    """The ModelConfig `load_pipeline_parts(source, ...)` will return, from config files only; None for a Hub
    id (its files are not here before the download)."""
    if source == EMBEDDED_SOURCE:
        config, folder = embedded_choice(preset_hint, height, width, embedded_folder)
        return config if folder is None else folder_config(folder, config, height, width)
    folder = Path(source).expanduser()
    if not folder.is_dir():
        return None
    return folder_config(folder, preset_hint, height, width)


def same_but_vae(planned: ModelConfig, loaded: ModelConfig) -> bool:
    """Whether a loaded config is the planned one, but for the VAE keyword fields diffusers filled in."""
    return dataclasses.replace(loaded, vae=planned.vae) == planned
