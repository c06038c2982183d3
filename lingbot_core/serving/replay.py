"""A world's replay log: enough to regenerate its identical latents offline (image hash, seed, prompts and the key
sets, or the poses, each block applied), and the action script that replays it with `python -m lingbot_core.generate --events`."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field, replace
from typing import Any

@dataclass
class Replay:
    """Enough to regenerate the identical latents offline: image hash, seed, prompts and per-block keys.

    Each block records the key set of each latent frame it applied, the ids of the events it consumed
    and, when the text changed at that block, the new prompt.
    """

    model: str
    image_sha256: str
    seed: int
    prompt: str
    blocks: list[dict[str, Any]] = field(default_factory=list)
    dtype: str | None = None  # bit-identical latents need the same dtype (and device kind) offline

    def copy(self) -> "Replay":
        return replace(self, blocks=copy.deepcopy(self.blocks))

    def to_json(self) -> str:
        return json.dumps({"model": self.model, "dtype": self.dtype, "image_sha256": self.image_sha256,
                           "seed": self.seed, "prompt": self.prompt, "blocks": self.blocks}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Replay":
        raw = json.loads(text)
        return cls(model=raw["model"], image_sha256=raw["image_sha256"], seed=int(raw["seed"]),
                   prompt=raw["prompt"], blocks=list(raw["blocks"]), dtype=raw.get("dtype"))

    def to_events_jsonl(self) -> str:
        """The action script that `python -m lingbot_core.generate --events` replays block for block."""
        lines = []
        for index, block in enumerate(self.blocks):
            # a block driven by camera motion was recorded as its poses: a pose script replays it exactly
            event = {"event_id": index, **({"poses": block["poses"]} if "poses" in block else
                                           {"frames": block["frames"]})}
            if "prompt" in block:
                event["prompt"] = block["prompt"]
            lines.append(json.dumps(event))
        return "".join(line + "\n" for line in lines)
