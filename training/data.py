"""Training clips: rendered videos of train-range worlds with the key actions, poses and intrinsics behind them.

    python -m training.data --out out/clips --clips 64 [--blocks 4] [--data-seed 0] [--start 0]
                            [--size 128x224] [--supersample 2] [--workers 2] [--hold 0.0] [--start-pitch 0]
                            [--first-keys KEYS]

Clip i of a data seed is a pure function of (data_seed, i) and the script settings: its world seed
(drawn from TRAIN_SEEDS only), its key script and so its pixels. A dataset is therefore reproducible
from its seed and resumable from any index (`--start`), and two workers never need to coordinate.

A key script mirrors the app: block 0 carries no key (keys act from the next block on), every
later block holds a key set (none, one key, or two keys that do not cancel), and some blocks press
it for only part of the block. With `--hold P` each block from block 2 on repeats the previous
block's keys, for the whole block, with probability P: the long holds of real play. With
`--start-pitch D` the clip starts pitched by a whole number of pitch steps within +-D degrees (the
pitch a session reaches after holding I or K; a level start is all a session begins with, so without
these clips a view 40 degrees up is one the model has never seen). With `--first-keys ikad` block 1
presses one of those keys (with `--hold 1.0`, held to the end of the clip). Poses come from the camera module's
integrator (`key_path`, from the clip's start state), so the Plücker maps computed from `frame_actions`
and the start pose in training are exactly the demo's.

The command writes one `clip_<i>.npz` per clip: `video` uint8 [T, H, W, 3] (T = 12N - 3 pixel frames),
`actions` uint8 [L, 8] (one row per latent frame, columns in KEY_ORDER), `latent_poses` [L, 4, 4]
(pixel poses follow with `world.pixel_poses`), `intrinsics` [4] (fx, fy, cx, cy in pixels), `world_seed`.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from typing import NamedTuple, Sequence

import numpy as np
import torch
from tqdm import tqdm

from lingbot_core.config import PRESETS, CameraConfig, ModelConfig
from lingbot_core.model import camera
from lingbot_core.world import TRAIN_SEEDS, key_path, make_world, render

KEY_ORDER = "wasdijkl"
_OPPOSITE = {"w": "s", "s": "w", "a": "d", "d": "a", "i": "k", "k": "i", "j": "l", "l": "j"}
# How often each key is chosen; forward walking and turning dominate play, pitch is rarer (and
# balanced, so the view does not drift to the sky).
_KEY_WEIGHTS = {"w": 0.24, "s": 0.08, "a": 0.08, "d": 0.08, "i": 0.06, "k": 0.06, "j": 0.2, "l": 0.2}


@dataclasses.dataclass(frozen=True)
class ScriptConfig:
    """Probabilities of the key script sampler."""

    still: float = 0.12  # a block without keys
    pair: float = 0.3  # a block with two keys (otherwise one)
    partial: float = 0.25  # the block's keys are pressed for a contiguous part of it only
    # A block from block 2 on repeats the previous block's key set, pressed for the whole block: long
    # holds, as players hold W or J for seconds (and as the evaluation holds a key for 8 blocks), which
    # independent blocks almost never show. At 0 no draw is made, so scripts sampled before this
    # setting existed are unchanged.
    hold: float = 0.0
    # The clip starts pitched by a whole number of pitch steps drawn uniformly within +-start_pitch
    # degrees (and within the pitch limit): the views of a session that has held I or K for blocks,
    # which a level start reaches only after long pitch holds. At 0 no draw is made (a level start).
    start_pitch: float = 0.0
    # Block 1 presses a key drawn from these keys only (equally likely; a second key of a pair is drawn
    # as usual), never no key: with hold 1.0, clips that hold a pitch or a sideways step for the whole
    # clip, which the default weights make rare (I, K, A and D are 28% of first keys). Empty:
    # no change, and no draw changes, so scripts sampled before this setting existed are unchanged.
    first_keys: str = ""

    def __post_init__(self) -> None:
        if not 0.0 <= self.hold <= 1.0:
            raise ValueError(f"hold is a probability; got {self.hold}")
        unknown = sorted(set(self.first_keys) - set(KEY_ORDER))
        if unknown or len(set(self.first_keys)) != len(self.first_keys):
            raise ValueError(f"first_keys must be distinct keys of {KEY_ORDER!r}; got {self.first_keys!r}")
        if not 0.0 <= self.start_pitch <= 90.0:
            raise ValueError(f"start_pitch is an angle in degrees within [0, 90]; got {self.start_pitch}")


class Clip(NamedTuple):
    world_seed: int
    frame_actions: tuple[frozenset[str], ...]  # one key set per latent frame
    video: torch.Tensor  # [3, T, H, W] float32 in [-1, 1], the VAE's input layout
    latent_poses: np.ndarray  # [L, 4, 4]
    pixel_poses: np.ndarray  # [T, 4, 4]
    intrinsics: np.ndarray  # [4] in pixels of the frame


def sample_script(rng: np.random.Generator, num_blocks: int, frames_per_block: int,
                  cfg: ScriptConfig = ScriptConfig()) -> tuple[frozenset[str], ...]:
    """Per-latent-frame key sets for `num_blocks` blocks; block 0 is always still."""
    keys, weights = list(_KEY_WEIGHTS), np.array(list(_KEY_WEIGHTS.values()))
    frames: list[frozenset[str]] = [frozenset()] * frames_per_block
    previous: frozenset[str] = frozenset()
    for index in range(1, num_blocks):
        if cfg.hold > 0.0 and index >= 2 and rng.random() < cfg.hold:
            frames.extend([previous] * frames_per_block)
            continue
        held: set[str] = set()
        first = None
        if index == 1 and cfg.first_keys:
            first = cfg.first_keys[rng.integers(len(cfg.first_keys))]
        elif rng.random() >= cfg.still:
            first = keys[rng.choice(len(keys), p=weights / weights.sum())]
        if first is not None:
            held.add(first)
            if rng.random() < cfg.pair:
                allowed = [k != first and k != _OPPOSITE[first] for k in keys]
                p = weights * allowed
                held.add(keys[rng.choice(len(keys), p=p / p.sum())])
        block = [frozenset(held)] * frames_per_block
        if held and rng.random() < cfg.partial:
            start = int(rng.integers(frames_per_block))
            stop = int(rng.integers(start + 1, frames_per_block + 1))
            block = [frozenset(held) if start <= f < stop else frozenset() for f in range(frames_per_block)]
        previous = frozenset(held)
        frames.extend(block)
    return tuple(frames)


def sample_start(rng: np.random.Generator, cfg: CameraConfig, script: ScriptConfig = ScriptConfig()
                 ) -> camera.CameraState:
    """The clip's start state: level, or (with script.start_pitch) pitched by k pitch steps, k uniform
    over the whole steps within +-start_pitch and the pitch limit, exactly a state that a session
    reaches by holding I or K from its level start."""
    if script.start_pitch <= 0.0:
        return camera.CameraState.initial()
    steps = int(min(script.start_pitch, cfg.pitch_limit_deg) // cfg.pitch_step_deg)
    pitch = cfg.pitch_step_deg * int(rng.integers(-steps, steps + 1))
    return pitched_state(pitch)


def pitched_state(pitch_deg: float) -> camera.CameraState:
    """The start pose pitched by `pitch_deg` (positive: up), with that pitch tracked for the limit."""
    pose = np.eye(4)
    pose[:3, :3] = camera.rotation_x(pitch_deg)
    return camera.CameraState(pose, pitch_deg)


def start_state(start_pose: np.ndarray) -> camera.CameraState:
    """The camera state a clip starts from, given its first latent pose (block 0 holds no key, so that
    pose is the start). The tracked pitch is the forward axis's elevation: a yaw leaves it unchanged."""
    pose = np.asarray(start_pose, dtype=np.float64)
    forward_y = float(np.clip(pose[1, 2], -1.0, 1.0))  # forward (0, -sin a, cos a) for pitch a: +y is down
    return camera.CameraState(pose, round(float(np.degrees(np.arcsin(-forward_y))), 6) + 0.0)  # no -0.0


