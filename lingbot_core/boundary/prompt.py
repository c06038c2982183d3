"""A prompt, cleaned once where it enters (the official tokenizer path's clean), with no model loaded.

Kept apart from the text encoder (model/text.py) so the boundary, which every surface imports, does not
import transformers: the page comes up before the model does.
"""

from __future__ import annotations

import html

import ftfy
import regex  # the official cleaner's module: its \s is Unicode White_Space (unlike re's, not \x1c-\x1f)


class PromptError(ValueError):
    """A prompt that cannot be encoded (not a string, empty, or past the bound on its length)."""


def clean_prompt(text: object, max_chars: int) -> str:
    """The one clean of a prompt, at the boundary: exactly the official tokenizer path's
    `whitespace_clean(basic_clean(text))`, applied once.

    basic_clean repairs mojibake with `ftfy.fix_text` (UTF-8 read as Latin-1/cp1252: "cafÃ©" -> "café"),
    unescapes HTML entities twice and strips; whitespace_clean turns every run of `regex`'s \\s (Unicode
    White_Space) into one space and strips. The UMT5 encoder was trained on prompts cleaned this way. Once
    only: ftfy leaves entities alone in text that holds a literal "<", so a second clean would change such
    text again ("a<b &amp;amp;amp;lt;c" is "a<b &amp;lt;c" after one clean and "a<b <c" after three).

    `max_chars` bounds the raw text against abuse, before any work; the model itself reads the first
    `TextConfig.max_length` tokens of the cleaned text, as upstream truncates (`TextEncoder.tokens_past_limit`
    says how many it drops).
    """
    if not isinstance(text, str):
        raise PromptError(f"prompt must be a string, got {type(text).__name__}")
    if len(text) > max_chars:
        raise PromptError(f"prompt has {len(text)} characters; the limit is {max_chars}")
    cleaned = html.unescape(html.unescape(ftfy.fix_text(text))).strip()
    cleaned = regex.sub(r"\s+", " ", cleaned).strip()
    if not cleaned:
        raise PromptError("prompt is empty (or only whitespace)")
    return cleaned
