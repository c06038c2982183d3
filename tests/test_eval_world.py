"""benchmarks/eval_world.py's bookkeeping: the per-key table reads the records it is given."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import eval_world  # noqa: E402
import torch  # noqa: E402


def test_per_key_table_gives_the_median_ratio_per_key_and_block_and_marks_wrong_directions(capsys):
    records = eval_world.Records()
    # key j held: block 1 in two worlds (ratios 0.5 and 1.0: median 0.75), block 2 moved against the
    # truth in one world; key w: block 1 too small a true motion to count; the walk has no row.
    records.motion[1] += [("model", "j", "j", 5.0, 10.0), ("model", "j", "j", -10.0, -10.0),
                          ("vae", "j", "j", 9.0, 10.0), ("vae", "j", "j", -9.0, -10.0),
                          ("model", "w", "w", 0.3, 0.5), ("model", "walk", "w", 1.0, 2.0)]
    records.motion[2] += [("model", "j", "j", -2.0, 10.0), ("model", "j", "j", 8.0, 10.0),
                          ("model", "w", "w", 3.0, 2.0)]
    records.motion[9] += [("model", "walk", "w", 1.0, 2.0)]  # no column for blocks only the walk reaches
    # the summary's rows: (kind, generated, true), the walk's included
    assert records.following("model", [1]) == [("shift_x", 5.0, 10.0), ("shift_x", -10.0, -10.0),
                                               ("expansion", 0.3, 0.5), ("expansion", 1.0, 2.0)]
    assert len(records.following("model")) == 8 and len(records.following("vae")) == 2
    eval_world.per_key_table(records)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and "block 1" in lines[0] and "block 2" in lines[0]
    j_row, w_row = lines[1].split(), lines[2].split()
    assert j_row[:3] == ["j", "j", "|"] and j_row[3:] == ["0.75(0.90)", "!0.50"]
    assert w_row[:3] == ["w", "w", "|"] and w_row[3:] == ["-", "1.50"]


def test_collapse_lines_give_each_walks_ratios_beside_the_truths():
    records = eval_world.Records()
    for seed, ratios in ((7, (1.33, 0.9, 1.1, 1.76, 0.82, 1.16)), (8, (0.95, 1.0, 0.81, 1.08, 0.91, 0.99))):
        for index, name in enumerate(("mean", "contrast", "high_frequency")):
            records.collapse.append((seed, name, ratios[index], ratios[3 + index]))
    lines = eval_world.collapse_lines(records, 16)
    assert lines == [
        "Walk of world 7, block 16 against block 4, the model (the truth): "
        "mean x1.33 (x1.76), contrast x0.90 (x0.82), high_frequency x1.10 (x1.16)",
        "Walk of world 8, block 16 against block 4, the model (the truth): "
        "mean x0.95 (x1.08), contrast x1.00 (x0.91), high_frequency x0.81 (x0.99)"]


def test_the_truth_of_one_block_is_those_frames_of_the_whole_clips_truth():
    """The collapse check renders only the blocks it compares; they must be the frames the whole clip has."""
    from lingbot_core.config import PRESETS
    from lingbot_core.world import HELD_OUT_SEEDS, held_keys, key_path, make_world

    config = PRESETS["embedded"]
    world = make_world(HELD_OUT_SEEDS[0])
    keys = ("", "w", "j")
    path = key_path(held_keys(keys, config.transformer.num_frames_per_block), config)
    whole = eval_world.ground_truth(world, path, config, slice(0, config.pixel_frames_for_blocks(len(keys))))
    for block in (0, 2):
        part = eval_world.block_frames(config, block)
        alone = eval_world.ground_truth(world, path, config, part)
        assert alone.shape[0] == (9 if block == 0 else 12)
        assert torch.equal(alone, whole[part])
