"""training/weight_average.py: the average a run keeps (--ema-decay) and exports."""

import pytest
import torch

from training.weight_average import WeightAverage, exported_weights


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))


def test_each_update_moves_the_average_one_minus_decay_of_the_way_to_the_weights():
    model = _model()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    average = WeightAverage.start(model, 0.75)
    for k in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(float(k + 1))
        average.update(model)
    # Weights after updates: start + 1, start + 3, start + 6; the average: 0.25 * (1 + ...) recursively.
    expected_offset = 0.0
    for total in (1.0, 3.0, 6.0):
        expected_offset = 0.75 * expected_offset + 0.25 * total
    for name, value in start.items():
        torch.testing.assert_close(average.weights[name], value + expected_offset)
    assert set(average.weights) == {n for n, _ in model.named_parameters()}  # no buffers


def test_a_resumed_run_continues_its_saved_average_and_a_new_one_starts_from_the_weights():
    model = _model()
    saved = {n: torch.full_like(p, 5.0) for n, p in model.named_parameters()}
    continued = WeightAverage.start(model, 0.9, saved)
    assert all(torch.equal(continued.weights[n], saved[n]) for n in saved)
    assert continued.weights["0.weight"] is not saved["0.weight"]  # a copy: updates leave the checkpoint alone
    fresh = WeightAverage.start(model, 0.9, {"other": torch.zeros(1)})  # not this model's: started anew
    assert all(torch.equal(fresh.weights[n], p) for n, p in model.named_parameters())
    with pytest.raises(ValueError, match="decay"):
        WeightAverage.start(model, 1.0)


def test_exported_weights_are_the_average_where_kept_and_the_buffers_from_the_model():
    model = _model()
    state = {"model": model.state_dict()}
    assert exported_weights(state)[0] == state["model"]
    average = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    weights, which = exported_weights({"model": model.state_dict(), "ema": average,
                                       "train_config": {"ema_decay": 0.5}})
    assert "average" in which and "decay 0.5" in which and weights.keys() == state["model"].keys()
    assert torch.equal(weights["0.weight"], torch.zeros(2, 3))
    assert torch.equal(weights["1.running_var"], model.state_dict()["1.running_var"])
    with pytest.raises(ValueError, match="does not"):
        exported_weights({"model": model.state_dict(), "ema": {"ghost": torch.zeros(1)}})