def clip_rng(data_seed: int, index: int) -> np.random.Generator:
    return np.random.default_rng([int(data_seed), int(index)])


def make_clip(data_seed: int, index: int, config: ModelConfig, num_blocks: int, supersample: int = 2,
              script: ScriptConfig = ScriptConfig(), world_seeds: range = TRAIN_SEEDS) -> Clip:
    """Clip `index` of `data_seed`: a world from `world_seeds` (train worlds unless evaluating on
    HELD_OUT_SEEDS), a key script, and its rendered pixel frames."""
    if num_blocks < 1:
        raise ValueError(f"a clip needs at least one block; got {num_blocks}")
    rng = clip_rng(data_seed, index)
    world_seed = int(world_seeds.start + rng.integers(len(world_seeds)))
    actions = sample_script(rng, num_blocks, config.transformer.num_frames_per_block, script)
    start = sample_start(rng, config.camera, script)  # drawn after the script: level clips are unchanged
    path = key_path(actions, config, start)
    rgb = render(make_world(world_seed), path.pixel_poses, path.intrinsics, config.width, config.height, supersample)
    video = (rgb * 2.0 - 1.0).permute(1, 0, 2, 3).contiguous()  # [3, T, H, W] in [-1, 1]
    return Clip(world_seed, path.frame_actions, video, path.latent_poses, path.pixel_poses, path.intrinsics)


