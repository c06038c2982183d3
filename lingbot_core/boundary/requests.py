"""A world's start, parsed once at the boundary: the picture fitted to the frame, the prompt cleaned, the seed exact.

Every caller that takes a start from outside (the app's stream and Reset, the offline command, a script
calling `Pipeline.rollout` with an image and a prompt) turns it into a `StartRequest` here; the engine,
the session and the pipeline trust it and check nothing again. Bad input raises a ValueError subclass
(ImageError, PromptError, RequestError) whose message names the problem.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image

from lingbot_core.boundary.image import fit_image, load_image
from lingbot_core.boundary.prompt import clean_prompt
from lingbot_core.boundary.user_text import check_text, quote

MAX_SEED = 2**63 - 1


class RequestError(ValueError):
    """A start that cannot be used; the message says why."""


@dataclass(frozen=True)
class StartRequest:
    picture: Image.Image  # RGB, exactly the model's width x height (decoded once, fitted once)
    prompt: str  # cleaned once, as the official tokenizer path cleans it (clean_prompt); the tokenizer takes it as is
    seed: int  # 0 <= seed <= MAX_SEED


@dataclass(frozen=True)
class BlockControl:
    """What drives one block's camera: per-latent-frame key sets, or explicit poses (trajectory files)."""

    actions: tuple[frozenset[str], ...] | None = None
    poses: np.ndarray | None = None  # [F, 4, 4] camera-to-world
    intrinsics: np.ndarray | None = None  # [F, 4] fx, fy, cx, cy in the reference frame
    # With poses from a trajectory file: the largest step of the whole trajectory, so every block is
    # normalised alike (camera.plan_trajectory). None: per-block normalisation, as for key input.
    translation_scale: float | None = None
    prompt: str | None = None  # a new text from this block on (the caller re-encodes it)


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
