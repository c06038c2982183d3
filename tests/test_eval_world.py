"""benchmarks/eval_world.py's bookkeeping: the per-key table reads the records it is given."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import eval_world  # noqa: E402


def test_per_key_table_gives_the_median_ratio_per_key_and_block_and_marks_wrong_directions(capsys):
    records = eval_world.Records()
    # key j held: block 1 in two worlds (ratios 0.5 and 1.0: median 0.75), block 2 moved against the
    # truth in one world; key w: block 1 too small a true motion to count.
    records.by_key[("model", "j", "j", 1)] += [(5.0, 10.0), (-10.0, -10.0)]
    records.by_key[("vae", "j", "j", 1)] += [(9.0, 10.0), (-9.0, -10.0)]
    records.by_key[("model", "j", "j", 2)] += [(-2.0, 10.0), (8.0, 10.0)]
    records.by_key[("model", "w", "w", 1)] += [(0.3, 0.5)]
    records.by_key[("model", "w", "w", 2)] += [(3.0, 2.0)]
    records.by_key[("model", "walk", "w", 1)] += [(1.0, 2.0)]  # the walk has no row
    eval_world.per_key_table(records)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and "block 1" in lines[0] and "block 2" in lines[0]
    j_row, w_row = lines[1].split(), lines[2].split()
    assert j_row[:3] == ["j", "j", "|"] and j_row[3:] == ["0.75(0.90)", "!0.50"]
    assert w_row[:3] == ["w", "w", "|"] and w_row[3:] == ["-", "1.50"]
