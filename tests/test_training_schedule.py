"""The learning-rate schedule of training.world and training.vae: constant, then a linear fall that ends at
lr * lr_final."""

import pytest

from training.world import WorldTrainConfig


def _config(**kwargs) -> WorldTrainConfig:
    return WorldTrainConfig(vae="v", clips_dir="c", stored_clips=1, lr=4e-4, **kwargs)


def test_the_rate_is_constant_without_a_decay_step():
    tc = _config()
    assert {tc.learning_rate(s, 100) for s in range(100)} == {4e-4}


def test_the_rate_falls_linearly_from_the_decay_step_to_the_final_share():
    tc = _config(lr_decay_from=60, lr_final=0.1)
    rates = [tc.learning_rate(s, 100) for s in range(101)]
    assert rates[:61] == [4e-4] * 61
    assert rates[80] == pytest.approx(4e-4 * 0.55)
    assert rates[100] == pytest.approx(4e-5)
    assert all(a >= b for a, b in zip(rates, rates[1:]))


def test_a_final_share_outside_the_unit_interval_is_refused():
    with pytest.raises(ValueError, match="lr_final"):
        _config(lr_final=0.0)


def test_the_vae_run_has_the_same_schedule_and_keeps_a_constant_rate_by_default():
    from training.vae import VaeTrainConfig
    assert {VaeTrainConfig(lr=2e-4).learning_rate(s, 50) for s in range(51)} == {2e-4}
    world, vae = _config(lr_decay_from=10, lr_final=0.2), VaeTrainConfig(lr=4e-4, lr_decay_from=10, lr_final=0.2)
    assert [vae.learning_rate(s, 40) for s in range(41)] == [world.learning_rate(s, 40) for s in range(41)]
    with pytest.raises(ValueError, match="lr_final"):
        VaeTrainConfig(lr_final=1.5)
