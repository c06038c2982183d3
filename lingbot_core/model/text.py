"""Text path: prompt -> UMT5 `last_hidden_state` of exactly `max_length` tokens, padding zeroed.

The real checkpoint ships UMT5-XXL and its tokenizer; the embedded preset builds a small UMT5 with
random weights from a seed and a character vocabulary made here, so it needs no download. Both go
through the same `TextEncoder.encode`, so the embedded model exercises the real code path.
"""

from __future__ import annotations

import string
import threading
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase, T5TokenizerFast, UMT5Config, UMT5EncoderModel

from lingbot_core.config import TextConfig


@dataclass(frozen=True)
class TextEncoder:
    """A tokenizer and a UMT5 encoder that together turn one prompt into a fixed-length embedding."""

    tokenizer: PreTrainedTokenizerBase
    model: UMT5EncoderModel
    max_length: int
    # A fast tokenizer sets its truncation and padding on the shared Rust object for each call, so two
    # threads calling it at once can fail ("Already borrowed"): every call here takes this lock.
    _lock: threading.Lock = field(default_factory=threading.Lock, compare=False, repr=False)

    @property
    def d_model(self) -> int:
        return self.model.config.d_model

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    def tokenize(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and attention mask, each [1, max_length], of a prompt cleaned at the boundary (clean_prompt),
        taken as it is: padded and truncated to exactly max_length, as the official T5 path calls the tokenizer."""
        with self._lock:
            batch = self.tokenizer(
                [prompt],
                padding="max_length",
                truncation=True,
                max_length=self.max_length,
                add_special_tokens=True,
                return_attention_mask=True,
                return_tensors="pt",
            )
        return batch["input_ids"], batch["attention_mask"]

    def tokens_past_limit(self, prompt: str) -> tuple[int, int]:
        """(tokens the cleaned prompt has with its end token, how many of them truncation drops)."""
        with self._lock:
            count = len(self.tokenizer(prompt, add_special_tokens=True, truncation=False)["input_ids"])
        return count, max(count - self.max_length, 0)

    def encode(self, prompt: str) -> torch.Tensor:
        """[1, max_length, d_model] float32 on the model's device; padded positions are exactly zero."""
        input_ids, attention_mask = self.tokenize(prompt)
        input_ids = input_ids.to(self.device)
        attention_mask = attention_mask.to(self.device)
        with torch.inference_mode():
            hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            # The DiT cross-attends all max_length tokens without a mask, so padding must carry nothing.
            hidden = hidden.float() * attention_mask[..., None].float()  # [1, L, D]
        return hidden


# ---------------------------------------------------------------------------------------------
# Embedded encoder: no downloaded vocabulary, weights drawn from a seed.

def _embedded_vocabulary() -> list[tuple[str, float]]:
    """A T5-style Unigram vocabulary over single characters: <pad>=0, </s>=1, <unk>=2 as in T5.

    Each printable character appears alone and with the word-start marker "▁"; the word-start
    form scores higher, so "▁a" is preferred over "▁" + "a". Characters outside the set map to <unk>.
    """
    chars = [c for c in string.printable if not c.isspace()]
    chars += [chr(code) for code in range(0xA1, 0x100)]  # Latin-1 letters and signs
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    vocab += [("▁" + c, -2.5) for c in chars]
    vocab += [(c, -3.0) for c in chars]
    return vocab


def build_embedded_tokenizer() -> T5TokenizerFast:
    """A T5 tokenizer over `_embedded_vocabulary`; save_pretrained/from_pretrained round-trips it."""
    return T5TokenizerFast(vocab=_embedded_vocabulary(), extra_ids=0)


def embedded_umt5_config(text_cfg: TextConfig, vocab_size: int) -> UMT5Config:
    if text_cfg.embedded_d_model % text_cfg.embedded_num_heads:
        raise ValueError(f"embedded_d_model={text_cfg.embedded_d_model} is not divisible by "
                         f"embedded_num_heads={text_cfg.embedded_num_heads}")
    return UMT5Config(
        vocab_size=vocab_size,
        d_model=text_cfg.embedded_d_model,
        d_kv=text_cfg.embedded_d_model // text_cfg.embedded_num_heads,
        d_ff=text_cfg.embedded_d_ff,
        num_layers=text_cfg.embedded_num_layers,
        num_heads=text_cfg.embedded_num_heads,
        dropout_rate=0.0,
        feed_forward_proj="gated-gelu",  # as UMT5-XXL
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )


def init_umt5_weights(model: UMT5EncoderModel, generator: torch.Generator) -> None:
    """Fill every parameter from `generator` (drawn on its device) in a fixed order, with T5's initialisation
    scales.

    T5 attention does not divide logits by sqrt(d_kv); the small query scale is what keeps them sane.
    """
    cfg = model.config
    stds = {
        "q": (cfg.d_model * cfg.d_kv) ** -0.5,
        "k": cfg.d_model**-0.5,
        "v": cfg.d_model**-0.5,
        "o": (cfg.num_heads * cfg.d_kv) ** -0.5,
        "relative_attention_bias": cfg.d_model**-0.5,
        "wi_0": cfg.d_model**-0.5,
        "wi_1": cfg.d_model**-0.5,
        "wo": cfg.d_ff**-0.5,
    }
    with torch.no_grad():
        for name, param in model.named_parameters():  # shared embedding appears once (tied)
            parts = name.split(".")
            if "layer_norm" in parts[-2]:
                param.fill_(1.0)
                continue
            std = 1.0 if parts[-2] in ("shared", "embed_tokens") else stds[parts[-2]]
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32, device=generator.device)
            param.copy_(noise * std)


def build_embedded_text_encoder(text_cfg: TextConfig, seed: int, dtype: torch.dtype,
                                device: torch.device | str) -> TextEncoder:
    """A small UMT5 (TextConfig.embedded_*) with deterministic random weights and a local vocabulary."""
    tokenizer = build_embedded_tokenizer()
    model = build_embedded_umt5(text_cfg, len(tokenizer), seed)
    model = model.to(device=device, dtype=dtype)
    return TextEncoder(tokenizer=tokenizer, model=model, max_length=text_cfg.max_length)


def build_embedded_umt5(text_cfg: TextConfig, vocab_size: int, seed: int) -> UMT5EncoderModel:
    """float32 on CPU; built on meta first so transformers' own (global-RNG) init never runs."""
    with torch.device("meta"):
        model = UMT5EncoderModel(embedded_umt5_config(text_cfg, vocab_size))
    model = model.to_empty(device="cpu")
    model.tie_weights()  # to_empty breaks the shared/embed_tokens tie; save_pretrained expects it
    init_umt5_weights(model, torch.Generator().manual_seed(seed))
    model.eval().requires_grad_(False)
    return model


__all__ = ["TextEncoder", "build_embedded_tokenizer",
           "build_embedded_umt5", "build_embedded_text_encoder", "embedded_umt5_config", "init_umt5_weights"]
