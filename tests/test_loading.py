import dataclasses
import json
import shutil
import socket
from pathlib import Path

import pytest
import torch
from diffusers import AutoencoderKLWan
from safetensors.torch import load_file, save_file

from lingbot_core.blocks import loading
from lingbot_core.config import EMBEDDED, tiny_config
from lingbot_core.blocks.loading import (
    TRANSFORMER_INDEX,
    TRANSFORMER_WEIGHTS,
    CheckpointError,
    build_seeded_parts,
    load_pipeline_parts,
    load_transformer_shards,
    plan_transformer_shards,
)
from lingbot_core.model.transformer import CausalLingBotWorldTransformer3DModel
from tests.checkpoint_writer import write_tiny_checkpoint

CFG = tiny_config()
SHARD_1 = "diffusion_pytorch_model-00001-of-00002.safetensors"
SHARD_2 = "diffusion_pytorch_model-00002-of-00002.safetensors"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A two-shard tiny checkpoint and the float32 modules it was written from."""
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    parts = write_tiny_checkpoint(path, CFG, shards=2, seed=0)
    return path, parts


@pytest.fixture
def tampered(checkpoint, tmp_path):
    """A private copy of the checkpoint that a test may break."""
    copy = tmp_path / "copy"
    shutil.copytree(checkpoint[0], copy)
    return copy


def _load(path, **kwargs):
    return load_pipeline_parts(path, dtype=kwargs.pop("dtype", torch.float32), preset_hint=CFG, **kwargs)


def _inputs(cfg, seed=1):
    """One block of transformer inputs at the tiny config's size."""
    g = torch.Generator().manual_seed(seed)
    t = cfg.transformer
    frames = t.num_frames_per_block
    x = torch.randn(1, t.in_channels, frames, cfg.latent_height, cfg.latent_width, generator=g)
    plucker = torch.randn(1, frames, t.camera_channels, cfg.height, cfg.width, generator=g)
    return x, torch.tensor([937.5]), plucker


def _forward(parts, prompt, x, timestep, plucker):
    dtype = next(parts.transformer.parameters()).dtype
    with torch.no_grad():
        text = parts.text_encoder.encode(prompt).to(dtype)
        text_kv = parts.transformer.prepare_text(text)
        return parts.transformer(x.to(dtype), timestep, text_kv, plucker.to(dtype), start_frame=0)


def _assert_same_state(a: torch.nn.Module, b: torch.nn.Module, cast=lambda t: t):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(cast(sa[name]), sb[name]), name


# --- the good path ------------------------------------------------------------------------------

def test_checkpoint_layout_is_diffusers(checkpoint):
    path, _ = checkpoint
    index = json.loads((path / "model_index.json").read_text())
    assert index["transformer"][1] == "CausalLingBotWorldTransformer3DModel"
    assert index["transformer_2"] == [None, None]
    weight_map = json.loads((path / "transformer" / TRANSFORMER_INDEX).read_text())["weight_map"]
    assert sorted(set(weight_map.values())) == [SHARD_1, SHARD_2]
    for shard in (SHARD_1, SHARD_2):
        assert all(t.dtype == torch.float32 for t in load_file(path / "transformer" / shard).values())
    scheduler = json.loads((path / "scheduler" / "scheduler_config.json").read_text())
    assert scheduler["_class_name"] == "UniPCMultistepScheduler" and scheduler["flow_shift"] == 5.0
    assert (path / "tokenizer" / "tokenizer.json").is_file()


