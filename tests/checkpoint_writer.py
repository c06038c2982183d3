"""Test helper: write a tiny checkpoint in the real diffusers layout, from seeded in-memory modules.

The loader tests read it back through the same path a downloaded checkpoint takes, and compare
against the modules returned here. Every config file carries the key set of the published checkpoint
(sizes shrunk, keys kept), so what the loader accepts is what the real release holds:

- transformer/config.json: the published LingBot-World v2 transformer config (config.PUBLISHED_KEYS,
  as upstream's loaders list it);
- model_index.json: the published index, verbatim (training.export.PUBLISHED_MODEL_INDEX);
- vae/config.json and text_encoder/config.json: the key sets of the Wan 2.1 diffusers export whose
  VAE and UMT5-XXL the checkpoint reuses (the 14B and 1.3B releases share them);
- tokenizer/: tokenizer.json, tokenizer_config.json and special_tokens_map.json (the sentencepiece
  spiece.model of the real folder is not needed by the fast tokenizer and is not written);
- scheduler/: diffusers' own UniPCMultistepScheduler config (nothing reads it).
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import diffusers
import torch
from diffusers import AutoencoderKLWan, UniPCMultistepScheduler
from safetensors.torch import save_file

from lingbot_core.config import ModelConfig
from lingbot_core.blocks.loading import TRANSFORMER_INDEX, TRANSFORMER_WEIGHTS, LoadedParts, build_seeded_parts

from training.export import PUBLISHED_MODEL_INDEX  # noqa: E402  (the published index, verbatim)


# Key sets of the published config files (values shrunk in a tiny checkpoint, keys kept).
PUBLISHED_MODEL_INDEX_KEYS = ("_class_name", "_diffusers_version", "boundary_ratio", "image_encoder",
                              "image_processor", "scheduler", "text_encoder", "tokenizer", "transformer",
                              "transformer_2", "vae")
PUBLISHED_VAE_KEYS = ("_class_name", "_diffusers_version", "attn_scales", "base_dim", "dim_mult", "dropout",
                      "latents_mean", "latents_std", "num_res_blocks", "temperal_downsample", "z_dim")
PUBLISHED_TEXT_ENCODER_KEYS = (
    "architectures", "classifier_dropout", "d_ff", "d_kv", "d_model", "decoder_start_token_id", "dense_act_fn",
    "dropout_rate", "eos_token_id", "feed_forward_proj", "initializer_factor", "is_encoder_decoder",
    "is_gated_act", "layer_norm_epsilon", "model_type", "num_decoder_layers", "num_heads", "num_layers",
    "output_past", "pad_token_id", "relative_attention_max_distance", "relative_attention_num_buckets",
    "scalable_attention", "tie_word_embeddings", "tokenizer_class", "torch_dtype", "transformers_version",
    "use_cache", "vocab_size",
)
# Values of the published UMT5-XXL config for keys that do not follow from the tiny model.
_PUBLISHED_TEXT_ENCODER_VALUES = dict(output_past=True, scalable_attention=True, tie_word_embeddings=False,
                                      tokenizer_class="T5Tokenizer", torch_dtype="float32", dropout_rate=0.1)
PUBLISHED_TOKENIZER_FILES = ("special_tokens_map.json", "tokenizer.json", "tokenizer_config.json")


def write_tiny_checkpoint(path: str | Path, model_config: ModelConfig, shards: int = 2, seed: int = 0) -> LoadedParts:
    """Write `model_config` with weights from `seed` to `path`; return the float32 modules written."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    parts = build_seeded_parts(model_config, seed, dtype=torch.float32, device="cpu")

    (path / "model_index.json").write_text(json.dumps(PUBLISHED_MODEL_INDEX, indent=2))
    write_transformer(path / "transformer", model_config, parts.transformer.state_dict(), shards)
    parts.vae.save_pretrained(path / "vae")
    _keep_published_vae_keys(path / "vae" / "config.json")
    parts.text_encoder.model.save_pretrained(path / "text_encoder")
    _keep_published_text_encoder_keys(path / "text_encoder" / "config.json")
    tokenizer = parts.text_encoder.tokenizer
    tokenizer.save_pretrained(path / "tokenizer")
    (path / "tokenizer" / "special_tokens_map.json").write_text(json.dumps(
        {"eos_token": tokenizer.eos_token, "pad_token": tokenizer.pad_token, "unk_token": tokenizer.unk_token},
        indent=2))
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


def _keep_published_vae_keys(config_path: Path) -> None:
    """The published VAE key set; a key outside it is kept only where this model needs a non-default value
    (e.g. the embedded preset's narrow decoder), since the real file could not express it either."""
    saved = json.loads(config_path.read_text())
    defaults = {name: p.default for name, p in inspect.signature(AutoencoderKLWan.__init__).parameters.items()}
    out = {key: saved[key] for key in PUBLISHED_VAE_KEYS}
    out.update({key: value for key, value in saved.items()
                if key not in out and key in defaults and _differs(value, defaults[key])})
    config_path.write_text(json.dumps(out, indent=2))


def _differs(value, default) -> bool:
    return (list(value) if isinstance(value, tuple) else value) != (list(default) if isinstance(default, tuple)
                                                                    else default)


def _keep_published_text_encoder_keys(config_path: Path) -> None:
    """Exactly the published UMT5 key set: the tiny model's sizes, the published values elsewhere."""
    saved = json.loads(config_path.read_text())
    out = {key: saved[key] for key in PUBLISHED_TEXT_ENCODER_KEYS if key in saved}
    out.update({key: value for key, value in _PUBLISHED_TEXT_ENCODER_VALUES.items()})
    missing = set(PUBLISHED_TEXT_ENCODER_KEYS) - set(out)
    if missing:
        raise AssertionError(f"the text encoder config no longer writes {sorted(missing)}")
    config_path.write_text(json.dumps({key: out[key] for key in PUBLISHED_TEXT_ENCODER_KEYS}, indent=2))
