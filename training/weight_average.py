"""An exponential moving average of a model's parameters, kept beside a training.world run and exported in
place of the last step's weights.

Why: a batch holds two clips, so each step's weights are a noisy point around where the run is heading; the
average over about the last 1 / (1 - decay) steps sits nearer the middle, and a rollout from it drifts less.
It is kept in fp32 in the run's checkpoint (key "ema"), so a resumed run continues the same average; a run that
turns it on part-way starts it from that step's weights, so it needs no bias correction.
"""

from __future__ import annotations

import torch

CHECKPOINT_KEY = "ema"


class WeightAverage:
    def __init__(self, decay: float, weights: dict[str, torch.Tensor]) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"an average's decay must be within (0, 1), got {decay}")
        self.decay = decay
        self.weights = weights

    @classmethod
    def start(cls, model: torch.nn.Module, decay: float, saved: dict[str, torch.Tensor] | None = None
              ) -> "WeightAverage":
        """Continue `saved` (a checkpoint's average) when it averages exactly this model's parameters, else
        start from the model's present weights."""
        parameters = dict(model.named_parameters())
        if saved is not None and saved.keys() == parameters.keys() and \
                all(saved[n].shape == p.shape for n, p in parameters.items()):
            return cls(decay, {n: t.detach().float().clone() for n, t in saved.items()})
        return cls(decay, {n: p.detach().float().clone() for n, p in parameters.items()})

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        """After an optimizer step: average <- decay * average + (1 - decay) * weights."""
        for name, parameter in model.named_parameters():
            self.weights[name].lerp_(parameter.detach().float(), 1.0 - self.decay)


def exported_weights(state: dict) -> tuple[dict[str, torch.Tensor], str]:
    """A checkpoint's weights to export, and which they are: its average where it holds one (buffers and any
    parameter it does not average come from the last step's weights), else the last step's."""
    weights = dict(state["model"])
    average = state.get(CHECKPOINT_KEY)
    if not average:
        return weights, "its last step's weights"
    unknown = sorted(set(average) - set(weights))
    if unknown:
        raise ValueError(f"the checkpoint's average holds weights the model does not: {unknown[:3]}")
    weights.update(average)
    return weights, f"the average of its weights (decay {state['train_config']['ema_decay']})"
