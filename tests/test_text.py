import dataclasses

import pytest
import torch
from transformers import T5TokenizerFast

from lingbot_core.config import EMBEDDED, TextConfig, tiny_config
from lingbot_core.boundary.prompt import PromptError, clean_prompt
from lingbot_core.model.text import (
    build_embedded_text_encoder,
    build_embedded_tokenizer,
)

TINY_TEXT = tiny_config().text


@pytest.fixture(scope="module")
def encoder64():
    return build_embedded_text_encoder(TINY_TEXT, seed=0, dtype=torch.float64, device="cpu")


# --- the one clean of a prompt ---------------------------------------------------------------

def official_clean(text: str) -> str:
    """The official tokenizer path (wan/modules/tokenizers.py), as upstream writes it:
    whitespace_clean(basic_clean(text)), with `regex` imported as re."""
    import html

    import ftfy
    import regex as re

    def basic_clean(text):
        text = ftfy.fix_text(text)
        text = html.unescape(html.unescape(text))
        return text.strip()

    def whitespace_clean(text):
        text = re.sub(r"\s+", " ", text)
        text = text.strip()
        return text

    return whitespace_clean(basic_clean(text))


def test_clean_collapses_whitespace():
    assert clean_prompt("  a\tcat \n\n walks   in\r\nthe rain ", 100) == "a cat walks in the rain"
    assert clean_prompt("x", 1) == "x"


@pytest.mark.parametrize("bad", [None, 3, b"bytes", ["a"]])
def test_clean_refuses_non_strings(bad):
    with pytest.raises(PromptError, match="must be a string"):
        clean_prompt(bad, 100)


@pytest.mark.parametrize("bad", ["", "   ", "\n\t "])
def test_clean_refuses_empty(bad):
    with pytest.raises(PromptError, match="empty"):
        clean_prompt(bad, 100)


# The six cases of the audit: each reaches the tokenizer as the official single clean leaves it.
PROMPT_CASES = [
    "a<b &amp;amp;amp;lt;c",  # ftfy leaves entities alone beside a literal "<": a second clean changed it
    "1 < 2 &amp;amp;amp;amp; tea",  # html unescapes twice; a second clean would unescape twice more
    "A cafÃ© by the riverâ€™s edge",  # mojibake (UTF-8 bytes read as cp1252)
    "  a\tb\u3000c\x1cd\u00a0e  ",  # regex's \s is Unicode White_Space: \x1c stays, str.split would drop it
    "&lt;b&gt;bold&lt;/b&gt; voil\u00c3\u00a0",  # tags from entities, then a non-breaking space from mojibake
    "rock &amp;amp; roll &lt;3 &quot;live&quot;",
]


@pytest.mark.parametrize("raw", PROMPT_CASES)
def test_a_prompt_is_cleaned_once_as_the_official_path_cleans_it(raw):
    assert clean_prompt(raw, 1000) == official_clean(raw)


def test_the_cases_would_change_under_a_second_clean():
    """Why once matters: the first two cases are not fixed points of the clean."""
    changed = [raw for raw in PROMPT_CASES if clean_prompt(clean_prompt(raw, 1000), 1000) != clean_prompt(raw, 1000)]
    assert PROMPT_CASES[0] in changed and PROMPT_CASES[1] in changed


def test_the_raw_text_is_bounded_before_any_work():
    assert clean_prompt("ab" + " " * 50 + "cd", 54) == "ab cd"
    with pytest.raises(PromptError, match="55 characters; the limit is 54"):
        clean_prompt("ab" + " " * 51 + "cd", 54)
    assert issubclass(PromptError, ValueError)


def test_the_encoder_tokenizes_the_cleaned_text_as_it_is(encoder64):
    """No second clean in the text path: what the boundary cleaned is what the tokenizer gets."""
    text = clean_prompt(PROMPT_CASES[0], 1000)  # "a<b &amp;lt;c"
    ids, mask = encoder64.tokenize(text)
    direct = encoder64.tokenizer([text], padding="max_length", truncation=True, max_length=encoder64.max_length,
                                 add_special_tokens=True, return_tensors="pt")
    assert torch.equal(ids, direct["input_ids"]) and torch.equal(mask, direct["attention_mask"])
    assert not torch.equal(ids, encoder64.tokenize("a<b <c")[0])


def test_a_long_prompt_is_truncated_as_upstream_truncates(encoder64):
    """Upstream tokenizes with truncation=True at max_length (the end token kept last), never refusing."""
    text = "a long road " * 20
    count, dropped = encoder64.tokens_past_limit(text)
    assert count > encoder64.max_length and dropped == count - encoder64.max_length
    ids, mask = encoder64.tokenize(text)
    full = encoder64.tokenizer(text, add_special_tokens=True)["input_ids"]
    assert ids[0].tolist() == full[:encoder64.max_length - 1] + [encoder64.tokenizer.eos_token_id]
    assert int(mask.sum()) == encoder64.max_length
    assert encoder64.tokens_past_limit("short") == (len(encoder64.tokenizer("short")["input_ids"]), 0)


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
