"""benchmarks/action_check.py's bookkeeping: its per-block motion is eval_world's, and its verdict reads it."""

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import action_check  # noqa: E402
import eval_world  # noqa: E402


def test_block_motion_is_the_motion_eval_world_records_for_the_same_frames():
    from lingbot_core.config import PRESETS
    from lingbot_core.world import HELD_OUT_SEEDS, held_keys, key_path, make_world

    config = PRESETS["embedded"]
    world = make_world(HELD_OUT_SEEDS[0])
    script = action_check.held("w", 2)
    keys = script.keys_per_block
    path = key_path(held_keys(keys, config.transformer.num_frames_per_block), config)
    truth = eval_world.ground_truth(world, path, config, slice(0, config.pixel_frames_for_blocks(len(keys))))
    records = eval_world.Records()
    # The truth against itself: eval_world records (generated, true) per held block.
    records.add_motion(config, "model", script, truth, truth)
    expected = [g for block in (1, 2) for _, _, _, g, _ in records.motion[block]]
    measured = action_check.block_motion(config, truth, "w", 2)
    assert measured == expected
    assert all(value > eval_world.MIN_TRUE_MOTION_PX for value in measured)  # walking forward expands


def test_judge_counts_signs_and_ratios_over_blocks_whose_reference_moves():
    # Block 3's reference is under MIN_TRUE_MOTION_PX (a pitch at its limit): not measured.
    agree, measured, ratio = action_check.judge([2.0, -1.0, 4.0, 9.0], [4.0, 2.0, 4.0, 0.5])
    assert (agree, measured) == (2, 3) and ratio == 0.5
    assert action_check.judge([0.0], [3.0])[:2] == (0, 1)  # no motion has no sign
    assert math.isnan(action_check.judge([1.0], [0.2])[2])


def test_a_key_reads_as_its_motion_only_with_every_sign_right_and_enough_motion():
    assert action_check.cell(3, 3, 0.6) == ("3/3 x0.60 ok", True)
    assert action_check.cell(3, 3, 0.4) == ("3/3 x0.40 WEAK", False)
    assert action_check.cell(4, 4, 0.4999) == ("4/4 x0.49 WEAK", False)  # never shown as the threshold
    assert action_check.cell(2, 3, 0.9) == ("2/3 x0.90 NO", False)
    assert action_check.cell(0, 0, float("nan"))[1] is False
