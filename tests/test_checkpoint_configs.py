"""What the loader accepts and refuses in each config file of a checkpoint folder.

The published transformer config carries `local_attn_size` (-1); a loader that refused it could not
load the real release at all. These tests pin the published key set of every config file the tiny
checkpoint writer produces, and what each value may be.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from lingbot_core.config import (
    LINGBOT_WORLD_V2_14B,
    METADATA_KEYS,
    PUBLISHED_KEYS,
    TransformerConfig,
    tiny_config,
)
from lingbot_core.blocks.kv_cache import KVPagePool
from lingbot_core.blocks.loading import CheckpointError, load_pipeline_parts
from lingbot_core.blocks.model_source import planned_config, same_but_vae
from tests.checkpoint_writer import (
    PUBLISHED_MODEL_INDEX_KEYS,
    PUBLISHED_TEXT_ENCODER_KEYS,
    PUBLISHED_TOKENIZER_FILES,
    PUBLISHED_VAE_KEYS,
    write_tiny_checkpoint,
)

CFG = tiny_config()

# The published transformer/config.json of robbyant/lingbot-world-v2-14b-causal-fast-diffusers, as the issue
# and upstream's loaders (vLLM-Omni's from_config contract) list it.
OFFICIAL_TRANSFORMER_CONFIG = {
    "_class_name": "CausalLingBotWorldTransformer3DModel",
    "_diffusers_version": "0.35.0.dev0",
    "patch_size": [1, 2, 2],
    "num_attention_heads": 40,
    "attention_head_dim": 128,
    "in_channels": 36,
    "out_channels": 16,
    "text_dim": 4096,
    "freq_dim": 256,
    "ffn_dim": 13824,
    "num_layers": 40,
    "cross_attn_norm": True,
    "eps": 1e-6,
    "image_dim": None,
    "added_kv_proj_dim": None,
    "rope_max_seq_len": 1024,
    "pos_embed_seq_len": None,
    "qk_norm": "rms_norm_across_heads",
    "sink_size": 9,
    "num_frames_per_block": 3,
    "sliding_window_num_frames": 18,
    "local_attn_size": -1,
}


# ---- transformer/config.json --------------------------------------------------------------------

def test_the_official_transformer_config_is_accepted_as_it_is():
    assert set(OFFICIAL_TRANSFORMER_CONFIG) - {"_class_name", "_diffusers_version"} == set(PUBLISHED_KEYS)
    config = TransformerConfig.from_diffusers_config(json.loads(json.dumps(OFFICIAL_TRANSFORMER_CONFIG)))
    assert config == LINGBOT_WORLD_V2_14B.transformer
    assert config.sliding_window_num_frames == 18 and config.recent_frames == 6
    # and it is what a config of ours writes, key for key
    written = dict(LINGBOT_WORLD_V2_14B.transformer.to_diffusers_config(), _diffusers_version="0.35.0.dev0")
    assert written == OFFICIAL_TRANSFORMER_CONFIG
    assert list(written)[1:-1] == list(PUBLISHED_KEYS)


@pytest.mark.parametrize("local_attn_size,window", [(-1, 18), (12, 12), (15, 15), (30, 30)])
def test_local_attn_size_has_upstreams_meaning(local_attn_size, window):
    """-1: the window is sliding_window_num_frames; a positive value is the window (sink + one block at least)."""
    config = TransformerConfig.from_diffusers_config(dict(OFFICIAL_TRANSFORMER_CONFIG, local_attn_size=local_attn_size))
    assert config.sliding_window_num_frames == window
    assert config.recent_frames == window - 9 - 3
    # written back, the same window reads the same way
    assert TransformerConfig.from_diffusers_config(config.to_diffusers_config()) == config


@pytest.mark.parametrize("value,pattern", [
    (11, r"local_attn_size=11 must be -1 \(use sliding_window_num_frames=18\) or a window of at least "
         r"sink_size \+ num_frames_per_block = 12"),
    (0, "local_attn_size=0 must be -1"),
    (-2, "local_attn_size=-2 must be -1"),
    (True, "must be an integer"),
    (12.0, "must be an integer"),
    ("-1", "must be an integer"),
    (None, "must be an integer"),
])
def test_other_local_attn_sizes_are_refused(value, pattern):
    with pytest.raises(ValueError, match=pattern):
        TransformerConfig.from_diffusers_config(dict(OFFICIAL_TRANSFORMER_CONFIG, local_attn_size=value))


@pytest.mark.parametrize("change,pattern", [
    ({"num_experts": 2}, r"keys this model does not know: \['num_experts'\]"),
    ({"rope_theta": 10000.0}, r"does not know: \['rope_theta'\]"),  # ours, not a published key
    ({"_class_name": "WanTransformer3DModel"}, "_class_name is 'WanTransformer3DModel'"),
    ({"qk_norm": "rms_norm"}, "qk_norm='rms_norm'; this model implements 'rms_norm_across_heads'"),
    ({"image_dim": 1280}, "image_dim=1280; this model has no image branch"),
    ({"num_layers": True}, "num_layers=True must be a positive integer"),
    ({"num_layers": 0}, "num_layers=0 must be a positive integer"),
    ({"patch_size": [1, 2]}, r"patch_size=\[1, 2\] must be a list of 3 integers"),
    ({"cross_attn_norm": 1}, "cross_attn_norm=1 must be true or false"),
    ({"eps": "tiny"}, "eps='tiny' must be a positive number"),
    ({"sliding_window_num_frames": 10}, "must cover sink_size=9 plus one block"),
])
def test_bad_transformer_configs_are_refused_by_name(change, pattern):
    with pytest.raises(ValueError, match=pattern):
        TransformerConfig.from_diffusers_config(dict(OFFICIAL_TRANSFORMER_CONFIG, **change))


@pytest.mark.parametrize("key", PUBLISHED_KEYS)
def test_every_published_key_is_required(key):
    raw = {k: v for k, v in OFFICIAL_TRANSFORMER_CONFIG.items() if k != key}
    with pytest.raises(ValueError, match=rf"lacks keys the published config carries: \['{key}'\]"):
        TransformerConfig.from_diffusers_config(raw)


def test_metadata_keys_are_accepted():
    raw = dict(OFFICIAL_TRANSFORMER_CONFIG, _name_or_path="/somewhere")
    assert set(METADATA_KEYS) <= set(raw)
    assert TransformerConfig.from_diffusers_config(raw) == LINGBOT_WORLD_V2_14B.transformer
    no_metadata = {k: v for k, v in OFFICIAL_TRANSFORMER_CONFIG.items() if not k.startswith("_")}
    assert TransformerConfig.from_diffusers_config(no_metadata) == LINGBOT_WORLD_V2_14B.transformer


def test_a_config_the_published_file_cannot_express_is_not_written():
    with pytest.raises(ValueError, match="rope_theta=500.0 is not expressible"):
        TransformerConfig(rope_theta=500.0).to_diffusers_config()


# ---- the written tiny checkpoint: every file's published key set ---------------------------------

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("published") / "tiny"
    write_tiny_checkpoint(path, CFG, shards=2, seed=0)
    return path


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def test_every_written_config_carries_the_published_key_set(checkpoint):
    transformer = _json(checkpoint / "transformer" / "config.json")
    assert list(transformer) == ["_class_name", *PUBLISHED_KEYS, "_diffusers_version"]
    assert transformer["local_attn_size"] == -1 and transformer["qk_norm"] == "rms_norm_across_heads"
    assert set(_json(checkpoint / "model_index.json")) == set(PUBLISHED_MODEL_INDEX_KEYS)
    assert set(_json(checkpoint / "vae" / "config.json")) == set(PUBLISHED_VAE_KEYS)
    assert list(_json(checkpoint / "text_encoder" / "config.json")) == list(PUBLISHED_TEXT_ENCODER_KEYS)
    assert set(PUBLISHED_TOKENIZER_FILES) <= {p.name for p in (checkpoint / "tokenizer").iterdir()}
    assert _json(checkpoint / "scheduler" / "scheduler_config.json")["_class_name"] == "UniPCMultistepScheduler"


def test_a_positive_local_attn_size_loads_and_sets_the_window(checkpoint, tmp_path):
    folder = tmp_path / "windowed"
    shutil.copytree(checkpoint, folder)
    _edit(folder / "transformer" / "config.json", local_attn_size=CFG.transformer.sink_size + 2 * 3)
    parts = load_pipeline_parts(folder, dtype=torch.float32, preset_hint=CFG)
    assert parts.config.transformer.sliding_window_num_frames == 15
    assert KVPagePool.pages_per_rollout(parts.config) == 15


def _edit(path: Path, **changes) -> None:
    raw = _json(path)
    for key, value in changes.items():
        if value is _DELETE:
            raw.pop(key)
        else:
            raw[key] = value
    path.write_text(json.dumps(raw))


_DELETE = object()


# ---- the other component configs ---------------------------------------------------------------

@pytest.mark.parametrize("file,changes", [
    ("model_index.json", {"image_encoder": None, "image_processor": None, "boundary_ratio": None,
                          "expand_timesteps": False, "_name_or_path": "x", "some_flag": 3}),
    ("model_index.json", {"scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"], "transformer_2": None}),
    ("model_index.json", {"tokenizer": ["transformers", "T5Tokenizer"]}),
    ("vae/config.json", {"clip_output": False, "in_channels": 3, "out_channels": 3, "is_residual": False,
                         "patch_size": None, "scale_factor_spatial": 8, "scale_factor_temporal": 4}),
    ("vae/config.json", {"_diffusers_version": _DELETE}),
    ("text_encoder/config.json", {"dtype": "bfloat16", "is_decoder": False}),
])
def test_accepted_variants_load(checkpoint, tmp_path, file, changes):
    folder = tmp_path / "variant"
    shutil.copytree(checkpoint, folder)
    _edit(folder / file, **changes)
    parts = load_pipeline_parts(folder, dtype=torch.float32, preset_hint=CFG)
    assert parts.config.transformer == CFG.transformer
    # The config the page is built from while the weights load (blocks/model_source.py) is the loaded one,
    # but for VAE fields a config file leaves to diffusers' defaults.
    planned = planned_config(str(folder), CFG)
    assert same_but_vae(planned, parts.config) and planned.vae.items() <= parts.config.vae.items()


@pytest.mark.parametrize("file,changes,pattern", [
    ("model_index.json", {"image_encoder": ["transformers", "CLIPVisionModel"]}, "image_encoder is .*no image encoder"),
    ("model_index.json", {"image_processor": ["transformers", "CLIPImageProcessor"]}, "image_processor is"),
    ("model_index.json", {"boundary_ratio": 1.5}, r"boundary_ratio is 1.5; expected null or a number in \[0, 1\]"),
    ("model_index.json", {"boundary_ratio": "0.9"}, "boundary_ratio is '0.9'"),
    ("model_index.json", {"expand_timesteps": True}, "expand_timesteps is True"),
    ("model_index.json", {"controlnet": ["diffusers", "ControlNetModel"]}, "part 'controlnet' .* not one this loader"),
    ("model_index.json", {"text_encoder": ["transformers", "T5EncoderModel"]}, "text_encoder is 'T5EncoderModel'"),
    ("vae/config.json", {"_class_name": "AutoencoderKL"}, "_class_name is 'AutoencoderKL'; the VAE is AutoencoderKLWan"),
    ("vae/config.json", {"is_residual": True}, "cannot load the VAE from"),  # Wan 2.2 layout
    ("vae/config.json", {"temperal_downsample": [False, False, True]}, "temporal factor is 2"),
    ("text_encoder/config.json", {"model_type": "t5"}, "model_type='t5'; the text encoder is UMT5"),
    ("text_encoder/config.json", {"d_model": 64}, "d_model=64 but the transformer's text_dim=32"),
    ("transformer/config.json", {"local_attn_size": _DELETE}, r"lacks keys .*\['local_attn_size'\]"),
    ("transformer/config.json", {"local_attn_size": 4}, "local_attn_size=4 must be -1"),
])
def test_refused_variants_say_why(checkpoint, tmp_path, file, changes, pattern):
    folder = tmp_path / "variant"
    shutil.copytree(checkpoint, folder)
    _edit(folder / file, **changes)
    before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    with pytest.raises(CheckpointError, match=pattern):
        load_pipeline_parts(folder, dtype=torch.float32, preset_hint=CFG)
    assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before  # nothing was touched


def test_a_tokenizer_larger_than_the_encoder_vocabulary_is_refused(checkpoint, tmp_path):
    folder = tmp_path / "vocab"
    shutil.copytree(checkpoint, folder)
    vocab = _json(folder / "text_encoder" / "config.json")["vocab_size"]
    _edit(folder / "text_encoder" / "config.json", vocab_size=vocab - 10)
    # the embedding weights no longer match the config either; the tokenizer check names the real problem
    # first when the weights are shrunk to the config's size
    from safetensors.torch import load_file, save_file
    weights = folder / "text_encoder" / "model.safetensors"
    tensors = {k: (v[: vocab - 10].contiguous() if v.shape[0] == vocab else v) for k, v in load_file(weights).items()}
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"has {vocab} tokens but the text encoder's vocabulary has {vocab - 10}"):
        load_pipeline_parts(folder, dtype=torch.float32, preset_hint=CFG)


def test_the_published_model_index_loads_verbatim_and_records_its_boundary_ratio(checkpoint):
    """The official index (vLLM-Omni's fixture of it) carries boundary_ratio 0.9, the DMD pipeline class and
    the empty second expert and image branch; the checkpoint writer writes it byte for byte as json.dumps."""
    index = _json(checkpoint / "model_index.json")
    assert index == {
        "_class_name": "LingBotWorldCausalDMDPipeline", "_diffusers_version": "0.35.0.dev0", "boundary_ratio": 0.9,
        "image_encoder": [None, None], "image_processor": [None, None],
        "scheduler": ["diffusers", "UniPCMultistepScheduler"], "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "CausalLingBotWorldTransformer3DModel"], "transformer_2": [None, None],
        "vae": ["diffusers", "AutoencoderKLWan"]}
    parts = load_pipeline_parts(checkpoint, dtype=torch.float32, preset_hint=CFG)
    assert parts.boundary_ratio == 0.9 and parts.config.transformer == CFG.transformer


def test_the_official_transformer_config_file_loads_verbatim(checkpoint, tmp_path):
    """The published transformer/config.json, as a file, through the folder loader (the 14B shape, so only the
    config stage is reached: the tiny weights then fail by name, which proves the config itself passed)."""
    folder = tmp_path / "official"
    shutil.copytree(checkpoint, folder)
    (folder / "transformer" / "config.json").write_text(json.dumps(OFFICIAL_TRANSFORMER_CONFIG, indent=2))
    with pytest.raises(CheckpointError) as caught:
        load_pipeline_parts(folder, dtype=torch.float32, preset_hint=CFG)
    assert str(caught.value).startswith("tensor ") and "but the model defines [5120]" in str(caught.value)