def actions_to_array(frame_actions: Sequence[frozenset[str]]) -> np.ndarray:
    """[L, 8] uint8, one column per key of KEY_ORDER."""
    return np.array([[key in keys for key in KEY_ORDER] for keys in frame_actions], dtype=np.uint8)


def array_to_actions(array: np.ndarray) -> tuple[frozenset[str], ...]:
    return tuple(frozenset(k for k, on in zip(KEY_ORDER, row) if on) for row in np.asarray(array))


# A clip seen in a mirror (its frames flipped left to right) is the clip of the mirrored world under the
# mirrored keys: turning and strafing change sides, walking and pitch do not. The frame's principal point
# is its centre, so the flip maps the pixel grid onto itself.
_MIRRORED_KEY = {"a": "d", "d": "a", "j": "l", "l": "j"}
MIRROR_COLUMNS = [KEY_ORDER.index(_MIRRORED_KEY.get(k, k)) for k in KEY_ORDER]


def mirror_actions(array: np.ndarray) -> np.ndarray:
    """[L, 8] key array of a clip -> the key array of its mirror image (A<->D, J<->L)."""
    return np.asarray(array)[..., MIRROR_COLUMNS]


def mirror_poses(poses: torch.Tensor) -> torch.Tensor:
    """Camera-to-world poses [..., 4, 4] of a clip -> those of its mirror image: the world seen through
    x -> -x, so P becomes M P M with M = diag(-1, 1, 1, 1)."""
    m = torch.diag(torch.tensor([-1.0, 1.0, 1.0, 1.0], dtype=poses.dtype))
    return m @ poses @ m


class ClipDataset(torch.utils.data.Dataset):
    """Map-style dataset of clips `start .. start + length - 1` of `data_seed`, rendered on demand."""

    def __init__(self, config: ModelConfig, num_blocks: int, length: int, data_seed: int = 0, start: int = 0,
                 supersample: int = 2, script: ScriptConfig = ScriptConfig()) -> None:
        self.config, self.num_blocks, self.length = config, num_blocks, length
        self.data_seed, self.start, self.supersample, self.script = data_seed, start, supersample, script

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < self.length:
            raise IndexError(index)
        clip = make_clip(self.data_seed, self.start + index, self.config, self.num_blocks, self.supersample,
                         self.script)
        return {"video": clip.video, "actions": torch.from_numpy(actions_to_array(clip.frame_actions)),
                "latent_poses": torch.from_numpy(clip.latent_poses), "intrinsics": torch.from_numpy(clip.intrinsics),
                "world_seed": clip.world_seed}