def test_loaded_checkpoint_equals_in_memory_modules(checkpoint):
    path, written = checkpoint
    loaded = _load(path)

    assert loaded.config.transformer == CFG.transformer
    assert loaded.config.text == CFG.text and (loaded.config.height, loaded.config.width) == (CFG.height, CFG.width)
    assert loaded.config.trained and loaded.config.weights_seed is None
    # ModelConfig.vae comes from vae/config.json and rebuilds the same VAE.
    public = lambda c: {k: v for k, v in c.items() if not k.startswith("_")}  # noqa: E731
    assert public(AutoencoderKLWan(**loaded.config.vae).config) == public(written.vae.config)
    assert {k: loaded.config.vae[k] for k in CFG.vae} == CFG.vae

    _assert_same_state(written.transformer, loaded.transformer)
    _assert_same_state(written.vae, loaded.vae)
    _assert_same_state(written.text_encoder.model, loaded.text_encoder.model)
    assert all(not p.is_meta and not p.requires_grad for p in loaded.transformer.parameters())

    # Outputs, exactly: text, transformer, VAE.
    prompt = "a   red door\nat the end of a corridor"
    assert torch.equal(written.text_encoder.encode(prompt), loaded.text_encoder.encode(prompt))
    x, timestep, plucker = _inputs(CFG)
    assert torch.equal(_forward(written, prompt, x, timestep, plucker), _forward(loaded, prompt, x, timestep, plucker))
    z = torch.randn(1, 16, 2, CFG.latent_height, CFG.latent_width, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(written.vae.decode(z).sample, loaded.vae.decode(z).sample)


def test_single_file_checkpoint_in_bf16_and_fp64(tmp_path):
    written = write_tiny_checkpoint(tmp_path / "one", CFG, shards=1, seed=5)
    assert (tmp_path / "one" / "transformer" / TRANSFORMER_WEIGHTS).is_file()
    assert not (tmp_path / "one" / "transformer" / TRANSFORMER_INDEX).exists()

    bf16 = _load(tmp_path / "one", dtype=torch.bfloat16)
    _assert_same_state(written.transformer, bf16.transformer, cast=lambda t: t.bfloat16())
    _assert_same_state(written.vae, bf16.vae, cast=lambda t: t.bfloat16())
    assert next(bf16.text_encoder.model.parameters()).dtype == torch.bfloat16
    assert bf16.text_encoder.encode("a cat").dtype == torch.float32

    fp64 = _load(tmp_path / "one", dtype=torch.float64)
    _assert_same_state(written.transformer, fp64.transformer, cast=lambda t: t.double())


def test_shards_are_assigned_one_at_a_time(checkpoint):
    path, written = checkpoint
    with torch.device("meta"):
        module = CausalLingBotWorldTransformer3DModel(CFG.transformer)
    plan = plan_transformer_shards(path / "transformer", module)
    assert [p.name for p, _ in plan.shards] == [SHARD_1, SHARD_2]

    calls = []
    assign = module.load_state_dict

    def recording_load(state, **kwargs):
        filled = sorted(n for n, p in module.named_parameters() if not p.is_meta)
        calls.append((sorted(state), filled))
        return assign(state, **kwargs)

    module.load_state_dict = recording_load
    load_transformer_shards(module, plan, dtype=torch.float32, device="cpu")

    assert [names for names, _ in calls] == [sorted(names) for _, names in plan.shards]
    assert calls[0][1] == []  # nothing was materialised before the first shard
    assert calls[1][1] == sorted(plan.shards[0][1])  # only the first shard before the second
    _assert_same_state(written.transformer, module)
    assert module.rope.device == torch.device("cpu")


def test_size_override(checkpoint):
    loaded = _load(checkpoint[0], height=64, width=128)
    assert (loaded.config.height, loaded.config.width) == (64, 128)
    with pytest.raises(CheckpointError, match="height and width must be multiples of"):
        _load(checkpoint[0], height=40)


# --- tampered checkpoints -----------------------------------------------------------------------

def _rewrite_shard(folder: Path, shard: str, edit) -> None:
    """Apply `edit(tensors)` to one shard and keep the index in step with the shard's contents."""
    shard_path = folder / "transformer" / shard
    tensors = load_file(shard_path)
    edit(tensors)
    save_file(tensors, shard_path, metadata={"format": "pt"})
    index_path = folder / "transformer" / TRANSFORMER_INDEX
    index = json.loads(index_path.read_text())
    weight_map = {n: f for n, f in index["weight_map"].items() if f != shard}
    weight_map.update({n: shard for n in tensors})
    index["weight_map"] = weight_map
    index_path.write_text(json.dumps(index))


def _first_name(folder: Path, shard: str) -> str:
    return sorted(load_file(folder / "transformer" / shard))[0]


def test_missing_tensor_is_named(tampered):
    name = _first_name(tampered, SHARD_2)
    _rewrite_shard(tampered, SHARD_2, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=rf"lacks 1 of the model's \d+ tensors.*{name}"):
        _load(tampered)


def test_wrong_shape_names_tensor_and_both_shapes(tampered):
    tensors = load_file(tampered / "transformer" / SHARD_1)
    name = next(n for n in sorted(tensors) if tensors[n].ndim == 2)
    shape = list(tensors[name].shape)
    bad = [shape[0] + 1, *shape[1:]]
    _rewrite_shard(tampered, SHARD_1, lambda t: t.update({name: torch.zeros(bad)}))
    with pytest.raises(CheckpointError) as info:
        _load(tampered)
    message = str(info.value)
    assert repr(name) in message and str(bad) in message and str(shape) in message


def test_unknown_key_is_refused(tampered):
    _rewrite_shard(tampered, SHARD_1, lambda t: t.update({"blocks.0.lora_A.weight": torch.zeros(2, 2)}))
    with pytest.raises(CheckpointError, match=r"1 tensors the model does not define.*blocks\.0\.lora_A\.weight"):
        _load(tampered)


def test_missing_shard_file_is_named(tampered):
    (tampered / "transformer" / SHARD_2).unlink()
    with pytest.raises(CheckpointError, match=rf"missing.*{SHARD_2}.*incomplete"):
        _load(tampered)


def test_index_naming_absent_tensor(tampered):
    index_path = tampered / "transformer" / TRANSFORMER_INDEX
    index = json.loads(index_path.read_text())
    moved = _first_name(tampered, SHARD_2)
    index["weight_map"][moved] = SHARD_1  # the index now disagrees with the shard files
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"maps 1 tensors to {SHARD_1} that it does not hold"):
        _load(tampered)


