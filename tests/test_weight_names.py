"""The model's parameter names and shapes equal the real 14B checkpoint's.

The facts below are transcribed from shared/reference/lingbot-world-v2-14b-transformer-weights.json (recorded
from the public safetensors index) so the test also runs in a clean clone; where that file is present, the
transcription itself is checked against it.
"""

import hashlib
import json
import re
from pathlib import Path

import pytest
import torch

from lingbot_core.config import EMBEDDED, TransformerConfig
from lingbot_core.model.transformer import CausalLingBotWorldTransformer3DModel

REFERENCE = Path(__file__).resolve().parents[2] / "shared/reference/lingbot-world-v2-14b-transformer-weights.json"
# sha256 of the sorted full names joined with LF (no trailing LF), and the tensor count of the index.
NAME_SET_SHA256 = "5d31b7f64fd5e5e271b789b2dbe50fb7bbf146bd8b750646bdc9abb4e5b8139d"
PARAMETER_COUNT = 1421
PARAMETER_SHAPES = {
    "patch_embedding.weight": (5120, 36, 1, 2, 2),
    "patch_embedding_wancamctrl.weight": (5120, 1536),
    "c2ws_hidden_states_layer1.weight": (5120, 5120),
    "c2ws_hidden_states_layer2.weight": (5120, 5120),
    "blocks.0.modulation": (1, 6, 5120),
    "blocks.0.self_attn.q.weight": (5120, 5120),
    "blocks.0.ffn.0.weight": (13824, 5120),
    "blocks.0.ffn.2.weight": (5120, 13824),
    "blocks.0.cam_injector_layer1.weight": (5120, 5120),
    "blocks.0.cam_injector_layer2.weight": (5120, 5120),
    "blocks.0.cam_scale_layer.weight": (5120, 5120),
    "blocks.0.cam_shift_layer.weight": (5120, 5120),
    "blocks.14.cam_scale_layer.bias": (5120,),
    "blocks.35.cam_injector_layer1.bias": (5120,),
    "head.modulation": (1, 2, 5120),
    "head.head.weight": (64, 5120),
}


def _meta_shapes(config: TransformerConfig) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        model = CausalLingBotWorldTransformer3DModel(config)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def _split(names) -> tuple[set[str], set[str]]:
    """(non-block names, block suffixes): 'blocks.7.ffn.0.weight' -> 'ffn.0.weight'."""
    block = re.compile(r"^blocks\.\d+\.")
    return {n for n in names if not block.match(n)}, {block.sub("", n) for n in names if block.match(n)}


def test_14b_names_hash_to_the_checkpoint_name_set():
    names = sorted(_meta_shapes(TransformerConfig()))
    assert len(names) == PARAMETER_COUNT
    assert hashlib.sha256("\n".join(names).encode()).hexdigest() == NAME_SET_SHA256


def test_14b_shapes_match_the_checkpoint():
    shapes = _meta_shapes(TransformerConfig())
    for name, shape in PARAMETER_SHAPES.items():
        assert shapes[name] == shape, name


def test_transcribed_facts_match_the_shared_reference():
    if not REFERENCE.is_file():
        pytest.skip(f"{REFERENCE} is not present (clean clone)")
    reference = json.loads(REFERENCE.read_text())
    assert reference["name_set_sha256"] == NAME_SET_SHA256
    assert reference["index_parameter_count"] == PARAMETER_COUNT
    assert {k: tuple(v) for k, v in reference["parameter_shapes"].items()}.items() >= PARAMETER_SHAPES.items()
    # Every recorded shape (not only the transcribed ones), and the recorded name lists.
    shapes = _meta_shapes(TransformerConfig())
    assert all(shapes[name] == tuple(shape) for name, shape in reference["parameter_shapes"].items())
    non_block, suffixes = _split(shapes)
    assert non_block == set(reference["non_block_parameters"])
    assert suffixes == set(reference["block_parameter_suffixes"])


def test_embedded_preset_has_the_same_names_modulo_block_count():
    names = _meta_shapes(EMBEDDED.transformer)
    assert _split(names) == _split(_meta_shapes(TransformerConfig()))
    expected_blocks = {f"blocks.{i}" for i in range(EMBEDDED.transformer.num_layers)}
    assert {m.group() for n in names if (m := re.match(r"blocks\.\d+", n))} == expected_blocks