def _one_thread(_: int) -> None:
    # Two processes of one thread each use 2 cores better than one process of two (no libgomp teams
    # competing); see benchmarks/bench_render.py.
    torch.set_num_threads(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="out/clips")
    parser.add_argument("--clips", type=int, required=True)
    parser.add_argument("--start", type=int, default=0, help="first clip index (resume from here)")
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--data-seed", type=int, default=0)
    parser.add_argument("--size", help="HEIGHTxWIDTH (default: the embedded preset's)")
    parser.add_argument("--supersample", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--hold", type=float, default=0.0,
                        help="probability that a block (from block 2 on) holds the previous block's keys")
    parser.add_argument("--start-pitch", type=float, default=0.0, metavar="DEGREES",
                        help="start each clip pitched by whole pitch steps drawn within +-DEGREES (0: level)")
    parser.add_argument("--first-keys", default="", metavar="KEYS",
                        help="block 1 presses one of these keys (equally likely), e.g. ikad (default: any key or none)")
    args = parser.parse_args()
    try:
        script = ScriptConfig(hold=args.hold, start_pitch=args.start_pitch, first_keys=args.first_keys)
    except ValueError as error:
        parser.error(f"--{error}")

    config = PRESETS["embedded"]
    if args.size:
        height, width = (int(v) for v in args.size.lower().split("x"))
        config = dataclasses.replace(config, height=height, width=width)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dataset = ClipDataset(config, args.blocks, args.clips, args.data_seed, args.start, args.supersample, script)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=args.workers,
                                         worker_init_fn=_one_thread if args.workers else None)
    if not args.workers:
        _one_thread(0)
    started, frames = time.perf_counter(), 0
    for offset, item in enumerate(tqdm(loader, total=len(dataset), unit="clip")):
        video = ((item["video"].permute(1, 2, 3, 0) + 1.0) * 127.5).round().clamp(0, 255).to(torch.uint8).numpy()
        frames += len(video)
        index = args.start + offset
        target = out / f"clip_{index:07d}.npz"
        partial = target.with_suffix(".tmp.npz")  # written whole, then renamed: an interrupted run leaves no half file
        np.savez(partial, video=video, actions=item["actions"].numpy(), latent_poses=item["latent_poses"].numpy(),
                 intrinsics=item["intrinsics"].numpy(), world_seed=np.int64(item["world_seed"]))
        partial.rename(target)
    seconds = time.perf_counter() - started
    print(f"{len(dataset)} clips, {frames} frames {config.width}x{config.height} in {seconds:.1f} s "
          f"({frames / seconds:.1f} FPS, {args.workers} workers) -> {out}")


if __name__ == "__main__":
    main()


class StoredClips:
    """The clips a `python -m training.data` run wrote to a folder, held in memory (uint8).

    `count` clips, indices 0 .. count - 1, are required to exist: a training run names exactly the
    data it was trained on, so resuming it later reads the same clips.
    """

    def __init__(self, folder: str | Path, count: int) -> None:
        self.folder = Path(folder).expanduser()
        paths = [self.folder / f"clip_{i:07d}.npz" for i in range(count)]
        missing = [p.name for p in paths if not p.exists()]
        if missing:
            raise ValueError(f"{self.folder}: {len(missing)} of {count} clips missing (first {missing[0]}); render "
                             f"them with python -m training.data --out {self.folder} --clips {count}")
        self.items = []
        for path in paths:
            with np.load(path) as data:
                self.items.append({k: data[k] for k in ("video", "actions", "latent_poses", "intrinsics",
                                                          "world_seed")})

    def __len__(self) -> int:
        return len(self.items)

    def video(self, index: int, start: int = 0, frames: int | None = None) -> torch.Tensor:
        """Pixel frames start .. start + frames - 1 of clip `index`: [3, T, H, W] float32 in [-1, 1]."""
        video = self.items[index]["video"]
        stop = len(video) if frames is None else start + frames
        if not 0 <= start < stop <= len(video):
            raise ValueError(f"frames {start}..{stop} outside clip {index} of {len(video)} frames")
        return torch.from_numpy(video[start:stop]).permute(3, 0, 1, 2).float() / 127.5 - 1.0
