"""Turn a source into model parts: "embedded", a local diffusers-format folder, or a Hub repo id.

A checkpoint folder has the diffusers layout of the real release:

    model_index.json
    transformer/config.json + diffusion_pytorch_model.safetensors
                            | diffusion_pytorch_model-0000k-of-0000n.safetensors + ....safetensors.index.json
    vae/           AutoencoderKLWan.save_pretrained
    text_encoder/  UMT5EncoderModel.save_pretrained
    tokenizer/     T5TokenizerFast.save_pretrained
    scheduler/     (read by nobody: the realtime sampler has its own schedule)

The transformer (28 GB in bf16 for 14B) is built on the meta device and filled one shard at a time,
so peak host memory is about one shard. Everything that can be checked from headers (key names,
shapes, shard files) is checked before any weight is read.

What each config file may hold (the README lists the same):
- model_index.json: transformer, vae, text_encoder and tokenizer entries of the classes in
  EXPECTED_CLASSES; scheduler of any class (nobody reads it); metadata keys ("_..."); the optional
  parts a one-expert, text-only checkpoint leaves empty (transformer_2, image_encoder,
  image_processor: null or [null, null]; expand_timesteps false); `boundary_ratio` (the published
  index carries 0.9: the step at which a second transformer would take over; with none it has no effect,
  so any number in [0, 1] or null is accepted and recorded on LoadedParts) and any other scalar key. Refused: a missing or wrong-class required part, a filled optional part, and any other
  [library, class] part, which this loader would otherwise silently leave out.
- transformer/config.json: exactly the published key set (config.PUBLISHED_KEYS, all of them) plus
  metadata; see TransformerConfig.from_diffusers_config for what each value may be.
- vae/config.json, text_encoder/config.json, tokenizer/: read by diffusers' AutoencoderKLWan and
  transformers' UMT5EncoderModel / T5TokenizerFast, which take the published key sets and ignore keys
  they do not know, as they do for any checkpoint. This loader adds the checks that matter here: the
  VAE class and the plain streamable Wan 2.1 path (vae_stream.check_streamable), model_type "umt5"
  with d_model equal to the transformer's text_dim, and a tokenizer whose ids fit the encoder's vocabulary.
- scheduler/: not read; the realtime sampler has its own schedule (config.SamplerConfig).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKLWan
from huggingface_hub import snapshot_download
from huggingface_hub.errors import IncompleteSnapshotError
from safetensors import safe_open
from transformers import T5TokenizerFast, UMT5EncoderModel

from lingbot_core.config import ModelConfig, TextConfig, TransformerConfig
from lingbot_core.model.text import TextEncoder, build_embedded_text_encoder
from lingbot_core.model.transformer import CausalLingBotWorldTransformer3DModel
from lingbot_core.model.cpu_kernels import use_fast_cpu_kernels
from lingbot_core.model.vae_stream import build_vae, check_streamable
from lingbot_core.blocks.model_source import (EMBEDDED_FOLDER, EMBEDDED_SOURCE, CheckpointError, config_from_parts,
                                               embedded_choice, read_json, read_transformer_config)

SUPPORTED_DTYPES = (torch.bfloat16, torch.float32, torch.float64)  # float64: exactness tests only

TRANSFORMER_WEIGHTS = "diffusion_pytorch_model.safetensors"
TRANSFORMER_INDEX = "diffusion_pytorch_model.safetensors.index.json"

# model_index.json entry -> class names this loader can build from that subfolder.
EXPECTED_CLASSES: dict[str, tuple[str, ...]] = {
    "transformer": ("CausalLingBotWorldTransformer3DModel",),
    "vae": ("AutoencoderKLWan",),
    "text_encoder": ("UMT5EncoderModel",),
    "tokenizer": ("T5TokenizerFast", "T5Tokenizer"),
}
# Parts a one-expert, text-only checkpoint may list but must leave empty, and the empty value of each.
OPTIONAL_EMPTY_PARTS = ("transformer_2", "image_encoder", "image_processor")
EMPTY_SCALARS = {"expand_timesteps": False}  # per-token timesteps: not this model's sampler
# The two-expert switch point: the published index carries 0.9 with transformer_2 empty, where it selects nothing.
BOUNDARY_RATIO = "boundary_ratio"
# Only the subfolders the loader reads are fetched from the Hub.
HUB_PATTERNS = ["model_index.json", "transformer/*", "vae/*", "text_encoder/*", "tokenizer/*", "scheduler/*"]

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class LoadedParts:
    config: ModelConfig
    transformer: CausalLingBotWorldTransformer3DModel
    vae: AutoencoderKLWan
    text_encoder: TextEncoder
    # model_index.json's two-expert switch point, as the checkpoint gives it (the published 0.9): recorded
    # only, since with transformer_2 empty every step runs the one transformer.
    boundary_ratio: float | None = None


def load_pipeline_parts(source: str | Path, *, dtype: torch.dtype = torch.bfloat16,
                        device: torch.device | str = "cpu", allow_download: bool = False,
                        preset_hint: ModelConfig | None = None, height: int | None = None,
                        width: int | None = None, cache_dir: str | Path | None = None) -> LoadedParts:
    """Build the transformer, VAE and text encoder from `source`.

    source:        "embedded" (config.EMBEDDED: the trained weights in EMBEDDED_FOLDER, or weights from its
                   seed where that folder is absent), a local folder, or a Hub repo id.
    allow_download: a Hub id not in the local Hugging Face cache is downloaded only when True.
    preset_hint:   fields a checkpoint does not carry (text, sampler, camera, fps, height, width, name);
                   the checkpoint's own transformer and VAE configs always win.
    height/width:  override the output size (default: the hint's, else 480x832).
    """
    _check_dtype_device(dtype, device)
    if isinstance(source, str) and source == EMBEDDED_SOURCE:
        config, folder = embedded_choice(preset_hint, height, width, EMBEDDED_FOLDER)
        if folder is not None:
            return load_folder(folder, dtype=dtype, device=device, preset_hint=config, height=height, width=width)
        return build_seeded_parts(config, config.weights_seed, dtype=dtype, device=device)
    folder = _resolve_folder(source, allow_download=allow_download, cache_dir=cache_dir)
    return load_folder(folder, dtype=dtype, device=device, preset_hint=preset_hint, height=height, width=width)


# ---------------------------------------------------------------------------------------------
# Seeded (embedded) parts


def build_seeded_parts(config: ModelConfig, seed: int, *, dtype: torch.dtype = torch.float32,
                       device: torch.device | str = "cpu") -> LoadedParts:
    """All three parts with deterministic random weights from `seed`, independent of dtype and device.

    Weights are drawn in float32 on CPU and then converted, so the same seed gives the same model
    (up to rounding) on every device and dtype.
    """
    _check_dtype_device(dtype, device)
    with torch.device("meta"):
        transformer = CausalLingBotWorldTransformer3DModel(config.transformer)
    transformer = transformer.to_empty(device="cpu")
    transformer.init_weights(torch.Generator().manual_seed(seed))
    transformer = transformer.to(device=device, dtype=dtype).eval().requires_grad_(False)
    transformer.materialize_buffers(torch.device(device))

    vae = build_vae(config, dtype, device, seed=seed)
    check_streamable(vae, config)
    text_encoder = build_embedded_text_encoder(config.text, seed, dtype, device)
    _check_text_dim(text_encoder, config.transformer, "the embedded text encoder")
    return LoadedParts(config=config, transformer=transformer, vae=vae, text_encoder=text_encoder)


# ---------------------------------------------------------------------------------------------
# Sources


def _resolve_folder(source: str | Path, *, allow_download: bool, cache_dir: str | Path | None) -> Path:
    path = Path(source).expanduser()
    if path.exists():
        if not path.is_dir():
            raise CheckpointError(f"checkpoint source {str(source)!r} is a file; give the folder that holds "
                                  "model_index.json")
        return path
    text = str(source)
    if not _REPO_ID.match(text) or text.startswith((".", "~")):
        raise CheckpointError(f"checkpoint source {text!r} is neither {EMBEDDED_SOURCE!r}, an existing folder, "
                              "nor a Hub repo id of the form owner/name")
    return _hub_snapshot(text, allow_download=allow_download, cache_dir=cache_dir)


def _hub_snapshot(repo_id: str, *, allow_download: bool, cache_dir: str | Path | None) -> Path:
    """The repo's snapshot folder: from the local cache only, unless downloading is allowed."""
    try:
        folder = snapshot_download(repo_id, allow_patterns=HUB_PATTERNS, cache_dir=cache_dir,
                                   local_files_only=not allow_download)
    except Exception as error:  # the Hub client raises many types (HTTP, offline, validation, OS)
        raise CheckpointError(_hub_failure_message(repo_id, error, allow_download, cache_dir)) from error
    return Path(folder)


def _hub_failure_message(repo_id: str, error: Exception, allow_download: bool,
                         cache_dir: str | Path | None) -> str:
    if allow_download:
        return (f"Hub repo {repo_id!r} could not be downloaded: {type(error).__name__}: {error}. To fix: check the "
                "repo id, the network connection and, for a gated repo, `hf auth login`; or download it "
                "elsewhere and pass the local folder")
    where = "the local Hugging Face cache" + (f" ({cache_dir})" if cache_dir is not None else "")
    # A plain cache miss needs no detail (the client's text would suggest its own flag, not ours);
    # a partial snapshot does: it names the missing files.
    detail = f" ({error})" if isinstance(error, IncompleteSnapshotError) else ""
    return (f"{repo_id!r} is not a local folder, and as a Hub repo it is not in {where}{detail}; downloading "
            "is off (no network call was made). To fix: pass allow_download=True (needs network access), or "
            "pass the path of a local folder holding the checkpoint")


# ---------------------------------------------------------------------------------------------
# A diffusers-format folder


def load_folder(folder: str | Path, *, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                preset_hint: ModelConfig | None = None, height: int | None = None,
                width: int | None = None) -> LoadedParts:
    """Load a checkpoint folder; cheap checks (configs, tensor names and shapes) run before any weights."""
    _check_dtype_device(dtype, device)
    folder = Path(folder)
    boundary_ratio = _check_model_index(folder)

    transformer_config = read_transformer_config(folder / "transformer")
    with torch.device("meta"):
        transformer = CausalLingBotWorldTransformer3DModel(transformer_config)
    plan = plan_transformer_shards(folder / "transformer", transformer)
    _check_text_encoder_config(folder / "text_encoder", transformer_config)

    vae = load_vae(folder / "vae", dtype, device)
    config = config_from_parts(vae.config, transformer_config, preset_hint, height, width, folder)
    try:
        check_streamable(vae, config)
    except ValueError as error:
        raise CheckpointError(f"{folder / 'vae'}: {error}") from error

    load_transformer_shards(transformer, plan, dtype=dtype, device=device)
    text_encoder = _load_text_encoder(folder, config.text, dtype, device)
    _check_text_dim(text_encoder, transformer_config, str(folder / "text_encoder"))
    return LoadedParts(config=config, transformer=transformer, vae=vae, text_encoder=text_encoder,
                       boundary_ratio=boundary_ratio)


def _boundary_ratio(index: dict[str, Any], index_path: Path) -> float | None:
    """The index's boundary_ratio: null, or a number in [0, 1] (it has no effect with one transformer)."""
    value = index.get(BOUNDARY_RATIO)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise CheckpointError(f"{index_path}: boundary_ratio is {value!r}; expected null or a number in [0, 1]")
    return float(value)


def _check_model_index(folder: Path) -> float | None:
    """Check model_index.json; returns its boundary_ratio (recorded, without effect: there is no transformer_2)."""
    index_path = folder / "model_index.json"
    index = read_json(index_path)
    for part, allowed in EXPECTED_CLASSES.items():
        entry = index.get(part)
        if not (isinstance(entry, list) and len(entry) == 2):
            raise CheckpointError(f"{index_path}: entry {part!r} is {entry!r}; expected [library, class] with "
                                  f"class {' or '.join(allowed)}")
        if entry[1] not in allowed:
            raise CheckpointError(f"{index_path}: {part} is {entry[1]!r}; this loader builds "
                                  f"{' or '.join(allowed)}")
    second = index.get("transformer_2")
    if second is not None and second != [None, None]:
        raise CheckpointError(f"{index_path}: transformer_2 is {second!r}; two-expert checkpoints are not "
                              "supported (this model has one transformer)")
    for part in OPTIONAL_EMPTY_PARTS[1:]:
        entry = index.get(part)
        if entry is not None and entry != [None, None]:
            raise CheckpointError(f"{index_path}: {part} is {entry!r}; this model has no image encoder branch, so "
                                  "the checkpoint must leave it empty")
    for key, empty in EMPTY_SCALARS.items():
        if index.get(key, empty) != empty:
            raise CheckpointError(f"{index_path}: {key} is {index[key]!r}; this one-expert model with one timestep "
                                  f"a block needs {json.dumps(empty)}")
    known = set(EXPECTED_CLASSES) | {"scheduler", *OPTIONAL_EMPTY_PARTS, *EMPTY_SCALARS, BOUNDARY_RATIO}
    for key, entry in index.items():
        if key.startswith("_") or key in known:
            continue
        if isinstance(entry, list) and len(entry) == 2 and entry[1] is not None:
            raise CheckpointError(f"{index_path}: part {key!r} ({entry[1]}) is not one this loader builds, and "
                                  "leaving it out could change the model; expected transformer, vae, text_encoder, "
                                  "tokenizer and scheduler only")
    return _boundary_ratio(index, index_path)


def _check_text_encoder_config(subfolder: Path, transformer_config: TransformerConfig) -> None:
    """Read model_type and d_model from config.json so a mismatch fails before gigabytes of weights are read."""
    raw = read_json(subfolder / "config.json")
    if raw.get("model_type") != "umt5":
        raise CheckpointError(f"{subfolder / 'config.json'}: model_type={raw.get('model_type')!r}; the text "
                              "encoder is UMT5 (model_type 'umt5')")
    d_model = raw.get("d_model")
    if d_model != transformer_config.text_dim:
        raise CheckpointError(f"{subfolder / 'config.json'}: d_model={d_model} but the transformer's "
                              f"text_dim={transformer_config.text_dim}")


def _check_text_dim(encoder: TextEncoder, transformer_config: TransformerConfig, where: str) -> None:
    if encoder.d_model != transformer_config.text_dim:
        raise CheckpointError(f"{where}: text encoder d_model={encoder.d_model} but the transformer's "
                              f"text_dim={transformer_config.text_dim}")


def load_vae(subfolder: Path, dtype: torch.dtype, device: torch.device | str) -> AutoencoderKLWan:
    """An AutoencoderKLWan folder (config.json and weights) as an inference module with the fast CPU kernels;
    the pipeline's loader and the training commands both read VAEs through it."""
    class_name = read_json(subfolder / "config.json").get("_class_name", "AutoencoderKLWan")
    if class_name != "AutoencoderKLWan":
        raise CheckpointError(f"{subfolder / 'config.json'}: _class_name is {class_name!r}; the VAE is AutoencoderKLWan")
    try:
        # from_pretrained may run a random init first; keep the global RNG. low_cpu_mem_usage=False is what
        # diffusers falls back to without `accelerate` (not a dependency: the VAE is small); saying so
        # spares every start-up its advice to install it.
        with torch.random.fork_rng(devices=[]):
            vae = AutoencoderKLWan.from_pretrained(subfolder, torch_dtype=dtype, low_cpu_mem_usage=False)
    except (OSError, ValueError, RuntimeError) as error:
        raise CheckpointError(f"cannot load the VAE from {subfolder}: {error}") from error
    use_fast_cpu_kernels(vae)
    return vae.to(device=device).eval().requires_grad_(False)


def _load_text_encoder(folder: Path, text_config: TextConfig, dtype: torch.dtype,
                       device: torch.device | str) -> TextEncoder:
    try:
        tokenizer = T5TokenizerFast.from_pretrained(folder / "tokenizer")
    except (OSError, ValueError) as error:
        raise CheckpointError(f"cannot load the tokenizer from {folder / 'tokenizer'}: {error}") from error
    try:
        with torch.random.fork_rng(devices=[]):
            model = UMT5EncoderModel.from_pretrained(folder / "text_encoder", dtype=dtype)
    except (OSError, ValueError, RuntimeError) as error:
        raise CheckpointError(f"cannot load the text encoder from {folder / 'text_encoder'}: {error}") from error
    model = model.to(device=device).eval().requires_grad_(False)
    if len(tokenizer) > model.config.vocab_size:  # ids past the embedding table would fail at the first prompt
        raise CheckpointError(f"{folder / 'tokenizer'} has {len(tokenizer)} tokens but the text encoder's vocabulary "
                              f"has {model.config.vocab_size}; they do not belong together")
    return TextEncoder(tokenizer=tokenizer, model=model, max_length=text_config.max_length)


def _check_dtype_device(dtype: torch.dtype, device: torch.device | str) -> None:
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {dtype} is not supported; use one of {[str(d) for d in SUPPORTED_DTYPES]}")
    kind = torch.device(device).type
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r} is not supported; use 'cpu' or 'cuda'")


