import dataclasses

import pytest
import torch
from transformers import T5TokenizerFast

from lingbot_core.config import EMBEDDED, TextConfig, tiny_config
from lingbot_core.model.text import (
    PromptError,
    build_embedded_text_encoder,
    build_embedded_tokenizer,
    normalize_prompt,
)

TINY_TEXT = tiny_config().text


@pytest.fixture(scope="module")
def encoder64():
    return build_embedded_text_encoder(TINY_TEXT, seed=0, dtype=torch.float64, device="cpu")


# --- prompt normalisation -------------------------------------------------------------------

def test_normalize_collapses_whitespace():
    assert normalize_prompt("  a\tcat \n\n walks   in\r\nthe rain ", 100) == "a cat walks in the rain"
    assert normalize_prompt("x", 1) == "x"


@pytest.mark.parametrize("bad", [None, 3, b"bytes", ["a"]])
def test_normalize_refuses_non_strings(bad):
    with pytest.raises(PromptError, match="must be a string"):
        normalize_prompt(bad, 100)


@pytest.mark.parametrize("bad", ["", "   ", "\n\t "])
def test_normalize_refuses_empty(bad):
    with pytest.raises(PromptError, match="empty"):
        normalize_prompt(bad, 100)


def test_prompt_cleaning_follows_the_official_tokenizer_path():
    """ftfy.fix_text, then html.unescape twice, then whitespace: mojibake and double-escaped entities repaired."""
    mojibake = "A cafÃ© by the riverâ€™s edge, crÃ¨me-coloured walls"  # UTF-8 bytes read as cp1252
    assert normalize_prompt(mojibake, 100) == "A café by the river's edge, crème-coloured walls"
    assert normalize_prompt("rock &amp;amp; roll &lt;3 &quot;live&quot;", 100) == 'rock & roll <3 "live"'
    # a non-breaking space from mojibake is repaired, not collapsed away first ("Ã\xa0" is "à")
    assert normalize_prompt("voil\u00c3\u00a0 la mer", 100) == "voilà la mer"
    # entities that decode to whitespace are collapsed like any other whitespace
    assert normalize_prompt("a&nbsp;&nbsp; b&#10;c", 100) == "a b c"
    # clean text is unchanged, and the length bound applies to the cleaned text
    assert normalize_prompt("a forest path at dawn", 100) == "a forest path at dawn"
    assert normalize_prompt("&amp;amp;" * 5, 5) == "&&&&&"
    with pytest.raises(PromptError, match="before cleaning"):
        normalize_prompt(" " * 70000, 100)


def test_cleaned_prompts_encode_identically(encoder64):
    assert torch.equal(encoder64.encode("cafÃ© &amp;amp; bar"), encoder64.encode("café & bar"))


def test_normalize_bounds_length_after_collapsing():
    assert normalize_prompt("ab" + " " * 50 + "cd", 5) == "ab cd"  # 5 chars once collapsed
    with pytest.raises(PromptError, match="6 characters.*limit is 5"):
        normalize_prompt("abc   de", 5)
    assert issubclass(PromptError, ValueError)


def test_encode_refuses_bad_prompts(encoder64):
    for bad in ["", "  ", None, "x" * (TINY_TEXT.max_prompt_chars + 1)]:
        with pytest.raises(PromptError):
            encoder64.encode(bad)


# --- tokenizer ---------------------------------------------------------------------------------

def test_tokenizer_has_t5_special_ids_and_no_download(tmp_path):
    tok = build_embedded_tokenizer()
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    ids = tok("hi there").input_ids
    assert ids[-1] == tok.eos_token_id
    assert tok.convert_ids_to_tokens(ids) == ["▁h", "i", "▁t", "h", "e", "r", "e", "</s>"]
    assert tok("日本").input_ids == [tok.convert_tokens_to_ids("▁"), 2, 1]  # unknown run -> one <unk>

    # The checkpoint path reloads it with from_pretrained: same vocabulary, same ids.
    tok.save_pretrained(tmp_path)
    reloaded = T5TokenizerFast.from_pretrained(tmp_path)
    text = "A Cat, walking; in 1999 -- über café!"
    assert reloaded(text).input_ids == tok(text).input_ids
    assert len(reloaded) == len(tok)


