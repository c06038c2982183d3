"""benchmarks/eval_world.py's bookkeeping: the per-key table reads the records it is given."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import eval_world  # noqa: E402


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
