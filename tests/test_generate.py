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
from lingbot_core.boundary.events import read_events_file
from lingbot_core.config import PUBLISHED_KEYS
from lingbot_core.generate import main
from lingbot_core.boundary.offline import controls_from_events, plan_trajectory, trajectory_controls
from lingbot_core.model import camera
from lingbot_core.blocks.pages import PageAllocator
from lingbot_core.blocks.pipeline import load_pipeline
from lingbot_core.boundary.video import count_frames
from tests.checkpoint_writer import (
    PUBLISHED_MODEL_INDEX_KEYS,
    PUBLISHED_TEXT_ENCODER_KEYS,
    PUBLISHED_VAE_KEYS,
    write_tiny_checkpoint,
)

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


@pytest.mark.slow  # a minute or more on 2 cores: .ci/run runs it, the fast suite does not
def test_subprocess_events_to_mp4_with_12n_minus_3_frames(checkpoint, image_file, tmp_path):
    """`python -m lingbot_core.generate --model FOLDER` on a checkpoint whose every config file carries the
    published key set (the transformer's with local_attn_size -1), as the real release does."""
    read = lambda name: json.loads((checkpoint / name).read_text())  # noqa: E731
    assert list(read("transformer/config.json")) == ["_class_name", *PUBLISHED_KEYS, "_diffusers_version"]
    assert read("transformer/config.json")["local_attn_size"] == -1
    assert set(read("model_index.json")) == set(PUBLISHED_MODEL_INDEX_KEYS)
    assert set(read("vae/config.json")) == set(PUBLISHED_VAE_KEYS)
    assert list(read("text_encoder/config.json")) == list(PUBLISHED_TEXT_ENCODER_KEYS)
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
    controls = controls_from_events(read_events_file(events, frames_per_block), pipe.config)
    assert sum(c.prompt is not None for c in controls) == 1
    pool = pipe.new_pool()
    pages = PageAllocator(pool.num_pages)
    state = pipe.start(image_file, PROMPT, seed=3)
    ticks = []
    for control in controls:
        if control.prompt is not None:
            state = pipe.with_prompt(state, control.prompt)
        output, state = pipe.step(pool, pages, state, control)
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


def test_trajectory_rounds_down_to_whole_blocks_and_says_what_it_dropped(checkpoint, image_file, tmp_path, capsys):
    poses, intrinsics = _trajectory(35)  # 35 frames -> 9 latent frames -> 3 whole blocks = 33 frames (upstream)
    np.save(tmp_path / "poses.npy", poses)
    np.save(tmp_path / "intrinsics.npy", intrinsics)
    out = tmp_path / "trajectory.mp4"
    assert main(_args(checkpoint, image_file, out, "--poses", str(tmp_path / "poses.npy"),
                      "--intrinsics", str(tmp_path / "intrinsics.npy"))) == 0
    assert count_frames(out) == (33, 16.0)
    assert "trajectory: 33 of its 35 frames used for 3 blocks, 2 dropped" in capsys.readouterr().out


def test_offline_trajectory_equals_tick_by_tick_and_is_normalised_once(checkpoint, image_file, tmp_path):
    """Streamed == one-shot for a trajectory: every block carries the whole trajectory's scale."""
    poses, intrinsics = _trajectory(61)
    poses[30:, :3, 3] = poses[30, :3, 3] + 10 * (poses[30:, :3, 3] - poses[30, :3, 3])  # slow, then ten times faster
    np.save(tmp_path / "poses.npy", poses)
    np.save(tmp_path / "intrinsics.npy", intrinsics)
    out, latents_out = tmp_path / "out.mp4", tmp_path / "latents.pt"
    assert main(_args(checkpoint, image_file, out, "--poses", str(tmp_path / "poses.npy"), "--intrinsics",
                      str(tmp_path / "intrinsics.npy"), "--blocks", "4", "--seed", "5",
                      "--latents-out", str(latents_out))) == 0
    offline = torch.load(latents_out)

    pipe = load_pipeline(str(checkpoint), dtype=torch.float32, height=CFG.height, width=CFG.width)
    plan = plan_trajectory(poses, intrinsics, pipe.config, 4)
    controls = trajectory_controls(plan)
    assert plan.frames_used == 45 and {c.translation_scale for c in controls} == {plan.translation_scale}
    pool = pipe.new_pool()
    pages = PageAllocator(pool.num_pages)
    state = pipe.start(image_file, PROMPT, seed=5, start_camera=camera.CameraState(poses[0]))
    ticks = []
    for control in controls:
        output, state = pipe.step(pool, pages, state, control)
        ticks.append(output.latents)
    assert torch.equal(offline, torch.cat(ticks, dim=2))
    # The slow blocks kept their slow motion: a per-block scale would have given each block a step of 1.
    steps = [np.linalg.norm(np.linalg.inv(a)[:3, :3] @ (b[:3, 3] - a[:3, 3]))
             for a, b in zip(np.concatenate([b.poses for b in plan.blocks])[:-1],
                             np.concatenate([b.poses for b in plan.blocks])[1:])]
    assert max(steps) == pytest.approx(plan.translation_scale) and min(steps) < plan.translation_scale / 5