# ---------------------------------------------------------------------------------------------
# Transformer weights: sharded safetensors onto a meta module


@dataclass(frozen=True)
class ShardPlan:
    """Which tensor names to read from which file, validated against the module from headers only."""

    shards: tuple[tuple[Path, tuple[str, ...]], ...]


def plan_transformer_shards(subfolder: Path, module: torch.nn.Module) -> ShardPlan:
    """Check every tensor name and shape of the checkpoint against `module` without reading weights.

    Raises CheckpointError for: no weights file, an index naming a missing shard, an index and shard
    that disagree, a name in two shards, unknown names, missing names, or a shape mismatch.
    """
    single = subfolder / TRANSFORMER_WEIGHTS
    index_path = subfolder / TRANSFORMER_INDEX
    if index_path.is_file():
        shard_files = _shards_from_index(index_path)
    elif single.is_file():
        shard_files = {single: None}
    else:
        raise CheckpointError(f"{subfolder} has neither {TRANSFORMER_WEIGHTS} nor {TRANSFORMER_INDEX}")

    expected = {name: tuple(t.shape) for name, t in module.state_dict().items()}
    seen: dict[str, Path] = {}
    shards = []
    for path, indexed_names in shard_files.items():
        names, shapes = _read_header(path)
        if indexed_names is not None and set(indexed_names) - set(names):
            absent = sorted(set(indexed_names) - set(names))
            raise CheckpointError(f"{index_path} maps {len(absent)} tensors to {path.name} that it does not hold, "
                                  f"e.g. {absent[:5]}")
        for name in names:
            if name in seen:
                raise CheckpointError(f"tensor {name!r} appears in both {seen[name].name} and {path.name}")
            seen[name] = path
            if name in expected and shapes[name] != expected[name]:
                raise CheckpointError(f"tensor {name!r} in {path.name} has shape {list(shapes[name])} but the "
                                      f"model defines {list(expected[name])} (check transformer/config.json)")
        shards.append((path, tuple(names)))

    unknown = sorted(set(seen) - set(expected))
    if unknown:
        raise CheckpointError(f"{subfolder} holds {len(unknown)} tensors the model does not define, e.g. "
                              f"{unknown[:5]}")
    missing = sorted(set(expected) - set(seen))
    if missing:
        raise CheckpointError(f"{subfolder} lacks {len(missing)} of the model's {len(expected)} tensors, e.g. "
                              f"{missing[:5]}")
    return ShardPlan(shards=tuple(shards))


