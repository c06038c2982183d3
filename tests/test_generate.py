"""The offline command on a tiny checkpoint folder: frame counts, offline == tick-by-tick, refused inputs.

`main([...])` runs in-process (one model load per call, a few seconds); one test runs the real
`python -m lingbot_core.generate` in a subprocess.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from lingbot_core.config import tiny_config
from lingbot_core.events import read_events_file
from lingbot_core.generate import controls_from_events, main
from lingbot_core.pipeline import load_pipeline
from lingbot_core.video import count_frames
from tests.checkpoint_writer import write_tiny_checkpoint

pytestmark = pytest.mark.usefixtures("single_thread")

CFG = tiny_config()
SIZE = ["--height", str(CFG.height), "--width", str(CFG.width)]
REPO_ROOT = Path(__file__).resolve().parents[1]
PROMPT = "a stone bridge over a river"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("generate") / "tiny-ckpt"
    write_tiny_checkpoint(path, CFG, shards=2, seed=0)
    return path


@pytest.fixture(scope="module")
def image_file(tmp_path_factory, start_image) -> Path:
    path = tmp_path_factory.mktemp("image") / "start.png"
    Image.fromarray(np.array(start_image)).save(path)
    return path


def _write_events(path: Path, events: list[dict]) -> Path:
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    return path


def _script(num_events: int) -> list[dict]:
    """Script events, a held-key event and a prompt switch among them."""
    keys = [["w"], ["w", "j"], [], ["d"], ["i"], ["s", "l"]]
    events = [{"event_id": 2 * i, "frames": [keys[i % 6], keys[(i + 1) % 6], keys[(i + 2) % 6]]}
              for i in range(num_events)]
    if num_events > 2:
        events[1] = {"event_id": 2, "keys": ["a", "k"]}
        events[2]["prompt"] = "the same bridge in heavy snow"
    return events


def _args(checkpoint: Path, image: Path, out: Path, *extra: str) -> list[str]:
    return ["--model", str(checkpoint), "--image", str(image), "--prompt", PROMPT, "--out", str(out),
            "--dtype", "fp32", *SIZE, *extra]


def _trajectory(num_frames: int) -> tuple[np.ndarray, np.ndarray]:
    """A camera that walks forward while turning: [F, 4, 4] camera-to-world and [F, 4] intrinsics."""
    poses = np.tile(np.eye(4), (num_frames, 1, 1))
    for i in range(num_frames):
        yaw = math.radians(0.5 * i)
        poses[i, :3, :3] = [[math.cos(yaw), 0, math.sin(yaw)], [0, 1, 0], [-math.sin(yaw), 0, math.cos(yaw)]]
        poses[i, :3, 3] = [0.01 * math.sin(0.1 * i), 0.0, 0.02 * i]
    intrinsics = np.tile([500.0, 500.0, 416.0, 240.0], (num_frames, 1))
    return poses, intrinsics


# ---- the good paths -----------------------------------------------------------------------------


def test_subprocess_events_to_mp4_with_12n_minus_3_frames(checkpoint, image_file, tmp_path):
    events = _write_events(tmp_path / "script.jsonl", _script(4))
    out = tmp_path / "out.mp4"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
    done = subprocess.run([sys.executable, "-m", "lingbot_core.generate", *_args(checkpoint, image_file, out),
                           "--events", str(events)], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert count_frames(out) == (12 * 4 - 3, 16.0)
    assert f"4 blocks, {12 * 4 - 3} frames at 16 FPS" in done.stdout


def test_offline_latents_equal_tick_by_tick_rollout(checkpoint, image_file, tmp_path):
    events = _write_events(tmp_path / "script.jsonl", _script(4))
    out, latents_out = tmp_path / "out.mp4", tmp_path / "latents.pt"
    assert main(_args(checkpoint, image_file, out, "--events", str(events), "--seed", "3",
                      "--latents-out", str(latents_out))) == 0
    assert count_frames(out) == (45, 16.0)
    offline = torch.load(latents_out)

    pipe = load_pipeline(str(checkpoint), dtype=torch.float32, height=CFG.height, width=CFG.width)
    frames_per_block = pipe.config.transformer.num_frames_per_block
    controls = controls_from_events(read_events_file(events, frames_per_block), frames_per_block)
    assert sum(c.prompt is not None for c in controls) == 1
    pool = pipe.new_pool()
    state = pipe.start(image_file, PROMPT, seed=3)
    ticks = []
    for control in controls:
        if control.prompt is not None:
            state = pipe.with_prompt(state, control.prompt)
        output, state = pipe.step(pool, state, control)
        ticks.append(output.latents)
    expected = torch.cat(ticks, dim=2)  # [1, z, 4 * 3, h, w]
    assert offline.shape == (1, CFG.transformer.out_channels, 12, CFG.latent_height, CFG.latent_width)
    assert torch.equal(offline, expected)


def test_more_than_ten_events(checkpoint, image_file, tmp_path):
    events = _write_events(tmp_path / "long.jsonl", _script(12))
    out = tmp_path / "long.mp4"
    assert main(_args(checkpoint, image_file, out, "--events", str(events))) == 0
    assert count_frames(out) == (12 * 12 - 3, 16.0)


def test_129_frame_trajectory_gives_129_frames(checkpoint, image_file, tmp_path):
    poses, intrinsics = _trajectory(129)
    np.save(tmp_path / "poses.npy", poses)
    np.save(tmp_path / "intrinsics.npy", intrinsics)
    out = tmp_path / "trajectory.mp4"
    assert main(_args(checkpoint, image_file, out, "--poses", str(tmp_path / "poses.npy"),
                      "--intrinsics", str(tmp_path / "intrinsics.npy"))) == 0
    # 129 video frames -> 33 latent frames -> 11 blocks -> 12 * 11 - 3 = 129 frames: no cap, nothing lost.
    assert count_frames(out) == (129, 16.0)


# ---- refused inputs -------------------------------------------------------------------------------


def _bad_inputs(case: str, folder: Path, image_file: Path) -> tuple[list[str], list[Path], str]:
    """Arguments for one bad-input case, the input files it uses, and a fragment the error must contain."""
    good_events = _write_events(folder / "good.jsonl", _script(1))
    if case == "missing image":
        return ["--image", str(folder / "absent.png"), "--events", str(good_events)], [good_events], "no image file"
    if case == "corrupt image":
        corrupt = folder / "corrupt.png"
        corrupt.write_bytes(image_file.read_bytes()[:60])
        return ["--image", str(corrupt), "--events", str(good_events)], [corrupt, good_events], "not a readable image"
    if case == "malformed jsonl":
        events = folder / "bad.jsonl"
        events.write_text('{"event_id": 0, "frames": [["w"], [], []]}\n{"event_id": 1, "frames": [["w"]\n')
        return ["--image", str(image_file), "--events", str(events)], [events], "line 2: not valid JSON"
    if case == "unknown key":
        events = _write_events(folder / "bad.jsonl", [{"event_id": 0, "frames": [["w"], ["x"], []]}])
        return ["--image", str(image_file), "--events", str(events)], [events], "unknown key 'x'"
    if case == "bad npy":
        poses, intrinsics = folder / "poses.npy", folder / "intrinsics.npy"
        np.save(poses, np.tile(np.eye(4), (8, 1, 1)))
        poses.write_bytes(poses.read_bytes()[:-16])  # truncated: the size no longer matches the header
        np.save(intrinsics, np.tile([500.0, 500.0, 416.0, 240.0], (8, 1)))
        return (["--image", str(image_file), "--poses", str(poses), "--intrinsics", str(intrinsics)],
                [poses, intrinsics], "does not match its header")
    if case == "empty prompt":
        return ["--image", str(image_file), "--events", str(good_events), "--prompt", "  "], [good_events], "prompt"
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["missing image", "corrupt image", "malformed jsonl", "unknown key", "bad npy",
                                  "empty prompt"])
def test_bad_input_exits_2_naming_the_problem(case, checkpoint, image_file, tmp_path, capsys):
    extra, inputs, fragment = _bad_inputs(case, tmp_path, image_file)
    before = {path: path.read_bytes() for path in [*inputs, image_file]}
    out = tmp_path / "out.mp4"
    base = ["--model", str(checkpoint), "--prompt", PROMPT, "--out", str(out), "--dtype", "fp32", *SIZE]
    assert main(base + extra) == 2
    last_line = capsys.readouterr().err.strip().splitlines()[-1]  # after any loading progress bars
    assert last_line.startswith("error: ") and fragment in last_line
    assert {path: path.read_bytes() for path in before} == before  # inputs untouched
    assert not out.exists()  # no truncated video left behind


@pytest.mark.parametrize("extra, fragment", [
    (["--events", "e.jsonl", "--poses", "p.npy", "--intrinsics", "k.npy"], "exactly one of --events or --poses"),
    (["--poses", "p.npy"], "--poses and --intrinsics go together"),
    (["--events", "e.jsonl", "--blocks", "3"], "--blocks needs --poses"),
    (["--poses", "p.npy", "--intrinsics", "k.npy", "--blocks", "0"], "must be at least 1"),
])
def test_conflicting_options_are_refused_before_loading(extra, fragment, image_file, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--image", str(image_file), "--prompt", PROMPT, "--out", str(tmp_path / "out.mp4"), *extra])
    assert exit_info.value.code == 2
    assert fragment in capsys.readouterr().err
    assert not (tmp_path / "out.mp4").exists()