def test_no_weights_at_all(tampered):
    for f in (tampered / "transformer").glob("*.safetensors*"):
        f.unlink()
    with pytest.raises(CheckpointError, match="has neither"):
        _load(tampered)


@pytest.mark.parametrize("part,value,pattern", [
    ("vae", ["diffusers", "AutoencoderKL"], r"vae is 'AutoencoderKL'; this loader builds AutoencoderKLWan"),
    ("transformer", ["diffusers", "WanTransformer3DModel"], r"transformer is 'WanTransformer3DModel'"),
    ("tokenizer", None, r"entry 'tokenizer' is None"),
    ("transformer_2", ["diffusers", "CausalLingBotWorldTransformer3DModel"], r"two-expert checkpoints"),
])
def test_bad_model_index_is_refused(tampered, part, value, pattern):
    path = tampered / "model_index.json"
    index = json.loads(path.read_text())
    index[part] = value
    path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=pattern):
        _load(tampered)


def test_missing_model_index(tampered):
    (tampered / "model_index.json").unlink()
    with pytest.raises(CheckpointError, match="missing file .*model_index.json"):
        _load(tampered)


def test_text_encoder_width_must_match_transformer(tampered):
    path = tampered / "text_encoder" / "config.json"
    raw = json.loads(path.read_text())
    raw["d_model"] = CFG.transformer.text_dim * 2
    path.write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=rf"d_model={CFG.transformer.text_dim * 2} but the transformer's "
                                              rf"text_dim={CFG.transformer.text_dim}"):
        _load(tampered)


def test_unknown_transformer_config_key(tampered):
    path = tampered / "transformer" / "config.json"
    raw = json.loads(path.read_text())
    raw["num_experts"] = 2
    path.write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="num_experts"):
        _load(tampered)


# --- sources ------------------------------------------------------------------------------------