def _shards_from_index(index_path: Path) -> dict[Path, list[str] | None]:
    weight_map = read_json(index_path).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index_path} has no weight_map")
    by_file: dict[Path, list[str]] = {}
    for name, filename in weight_map.items():
        if not isinstance(filename, str) or Path(filename).name != filename:
            raise CheckpointError(f"{index_path}: tensor {name!r} maps to {filename!r}, not a file name in "
                                  f"{index_path.parent}")
        by_file.setdefault(index_path.parent / filename, []).append(name)
    absent = sorted(p.name for p in by_file if not p.is_file())
    if absent:
        raise CheckpointError(f"{index_path} names shard files that are missing from {index_path.parent}: "
                              f"{absent}; the download is incomplete")
    return dict(sorted(by_file.items()))


def _read_header(path: Path) -> tuple[list[str], dict[str, tuple[int, ...]]]:
    try:
        with safe_open(path, framework="pt", device="cpu") as handle:
            names = list(handle.keys())
            shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in names}
    except Exception as error:  # safetensors raises its own SafetensorError for corrupt headers
        raise CheckpointError(f"cannot read safetensors header of {path}: {error}") from error
    return names, shapes


def load_transformer_shards(module: torch.nn.Module, plan: ShardPlan, *, dtype: torch.dtype,
                            device: torch.device | str) -> None:
    """Assign the planned tensors into the meta `module` one shard at a time, then rebuild its buffers.

    Each tensor is converted to dtype/device as it is read, so at most one shard (in the target
    dtype) plus one tensor (as stored) is alive beyond what is already assigned.
    """
    for path, names in plan.shards:
        state = {}
        with safe_open(path, framework="pt", device="cpu") as handle:
            for name in names:
                tensor = handle.get_tensor(name)
                if not tensor.is_floating_point():
                    raise CheckpointError(f"tensor {name!r} in {path.name} has dtype {tensor.dtype}; expected "
                                          "floating point weights")
                state[name] = tensor.to(device=device, dtype=dtype)
        result = module.load_state_dict(state, strict=False, assign=True)
        if result.unexpected_keys:  # the plan already refused these; a mismatch here is a bug
            raise CheckpointError(f"{path.name}: unexpected tensors {result.unexpected_keys[:5]}")
        del state

    module.eval().requires_grad_(False)
    module.materialize_buffers(torch.device(device))
    still_meta = [name for name, t in (*module.named_parameters(), *module.named_buffers()) if t.is_meta]
    if still_meta:
        raise CheckpointError(f"after loading, {len(still_meta)} tensors were never filled, e.g. {still_meta[:5]}")
