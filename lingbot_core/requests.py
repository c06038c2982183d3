"""A world's start, parsed once at the boundary: the picture fitted to the frame, the prompt cleaned, the seed exact.

Every caller that takes a start from outside (the app's stream and Reset, the offline command, a script
calling `Pipeline.rollout` with an image and a prompt) turns it into a `StartRequest` here; the engine,
the session and the pipeline trust it and check nothing again. Bad input raises a ValueError subclass
(ImageError, PromptError, RequestError) whose message names the problem.
"""

from __future__ import annotations

from dataclasses import dataclass

from PIL import Image

from .image import fit_image, load_image
from .model.text import clean_prompt
from .user_text import check_text, quote

MAX_SEED = 2**63 - 1


class RequestError(ValueError):
    """A start that cannot be used; the message says why."""


@dataclass(frozen=True)
class StartRequest:
    picture: Image.Image  # RGB, exactly the model's width x height (decoded once, fitted once)
    prompt: str  # cleaned once, as the official tokenizer path cleans it (clean_prompt); the tokenizer takes it as is
    seed: int  # 0 <= seed <= MAX_SEED


def parse_seed(seed) -> int:
    """A seed from a form or an API call: a whole number (or its text) from 0 to MAX_SEED; None or '' is 0."""
    if seed is None or seed == "":
        return 0
    if isinstance(seed, bool):
        raise RequestError(f"seed must be a whole number, got {seed!r}")
    if isinstance(seed, int):  # exact: a float would round seeds above 2**53
        value = seed
    else:
        try:
            number = float(seed)
        except (TypeError, ValueError, OverflowError):
            raise RequestError(f"seed must be a whole number, got {quote(seed)}") from None
        if not number.is_integer():  # also NaN and infinities
            raise RequestError(f"seed must be a whole number from 0 to {MAX_SEED}, got {quote(seed)}")
        value = int(number)
    if not 0 <= value <= MAX_SEED:
        raise RequestError(f"seed must be a whole number from 0 to {MAX_SEED}, got {quote(seed)}")
    return value


def parse_start(image, prompt, seed, config) -> StartRequest:
    """The one parse of a start (`config`: the pipeline's ModelConfig). Decoding and fitting the picture is
    the costly step: callers run it on a request thread, never the event loop or the model thread."""
    if image is None:
        raise RequestError("upload an image (or pick one of the examples) first")
    # Refused as sent, before any cleaning could hide it: the sender must learn their text is broken.
    text = clean_prompt(check_text(prompt, "the prompt") if isinstance(prompt, str) else prompt,
                        config.text.max_prompt_chars)
    picture = fit_image(load_image(image), config.height, config.width)
    return StartRequest(picture, text, parse_seed(seed))