@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a connection fails the test."""
    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    return attempts


def test_hub_id_without_download_gives_clear_offline_error(tmp_path, no_network):
    repo = "robbyant/lingbot-world-v2-14b-causal-fast-diffusers"
    with pytest.raises(CheckpointError) as info:
        load_pipeline_parts(repo, dtype=torch.float32, cache_dir=tmp_path / "hf-cache")
    message = str(info.value)
    assert repo in message and "not a local folder" in message and "local Hugging Face cache" in message
    assert "allow_download=True" in message and "local folder" in message
    assert no_network == []


def test_hub_id_found_in_local_cache_loads_offline(checkpoint, tmp_path, no_network):
    repo = "someone/tiny-lingbot"
    commit = "0123456789abcdef0123456789abcdef01234567"
    storage = tmp_path / "hf-cache" / "models--someone--tiny-lingbot"
    shutil.copytree(checkpoint[0], storage / "snapshots" / commit)
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(commit)

    loaded = load_pipeline_parts(repo, dtype=torch.float32, preset_hint=CFG, cache_dir=tmp_path / "hf-cache")
    _assert_same_state(checkpoint[1].transformer, loaded.transformer)
    assert no_network == []


@pytest.mark.parametrize("source,pattern", [
    ("./no/such/folder", "neither 'embedded', an existing folder, nor a Hub repo id"),
    ("not a repo id", "neither"),
])
def test_bad_sources(source, pattern):
    with pytest.raises(CheckpointError, match=pattern):
        load_pipeline_parts(source)


def test_file_source(checkpoint):
    with pytest.raises(CheckpointError, match="is a file"):
        load_pipeline_parts(checkpoint[0] / "model_index.json")


@pytest.mark.parametrize("kwargs,pattern", [
    (dict(dtype=torch.float16), "dtype torch.float16 is not supported"),
    (dict(device="meta"), "device 'meta' is not supported"),
])
def test_bad_dtype_or_device(checkpoint, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        load_pipeline_parts(checkpoint[0], **kwargs)


def test_embedded_source_without_its_folder_is_seeded_and_dtype_independent(monkeypatch, tmp_path):
    # The trained folder ships with the repository (tests/test_embedded_model.py); without it the
    # source falls back to the preset's seeded weights.
    monkeypatch.setattr(loading, "EMBEDDED_FOLDER", tmp_path / "absent")
    a = load_pipeline_parts("embedded", dtype=torch.float32)
    b = build_seeded_parts(EMBEDDED, EMBEDDED.weights_seed, dtype=torch.bfloat16)
    assert a.config == dataclasses.replace(EMBEDDED, trained=False) and not a.config.trained
    assert a.text_encoder.max_length == EMBEDDED.text.max_length
    assert a.text_encoder.d_model == a.config.transformer.text_dim
    _assert_same_state(a.transformer, b.transformer, cast=lambda t: t.bfloat16())
    _assert_same_state(a.vae, b.vae, cast=lambda t: t.bfloat16())
    _assert_same_state(a.text_encoder.model, b.text_encoder.model, cast=lambda t: t.bfloat16())


def test_seeded_parts_depend_on_the_seed():
    a, b, c = (build_seeded_parts(CFG, seed) for seed in (0, 0, 1))
    for part in ("transformer", "vae"):
        _assert_same_state(getattr(a, part), getattr(b, part))
        assert not torch.equal(next(getattr(a, part).parameters()), next(getattr(c, part).parameters()))
    _assert_same_state(a.text_encoder.model, b.text_encoder.model)
    assert not torch.equal(a.text_encoder.encode("a cat"), c.text_encoder.encode("a cat"))


def test_loading_the_vae_gives_no_advice_to_install_accelerate(checkpoint):
    """Without `accelerate` (not a dependency), diffusers' default low_cpu_mem_usage=True falls back to False
    and tells every start-up to install it; the loader asks for False itself, so start-up stays quiet."""
    import logging

    import diffusers.utils.import_utils as import_utils

    if import_utils.is_accelerate_available():
        pytest.skip("accelerate is installed here: diffusers has nothing to advise")
    heard: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: heard.append(record.getMessage())
    library = logging.getLogger("diffusers")  # diffusers' messages stop there (it does not propagate them)
    library.addHandler(handler)
    try:
        _load(checkpoint[0])
    finally:
        library.removeHandler(handler)
    assert not [m for m in heard if "accelerate" in m], heard