def official_example_folder(folder: Path, image_file: Path, frames: int = 961) -> Path:
    """A folder in the official layout (examples/00/): image.jpg, prompt.txt, poses.npy [961,4,4] in real-world
    units (about 100 in all), intrinsics.npy [961,4], and the action files the v2 fast path does not read."""
    folder.mkdir(parents=True)
    Image.open(image_file).convert("RGB").save(folder / "image.jpg", quality=95)
    (folder / "prompt.txt").write_text("The video presents a slow walk along a stone bridge over a river.\n")
    t = np.arange(frames)
    poses = np.tile(np.eye(4), (frames, 1, 1))
    yaw = np.radians(20 * np.sin(t / 200))
    poses[:, 0, 0], poses[:, 0, 2], poses[:, 2, 0], poses[:, 2, 2] = np.cos(yaw), np.sin(yaw), -np.sin(yaw), np.cos(yaw)
    poses[:, :3, 3] = np.stack([30 * np.sin(t / 300), 0.5 * np.sin(t / 40), 0.1 * t], -1)  # ~100 units in all
    np.save(folder / "poses.npy", poses.astype(np.float32))
    np.save(folder / "intrinsics.npy", np.tile([502.1, 502.1, 416.0, 240.0], (frames, 1)).astype(np.float32))
    for name in ("action.npy", "wasd_action.npy", "ijkl_action.npy"):
        np.save(folder / name, np.zeros((frames, 4), dtype=np.int64))
    return folder


def test_an_official_example_folder_runs_unchanged(checkpoint, image_file, tmp_path, capsys):
    folder = official_example_folder(tmp_path / "examples" / "00", image_file)
    out = tmp_path / "example.mp4"
    assert main(["--model", str(checkpoint), "--action-path", str(folder), "--blocks", "2", "--out", str(out),
                 "--dtype", "fp32", *SIZE]) == 0
    assert count_frames(out) == (21, 16.0)
    printed = capsys.readouterr().out
    assert "trajectory: 21 of its 961 frames used for 2 blocks, 940 dropped" in printed
    # --image and --prompt still win over the folder's
    out2 = tmp_path / "example2.mp4"
    assert main(["--model", str(checkpoint), "--action-path", str(folder), "--blocks", "1", "--out", str(out2),
                 "--image", str(image_file), "--prompt", "another prompt", "--dtype", "fp32", *SIZE]) == 0
    assert count_frames(out2) == (9, 16.0)


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
    if case in ("folder without poses", "folder without image", "folder too short", "not a folder"):
        example = official_example_folder(folder / "ex", image_file, frames=8 if case == "folder too short" else 961)
        files = sorted(p for p in example.iterdir())
        if case == "folder without poses":
            (example / "poses.npy").unlink()
            files.remove(example / "poses.npy")
            return ["--action-path", str(example)], files, "lack poses.npy"
        if case == "folder without image":
            (example / "image.jpg").unlink()
            files.remove(example / "image.jpg")
            return ["--action-path", str(example)], files, "has no image.jpg; give --image"
        if case == "not a folder":
            return ["--action-path", str(example / "prompt.txt")], files, "is not a folder"
        return ["--action-path", str(example)], files, "the trajectory has 8 frames; one block needs 9"
    if case == "too many blocks":
        poses, intrinsics = folder / "poses.npy", folder / "intrinsics.npy"
        np.save(poses, np.tile(np.eye(4), (20, 1, 1)))
        np.save(intrinsics, np.tile([500.0, 500.0, 416.0, 240.0], (20, 1)))
        return (["--image", str(image_file), "--poses", str(poses), "--intrinsics", str(intrinsics), "--blocks", "2"],
                [poses, intrinsics], "2 blocks need 21 trajectory frames; the trajectory has 20")
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["missing image", "corrupt image", "malformed jsonl", "unknown key", "bad npy",
                                  "empty prompt", "folder without poses", "folder without image", "folder too short",
                                  "not a folder", "too many blocks"])
def test_bad_input_exits_2_naming_the_problem(case, checkpoint, image_file, tmp_path, capsys):
    extra, inputs, fragment = _bad_inputs(case, tmp_path, image_file)
    before = {path: path.read_bytes() for path in [*inputs, image_file]}
    out = tmp_path / "out.mp4"
    base = ["--model", str(checkpoint), "--out", str(out), "--dtype", "fp32", *SIZE]
    if "--action-path" not in extra and "--prompt" not in extra:
        base += ["--prompt", PROMPT]
    assert main(base + extra) == 2
    last_line = capsys.readouterr().err.strip().splitlines()[-1]  # after any loading progress bars
    assert last_line.startswith("error: ") and fragment in last_line
    assert {path: path.read_bytes() for path in before} == before  # inputs untouched
    assert not out.exists()  # no truncated video left behind


@pytest.mark.parametrize("extra, fragment", [
    (["--events", "e.jsonl", "--poses", "p.npy", "--intrinsics", "k.npy"], "exactly one of --events, --poses"),
    (["--events", "e.jsonl", "--action-path", "ex"], "exactly one of --events, --poses"),
    (["--poses", "p.npy", "--intrinsics", "k.npy", "--action-path", "ex"], "exactly one of --events, --poses"),
    (["--poses", "p.npy"], "--poses and --intrinsics go together"),
    (["--events", "e.jsonl", "--blocks", "3"], "--blocks needs --poses or --action-path"),
    (["--poses", "p.npy", "--intrinsics", "k.npy", "--blocks", "0"], "must be at least 1"),
])
def test_conflicting_options_are_refused_before_loading(extra, fragment, image_file, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--image", str(image_file), "--prompt", PROMPT, "--out", str(tmp_path / "out.mp4"), *extra])
    assert exit_info.value.code == 2
    assert fragment in capsys.readouterr().err
    assert not (tmp_path / "out.mp4").exists()