def test_tokenize_gives_exactly_max_length(encoder64):
    short_ids, short_mask = encoder64.tokenize("a cat")
    assert short_ids.shape == short_mask.shape == (1, TINY_TEXT.max_length)
    assert short_mask[0].tolist() == [1] * 5 + [0] * (TINY_TEXT.max_length - 5)  # ▁a ▁c a t </s>
    assert short_ids[0, short_mask[0] == 0].eq(0).all()  # <pad> = 0

    long_ids, long_mask = encoder64.tokenize("abcdefghij " * 10)
    assert long_ids.shape == (1, TINY_TEXT.max_length)
    assert long_mask.all()
    assert long_ids[0, -1] == encoder64.tokenizer.eos_token_id  # truncation keeps the closing </s>


# --- encoder -----------------------------------------------------------------------------------

def test_encode_shape_and_zero_padding(encoder64):
    out = encoder64.encode("a small cat")
    _, mask = encoder64.tokenize("a small cat")
    assert out.shape == (1, TINY_TEXT.max_length, TINY_TEXT.embedded_d_model)
    assert out.dtype == torch.float32
    valid = mask[0].bool()
    assert out[0, ~valid].eq(0).all()
    assert (out[0, valid].norm(dim=-1) > 0).all()


def test_padding_does_not_change_valid_positions(encoder64):
    """Oracle: the padded, masked run equals the model on the unpadded tokens alone."""
    prompt = "a cat on a mat"
    ids, mask = encoder64.tokenize(prompt)
    n = int(mask.sum())
    assert n < TINY_TEXT.max_length
    with torch.no_grad():
        reference = encoder64.model(input_ids=ids[:, :n]).last_hidden_state.float()  # [1, n, D]
    out = encoder64.encode(prompt)
    torch.testing.assert_close(out[:, :n], reference, rtol=0, atol=1e-6)


def test_whitespace_variants_encode_identically(encoder64):
    assert torch.equal(encoder64.encode("a cat  walks"), encoder64.encode("\n a\tcat walks  "))


def test_embedded_encoder_is_deterministic():
    a = build_embedded_text_encoder(TINY_TEXT, seed=3, dtype=torch.float32, device="cpu")
    b = build_embedded_text_encoder(TINY_TEXT, seed=3, dtype=torch.float32, device="cpu")
    c = build_embedded_text_encoder(TINY_TEXT, seed=4, dtype=torch.float32, device="cpu")
    state_a, state_b, state_c = (m.model.state_dict() for m in (a, b, c))
    assert state_a.keys() == state_b.keys()
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    assert not all(torch.equal(state_a[k], state_c[k]) for k in state_a if "layer_norm" not in k)
    assert torch.equal(a.encode("a red door"), b.encode("a red door"))
    assert not torch.equal(a.encode("a red door"), c.encode("a red door"))
    # The global RNG is not consumed: the weights come from a private generator.
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    build_embedded_text_encoder(TINY_TEXT, seed=3, dtype=torch.float32, device="cpu")
    assert torch.equal(torch.rand(3), before)


def test_embedded_weights_are_tied_and_independent_of_dtype():
    f32 = build_embedded_text_encoder(TINY_TEXT, seed=0, dtype=torch.float32, device="cpu")
    f64 = build_embedded_text_encoder(TINY_TEXT, seed=0, dtype=torch.float64, device="cpu")
    bf16 = build_embedded_text_encoder(TINY_TEXT, seed=0, dtype=torch.bfloat16, device="cpu")
    assert f32.model.shared.weight is f32.model.encoder.embed_tokens.weight
    for name, weight in f32.model.state_dict().items():
        assert torch.equal(f64.model.state_dict()[name], weight.double())
        assert torch.equal(bf16.model.state_dict()[name], weight.bfloat16())
    out = bf16.encode("a cat")
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, f32.encode("a cat"), rtol=0.1, atol=0.1)


def test_embedded_preset_gives_512_tokens_of_text_dim():
    """The EMBEDDED preset's encoder feeds its transformer: 512 tokens of text_dim features."""
    assert EMBEDDED.text.max_length == 512
    encoder = build_embedded_text_encoder(EMBEDDED.text, seed=EMBEDDED.weights_seed, dtype=torch.float32,
                                          device="cpu")
    out = encoder.encode("a long corridor with doors on both sides")
    assert out.shape == (1, 512, EMBEDDED.transformer.text_dim)
    assert encoder.d_model == EMBEDDED.text.embedded_d_model == EMBEDDED.transformer.text_dim
    assert tiny_config().text.embedded_d_model == tiny_config().transformer.text_dim


def test_bad_embedded_config_refused():
    with pytest.raises(ValueError, match="not divisible"):
        build_embedded_text_encoder(dataclasses.replace(TextConfig(), embedded_num_heads=3), seed=0,
                                    dtype=torch.float32, device="cpu")
