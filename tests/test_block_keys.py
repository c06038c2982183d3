"""Held keys and taps reduce into a block's key sets exactly as upstream's reducer does (fidelity audit 2, N3).

The oracle is the state mode of vLLM-Omni's `LingBotCameraControlReducer.prepare`
(vllm_omni/diffusion/models/lingbot_world/actions.py), transcribed: each transition is the full set of keys
held at that moment; the block holds the last one; the last non-empty one, if it differs, is the first
frame's pulse. The real checkpoint was trained with the clients of that reducer.
"""

from __future__ import annotations

import random

import pytest

from lingbot_core.boundary.events import block_keys

ORDER = ("w", "a", "s", "d", "i", "j", "k", "l")
F = 3


def upstream_reducer(held: tuple[str, ...], transitions: list[tuple[str, ...]]):
    pending = tuple(tuple(a for a in ORDER if a in t) for t in transitions)
    final_actions = pending[-1] if pending else held
    pulse = next((actions for actions in reversed(pending) if actions), None)
    if pulse is not None and pulse != final_actions:
        frames = (pulse,) + (final_actions,) * (F - 1)
    else:
        frames = (final_actions,) * F
    return frames, final_actions


def ours(held: str, transitions: list[str]):
    frames, after = block_keys(frozenset(held), [frozenset(t) for t in transitions], F)
    canon = lambda keys: tuple(a for a in ORDER if a in keys)  # noqa: E731
    return tuple(canon(f) for f in frames), canon(after)


CASES = [  # (held before, the states posted before the block, upstream's frames)
    ("w", ["wd", "w"], ("w", "w", "w")),  # W held + tap D: the tap is lost, as upstream
    ("", ["a", "", "d", ""], ("d", "", "")),  # tap A then tap D: the last tap is the pulse
    ("w", ["wd", "d"], ("d", "d", "d")),  # switch W -> D, pressing D first
    ("w", ["", "d"], ("d", "d", "d")),  # switch W -> D, releasing W first
    ("", ["j", "", "l"], ("l", "l", "l")),  # tap J then hold L: 18 degrees of yaw, not 12
    ("", ["w", ""], ("w", "", "")),  # a tap alone lasts one frame
    ("w", [], ("w", "w", "w")),  # held, no input
    ("w", [""], ("", "", "")),  # release
    ("", ["w", "wd"], ("wd", "wd", "wd")),  # add a key
]


@pytest.mark.parametrize("held, transitions, expected", CASES)
def test_the_cases_equal_upstreams_reducer(held, transitions, expected):
    canon = lambda keys: tuple(a for a in ORDER if a in keys)  # noqa: E731
    oracle = upstream_reducer(canon(held), [canon(t) for t in transitions])
    assert oracle[0] == tuple(canon(f) for f in expected)
    assert ours(held, transitions) == oracle


def test_random_sequences_equal_upstreams_reducer():
    rng = random.Random(0)
    held = ""
    for _ in range(2000):
        transitions = ["".join(k for k in ORDER if rng.random() < 0.2) for _ in range(rng.randrange(0, 5))]
        oracle = upstream_reducer(tuple(a for a in ORDER if a in held), [tuple(t) for t in transitions])
        got = ours(held, transitions)
        assert got == oracle
        held = "".join(got[1])
