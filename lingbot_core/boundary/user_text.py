"""Text that comes from a user: checked before anything uses it, and quoted briefly in error messages.

JSON can carry strings that Python holds but no encoder can write (a lone surrogate such as "\\ud800"):
such text would fail later, deep in the tokenizer, on every block. And an error message that repeats a
10 MB value back to its sender is a 10 MB response; messages quote at most `QUOTE_CHARS` characters.
"""

from __future__ import annotations

import reprlib

QUOTE_CHARS = 60


def _bounded_repr() -> reprlib.Repr:
    """reprlib bounds every level of a nested value (strings, lists, dicts, big integers), so quoting a
    huge value costs no more than the quote itself."""
    bounded = reprlib.Repr()
    bounded.maxlevel = 3
    bounded.maxtuple = bounded.maxlist = bounded.maxarray = bounded.maxdict = 4
    bounded.maxset = bounded.maxfrozenset = bounded.maxdeque = 4
    bounded.maxstring = bounded.maxother = QUOTE_CHARS
    bounded.maxlong = 40
    return bounded


def quote(value: object, limit: int = QUOTE_CHARS) -> str:
    """A short repr of `value` (at most about `limit` characters), safe to put in an error message."""
    text = _bounded_repr().repr(value)
    if isinstance(value, (str, bytes)) and len(value) > limit:
        text += f" ({len(value)} characters)"
    return text if len(text) <= 2 * limit else text[:2 * limit] + "..."


def check_text(text: str, what: str) -> str:
    """`text` unchanged if it can be written as UTF-8; ValueError naming `what` otherwise."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} holds a character that is not valid Unicode text "
                         f"(code point U+{ord(text[exc.start]):04X} at position {exc.start})") from None
    return text
