"""How good the embedded world model is: rollouts on held-out worlds against the renderer's ground truth.

    python benchmarks/eval_world.py [--model embedded] [--seeds 2] [--blocks 8] [--walk-blocks 64] [--pairs 4]
                                    [--baseline-worlds 1] [--dtype fp32] [--random-weights] [--quick] [--per-key]

For the first `--seeds` held-out worlds (HELD_OUT_SEEDS; the model never trained on them), each
script is rolled out from the world's start picture (its render at the start pose, exactly the app's
example) and compared, block by block, with the renderer's frames along the same camera path
(`key_path` of the same per-latent-frame keys, pixel poses; block 0 is pixel frames 0..8, block b >= 1
pixel frames 12b-3 .. 12b+8). Scripts, as in the app block 0 holds no key:
- each key held alone for `--blocks` blocks (w a s d i j k l), a few pairs likewise (PAIRS);
- a mixed walk (WALK repeated) of `--walk-blocks` blocks, compared with the ground truth over its first
  16 blocks (the issue's 16-block walk) and checked for collapse at its last block.

Measured (lingbot_core/world/metrics.py holds every estimator):
- fidelity per block index: PSNR and SSIM of the decoded frames against the ground truth, beside two
  baselines: the start picture repeated, and the same architecture with random weights (the preset
  built from its seed, `random_weights_pipeline`; on the first `--baseline-worlds` worlds only: it costs
  as much as the model and barely varies). Target: model >= repeat + 4 dB, averaged over blocks 1-8.
- action following: for every block b >= 1 and every key it holds, the key's motion (turn: the whole
  frame's translation in x, phase correlation refined by least squares; pitch: in y; walk: expansion of
  the halves; step: lateral shift of the lower half; metrics.py says why the refinement) summed over
  the block's consecutive frame pairs (pixel frames 12b-4 -> 12b+8), on the generated frames and on the
  ground truth alike. Blocks whose true motion is under MIN_TRUE_MOTION_PX (a pitch
  held at its limit) are left out and counted. Targets: the generated motion has the true sign in >= 97%
  of blocks; its magnitude is within 30% of the truth's: the median ratio |generated| / |true| per kind
  of motion (turn, pitch, walk, step) lies in [0.7, 1.3] (the share of blocks within 30% is printed too).
- no collapse: on every seed's walk, the last block's pixel mean, contrast (std) and high-frequency
  energy (mean |Laplacian|) are within 20% of block 4's. The truth's own ratios over the same blocks
  are printed beside them: a world can brighten or darken along the walk by itself (world 1000002's
  16-block walk brightens x1.76 in the renderer), and a model that follows it fails this check.
- the ceiling: the ground truth's round trip through the model's own VAE, streamed as a session
  streams (`training.vae.stream_reconstruct`), measured exactly as the model is. A perfect world model
  would show these frames, so their PSNR and motion are the most the model can reach through its VAE.

- revisit consistency (memory): turn away and back, J held k blocks then L held k blocks (k = 1, 2, 4; the
  camera ends where it started), and compare the returning frame (the last) with the truth's and with the
  frame the model showed before leaving (the last of block 0), beside the truth through the VAE. The
  context is the sink (3 latent frames: block 0, which holds that very view) and the 12 most recent latent
  frames (4 blocks): for k = 1 and 2 the frames before leaving are still in the recent window, for k = 4
  they have left it and only the sink remembers them. Printed, with no target.

Prints one table (one row per block index), the CPU and wall time, and a summary line last (with
`--per-key`, first a table of the motion ratio per held key and block: where a long hold falls behind). Ground
truth renders on one thread (two thread teams on a 2-core host make the ray caster 10x slower), the
model on torch's default threads. `--quick` is a CI-size subset: 1 world, 2 blocks a script, 1 pair, an
8-block walk (collapse: block 8 against block 4).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Iterator, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from lingbot_core.config import PRESETS, ModelConfig  # noqa: E402
from lingbot_core.blocks.loading import build_seeded_parts  # noqa: E402
from lingbot_core.blocks.pipeline import Pipeline, load_pipeline  # noqa: E402
from lingbot_core.process.precision import DTYPE_CHOICES  # noqa: E402
from lingbot_core.boundary.requests import BlockControl  # noqa: E402
from lingbot_core.world.render import SUPERSAMPLE  # noqa: E402
from lingbot_core.world import HELD_OUT_SEEDS, held_keys, key_path, make_world, render, to_uint8  # noqa: E402
from lingbot_core.world.metrics import (KEY_MOTION, frame_statistics, motion_for_key, psnr, ssim,  # noqa: E402
                                        video_motion)

sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_render import cpu_kind  # noqa: E402
from training.vae import stream_reconstruct  # noqa: E402

SINGLE_KEYS = "wasdijkl"
PAIRS = ("wj", "wl", "wd", "sa")
# 16 blocks of mixed walking: mostly forward, turns both ways, steps, a look up and back down, so the
# camera stays among the objects near the start and the pitch returns to level.
WALK = ("w", "w", "wj", "w", "wl", "l", "w", "a", "w", "d", "wl", "i", "w", "k", "j", "w")
WALK_COMPARE_BLOCKS = 16  # the walk is compared with the ground truth over this many blocks after block 0
COLLAPSE_BLOCK = 4  # the walk's last block is compared with this one
PROMPT = "A walk through a quiet countryside with trees, rocks and small houses."  # an app example prompt
# True motion below this (pixels summed over a block) is no evidence of a direction: a pitch held past
# its limit stops, and the estimators' noise on a still pair is well under a pixel.
MIN_TRUE_MOTION_PX = 1.0
PSNR_MARGIN_DB, SIGN_TARGET, MAGNITUDE_TOLERANCE, COLLAPSE_TOLERANCE = 4.0, 0.97, 0.30, 0.20
TARGET_BLOCKS = range(1, 9)  # PSNR target: averaged over blocks 1-8
REVISIT_HOLDS = (1, 2, 4)  # blocks turned away (J) and then back (L)
MOTION_KINDS = {"shift_x": "turn", "shift_y": "pitch", "expansion": "walk", "lateral": "step"}


class Script(NamedTuple):
    name: str
    keys_per_block: tuple[str, ...]  # block 0 first (no key)
    compare_blocks: int  # blocks 0 .. compare_blocks-1 are compared with the ground truth


def scripts(blocks: int, pairs: tuple[str, ...], walk_blocks: int) -> list[Script]:
    held = [Script(keys, ("",) + (keys,) * blocks, blocks + 1) for keys in (*SINGLE_KEYS, *pairs)]
    walk = tuple(WALK[i % len(WALK)] for i in range(walk_blocks))
    return held + [Script("walk", ("",) + walk, min(walk_blocks, WALK_COMPARE_BLOCKS) + 1)]


def block_frames(config: ModelConfig, block: int) -> slice:
    """The pixel frames block `block` decodes to: 0..8 for block 0, then 12 a block."""
    if block == 0:
        return slice(0, config.pixel_frames_for_blocks(1))
    return slice(config.pixel_frames_for_blocks(block), config.pixel_frames_for_blocks(block + 1))


def block_pairs(config: ModelConfig, block: int) -> slice:
    """The frame pairs (pair t-1 -> t at index t-1, as video_motion gives them) whose motion block `block`
    >= 1 shows: from the previous block's last frame on, so no step between blocks goes unmeasured."""
    part = block_frames(config, block)
    return slice(part.start - 1, part.stop - 1)


@contextlib.contextmanager
def threads(count: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def ground_truth(world, path, config: ModelConfig, frames: slice) -> torch.Tensor:
    """[T, 3, H, W] in [0, 1] for the pixel frames `frames` of the path, quantised to uint8 levels as the
    training clips were stored."""
    with threads(1):
        rgb = render(world, path.pixel_poses[frames], path.intrinsics, config.width, config.height, SUPERSAMPLE)
    return torch.from_numpy(to_uint8(rgb)).permute(0, 3, 1, 2).float() / 255.0


def vae_round_trip(pipe: Pipeline, truth: torch.Tensor) -> torch.Tensor:
    """[T, 3, H, W] in [0, 1] -> the same frames encoded and decoded by the pipeline's VAE as a session
    streams them: what a world model that predicted every latent exactly would show."""
    with torch.inference_mode():
        clip, _ = stream_reconstruct(pipe.vae, pipe.config, truth.permute(1, 0, 2, 3) * 2.0 - 1.0)
    return ((clip.float().permute(1, 0, 2, 3) + 1.0) / 2.0).clamp(0, 1)


def random_weights_pipeline(config: ModelConfig, dtype: torch.dtype, seed: int | None = None) -> Pipeline:
    """The same architecture with untrained weights: the preset built from its weights seed (default: the
    embedded preset's), as `load_pipeline("embedded")` built it before any weights were trained."""
    if seed is None:
        seed = PRESETS["embedded"].weights_seed or 0
    seeded = dataclasses.replace(config, weights_seed=seed, trained=False)
    return Pipeline.from_parts(build_seeded_parts(seeded, seed, dtype=dtype))


def load_model(source: str, dtype: str) -> Pipeline:
    # A folder (a training export, say) gets the embedded preset's size, camera and sampler: the world is
    # evaluated at the resolution the embedded model plays at.
    hint = {} if source == "embedded" else {"preset_hint": PRESETS["embedded"]}
    return load_pipeline(source, dtype=dtype, compile=False, **hint)


class Rollout(NamedTuple):
    frames: torch.Tensor  # [T, 3, H, W] in [0, 1]: the compared blocks
    statistics: dict[int, tuple[float, float, float]]  # block -> (mean, contrast, high frequency)


def roll_out(pipe: Pipeline, image, script: Script, stats_blocks: set[int], prompt: str = PROMPT) -> Rollout:
    """`image`: what Pipeline.rollout takes (a world's start picture, a photo's path)."""
    fpb = pipe.config.transformer.num_frames_per_block
    actions = held_keys(script.keys_per_block, fpb)
    controls = [BlockControl(actions=actions[b * fpb:(b + 1) * fpb]) for b in range(len(script.keys_per_block))]
    kept, stats = [], {}
    for output in pipe.rollout(image, prompt, 0, controls):
        frames = ((output.frames[0].float().permute(1, 0, 2, 3) + 1.0) / 2.0).clamp(0, 1)  # [T, 3, H, W]
        if output.block_index < script.compare_blocks:
            kept.append(frames)
        if output.block_index in stats_blocks:
            stats[output.block_index] = tuple(frame_statistics(frames))
    return Rollout(torch.cat(kept), stats)


class Records:
    """Per-block fidelity and per-(block, key) motion of every rollout, for the table and the summary."""

    def __init__(self) -> None:
        self.fidelity = defaultdict(lambda: defaultdict(list))  # block -> metric -> values (one per rollout)
        self.motion = defaultdict(list)  # block -> [(who, script, key, generated, true)]
        # (seed, statistic, the model's ratio last block / block 4, the truth's ratio over the same blocks)
        self.collapse: list[tuple[int, str, float, float]] = []
        # k -> [(the returning frame's PSNR against the truth's, against what the model showed before leaving,
        #        the truth through the VAE against the truth)], one per world
        self.revisit: dict[int, list[tuple[float, float, float]]] = defaultdict(list)

    def add_fidelity(self, config: ModelConfig, who: str, frames: torch.Tensor, truth: torch.Tensor) -> None:
        p, s = psnr(frames, truth), ssim(frames, truth)
        for block in range(_blocks_in(config, len(truth))):
            part = block_frames(config, block)
            self.fidelity[block][f"psnr_{who}"].append(float(p[part].mean()))
            self.fidelity[block][f"ssim_{who}"].append(float(s[part].mean()))

    def add_motion(self, config: ModelConfig, who: str, script: Script, frames: torch.Tensor,
                   truth: torch.Tensor) -> None:
        generated, true = video_motion(frames), video_motion(truth)  # pair t-1 -> t at index t-1
        for block in range(1, _blocks_in(config, len(truth))):
            pairs = block_pairs(config, block)
            for key in sorted(script.keys_per_block[block]):
                g = float(motion_for_key(generated, key)[pairs].sum())
                t = float(motion_for_key(true, key)[pairs].sum())
                self.motion[block].append((who, script.name, key, g, t))

    def following(self, who: str, blocks=None) -> list[tuple[str, float, float]]:
        """(kind, generated, true) of `who`'s key blocks, over `blocks` (default: all), for _following."""
        return [(KEY_MOTION[key][0], g, t) for block in (self.motion if blocks is None else blocks)
                for w, _, key, g, t in self.motion.get(block, []) if w == who]


def _blocks_in(config: ModelConfig, frames: int) -> int:
    return (frames + config.vae_temporal_factor - 1) // config.pixel_frames_per_block


def _following(rows) -> tuple[int, int, int, dict[str, list[float]]]:
    """(agreeing, measured, left out, kind -> ratios |generated| / |true|) of (kind, generated, true) rows."""
    agree = measured = skipped = 0
    ratios = defaultdict(list)
    for kind, g, t in rows:
        if abs(t) < MIN_TRUE_MOTION_PX:
            skipped += 1
            continue
        measured += 1
        agree += int(math.copysign(1.0, t) == (math.copysign(1.0, g) if g != 0 else 0.0))
        ratios[kind].append(abs(g) / abs(t))
    return agree, measured, skipped, ratios


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def evaluate(args) -> tuple[Records, str, int]:
    if args.random_weights:  # "auto" has no meaning without a probe of real weights: fp32 unless bf16 is asked
        base = PRESETS["embedded"] if args.model == "embedded" else load_model(args.model, "fp32").config
        pipe = random_weights_pipeline(base, torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    else:
        pipe = load_model(args.model, args.dtype)
    config = pipe.config
    # An untrained preset's own weights are the random-weights baseline: measure them once.
    baseline_is_model = not config.trained
    baseline = pipe if baseline_is_model else random_weights_pipeline(config, pipe.dtype)
    note = (f"model {args.model}{' (random weights)' if args.random_weights else ''}, {config.name} "
            f"{config.height}x{config.width}, {str(pipe.dtype).replace('torch.', '')}, "
            f"{'trained' if config.trained else 'UNTRAINED: the random-weights baseline is the model itself'}")
    print(note, file=sys.stderr, flush=True)
    records = Records()
    plan = scripts(args.blocks, PAIRS[:args.pairs], args.walk_blocks)
    blocks_run = 0
    for world_index, seed in enumerate(HELD_OUT_SEEDS[:args.seeds]):
        world = make_world(seed)
        with_baseline = world_index < args.baseline_worlds
        image = _start_picture(world, config)
        repeat = torch.from_numpy(image).permute(2, 0, 1).float() / 255.0
        for script in plan:
            began = time.perf_counter()
            path = key_path(held_keys(script.keys_per_block, config.transformer.num_frames_per_block), config)
            truth = ground_truth(world, path, config, slice(0, config.pixel_frames_for_blocks(script.compare_blocks)))
            is_walk = script.name == "walk"
            last = len(script.keys_per_block) - 1
            stats_blocks = {COLLAPSE_BLOCK, last} if is_walk else set()
            model = roll_out(pipe, image, script, stats_blocks)
            blocks_run += len(script.keys_per_block)
            records.add_fidelity(config, "model", model.frames, truth)
            records.add_fidelity(config, "repeat", repeat.expand_as(truth), truth)
            records.add_motion(config, "model", script, model.frames, truth)
            ceiling = vae_round_trip(pipe, truth)
            records.add_fidelity(config, "vae", ceiling, truth)
            records.add_motion(config, "vae", script, ceiling, truth)
            if with_baseline:
                baseline_frames = model.frames
                if not baseline_is_model:
                    short = script._replace(keys_per_block=script.keys_per_block[:script.compare_blocks])
                    baseline_frames = roll_out(baseline, image, short, set()).frames
                    blocks_run += len(short.keys_per_block)
                records.add_fidelity(config, "random", baseline_frames, truth)
                records.add_motion(config, "random", script, baseline_frames, truth)
            if is_walk:
                # The truth's own change over the same blocks: a walk can brighten or darken in the world
                # itself, which no check of the model alone can tell from a drift.
                true_stats = {block: frame_statistics(ground_truth(world, path, config, block_frames(config, block)))
                              for block in (COLLAPSE_BLOCK, last)}
                for index, name in enumerate(("mean", "contrast", "high_frequency")):
                    ratio = model.statistics[last][index] / max(model.statistics[COLLAPSE_BLOCK][index], 1e-12)
                    true_ratio = true_stats[last][index] / max(true_stats[COLLAPSE_BLOCK][index], 1e-12)
                    records.collapse.append((seed, name, ratio, true_ratio))
            print(f"  world {seed} {script.name:>4}: {len(script.keys_per_block)} blocks, "
                  f"{time.perf_counter() - began:.1f} s", file=sys.stderr, flush=True)
        if args.revisit:
            for k in REVISIT_HOLDS:
                blocks_run += revisit(pipe, world, image, config, k, records)
    return records, note, blocks_run


def revisit(pipe: Pipeline, world, image: np.ndarray, config: ModelConfig, k: int, records: Records) -> int:
    """Turn away k blocks and back; record the returning frame against the truth and against the frame shown
    before leaving. Returns the blocks run."""
    script = Script(f"revisit{k}", ("",) + ("j",) * k + ("l",) * k, 2 * k + 1)
    path = key_path(held_keys(script.keys_per_block, config.transformer.num_frames_per_block), config)
    truth = ground_truth(world, path, config, slice(0, config.pixel_frames_for_blocks(script.compare_blocks)))
    model = roll_out(pipe, image, script, set()).frames
    ceiling = vae_round_trip(pipe, truth)
    before = block_frames(config, 0).stop - 1  # the last frame before the first turn
    back, seen = model[-1:], model[before:before + 1]
    records.revisit[k].append((float(psnr(back, truth[-1:])[0]), float(psnr(back, seen)[0]),
                               float(psnr(ceiling[-1:], truth[-1:])[0])))
    return len(script.keys_per_block)


def _start_picture(world, config: ModelConfig) -> np.ndarray:
    """The world's start picture [H, W, 3] uint8: the start pose, key-input intrinsics, supersampled as
    training (lingbot_core/world/examples.py renders the app's examples the same way)."""
    start = key_path([frozenset()], config)
    with threads(1):
        return to_uint8(render(world, start.pixel_poses[:1], start.intrinsics, config.width, config.height,
                               SUPERSAMPLE))[0]


def per_key_table(records: Records) -> None:
    """Per held script and key (not the walk): the median |generated| / |true| motion at each block, over
    the worlds, for the model and (in brackets) the truth through the VAE; '-' where the true motion is
    under MIN_TRUE_MOTION_PX, and a '!' where the model moved against the truth in any world. It shows
    where in a long hold, and for which keys, the model falls behind."""
    by_key = defaultdict(list)  # (who, script, key, block) -> [(generated, true)], the worlds in order
    for block, rows in records.motion.items():
        for who, name, key, g, t in rows:
            if name != "walk":
                by_key[(who, name, key, block)].append((g, t))
    keys = list(dict.fromkeys((name, key) for who, name, key, _ in by_key if who == "model"))  # the plan's order
    blocks = sorted({block for *_, block in by_key})
    print(f"{'script':>6} {'key':>3} | " + " ".join(f"{'block ' + str(b):>12}" for b in blocks))
    for name, key in keys:
        cells = []
        for block in blocks:
            pairs = [(g, t) for g, t in by_key.get(("model", name, key, block), []) if abs(t) >= MIN_TRUE_MOTION_PX]
            ceiling = [abs(g) / abs(t) for g, t in by_key.get(("vae", name, key, block), [])
                       if abs(t) >= MIN_TRUE_MOTION_PX]
            if not pairs:
                cells.append(f"{'-':>12}")
                continue
            against = any(g * t <= 0 for g, t in pairs)
            ratio = statistics.median(abs(g) / abs(t) for g, t in pairs)
            vae = f"({statistics.median(ceiling):.2f})" if ceiling else ""
            cells.append(f"{('!' if against else '') + f'{ratio:.2f}' + vae:>12}")
        print(f"{name:>6} {key:>3} | " + " ".join(cells))


def collapse_lines(records: Records, last: int) -> list[str]:
    """One line per walk: the model's ratios of its last block's statistics to block 4's, the truth's in brackets."""
    return [f"Walk of world {seed}, block {last} against block {COLLAPSE_BLOCK}, the model (the truth): " + ", ".join(
        f"{name} x{ratio:.2f} (x{true_ratio:.2f})" for s, name, ratio, true_ratio in records.collapse if s == seed)
        for seed in dict.fromkeys(c[0] for c in records.collapse)]


def report(records: Records, args, note: str, blocks_run: int, seconds: float) -> bool:
    print(note)
    if args.per_key:
        per_key_table(records)
    print(f"{'block':>5} {'n':>3} | {'PSNR dB model':>13} {'repeat':>7} {'random':>7} | {'SSIM model':>10} "
          f"{'repeat':>7} {'random':>7} | {'keys':>4} {'sign model':>10} {'random':>7} {'|g|/|t|':>7} {'vae':>5}")
    for block in sorted(records.fidelity):
        f = records.fidelity[block]
        agree, measured, _, ratios = _following(records.following("model", [block]))
        r_agree, r_measured, _, _ = _following(records.following("random", [block]))
        all_ratios = [r for values in ratios.values() for r in values]
        _, _, _, vae_ratios = _following(records.following("vae", [block]))
        vae_all = [r for values in vae_ratios.values() for r in values]
        follow = (f"{measured:>4} {100 * agree / measured:>9.0f}% {100 * r_agree / max(r_measured, 1):>6.0f}% "
                  f"{statistics.median(all_ratios):>7.2f} {statistics.median(vae_all):>5.2f}") if measured \
            else f"{'-':>4} {'':>10} {'':>7} {'':>7} {'':>5}"
        print(f"{block:>5} {len(f['psnr_model']):>3} | {_mean(f['psnr_model']):>13.2f} {_mean(f['psnr_repeat']):>7.2f} "
              f"{_mean(f['psnr_random']):>7.2f} | {_mean(f['ssim_model']):>10.3f} {_mean(f['ssim_repeat']):>7.3f} "
              f"{_mean(f['ssim_random']):>7.3f} | {follow}")

    # Targets.
    target_blocks = [b for b in TARGET_BLOCKS if b in records.fidelity]
    model_db = _mean(_mean(records.fidelity[b]["psnr_model"]) for b in target_blocks)
    repeat_db = _mean(_mean(records.fidelity[b]["psnr_repeat"]) for b in target_blocks)
    random_db = _mean(_mean(records.fidelity[b]["psnr_random"]) for b in target_blocks)
    psnr_ok = model_db - repeat_db >= PSNR_MARGIN_DB
    agree, measured, skipped, ratios = _following(records.following("model"))
    sign_rate = agree / measured if measured else float("nan")
    sign_ok = measured > 0 and sign_rate >= SIGN_TARGET
    medians = {MOTION_KINDS[k]: statistics.median(v) for k, v in sorted(ratios.items())}
    all_ratios = [r for values in ratios.values() for r in values]
    within = _mean(abs(r - 1.0) <= MAGNITUDE_TOLERANCE for r in all_ratios)
    magnitude_ok = bool(medians) and all(abs(m - 1.0) <= MAGNITUDE_TOLERANCE for m in medians.values())
    vae_db = _mean(_mean(records.fidelity[b]["psnr_vae"]) for b in target_blocks)
    vae_agree, vae_measured, _, vae_ratios = _following(records.following("vae"))
    vae_medians = {MOTION_KINDS[k]: statistics.median(v) for k, v in sorted(vae_ratios.items())}
    worst = max(records.collapse, key=lambda c: abs(c[2] - 1.0)) if records.collapse else None
    collapse_ok = worst is not None and abs(worst[2] - 1.0) <= COLLAPSE_TOLERANCE
    last = args.walk_blocks
    print(f"CPU: {cpu_kind()}; {blocks_run} model blocks, wall {seconds:.0f} s; worlds "
          f"{HELD_OUT_SEEDS.start}..{HELD_OUT_SEEDS.start + args.seeds - 1} (held out); "
          f"{skipped} key-blocks with true motion < {MIN_TRUE_MOTION_PX} px left out")
    print(f"Ceiling, the truth through the VAE and back: PSNR blocks {target_blocks[0]}-{target_blocks[-1]} "
          f"{vae_db:.2f} dB; sign {100 * vae_agree / max(vae_measured, 1):.0f}%; median |g|/|t| "
          f"{', '.join(f'{k} {v:.2f}' for k, v in vae_medians.items())}")
    for line in collapse_lines(records, last):
        print(line)
    for k, rows in sorted(records.revisit.items()):
        window = "in the recent window" if 2 * k <= 4 else "out of the recent window, in the sink only"
        print(f"Revisit, J held {k} block(s) then L held {k} (the view before leaving is {window}): the returning "
              f"frame against the truth {_mean(r[0] for r in rows):.2f} dB (the truth through the VAE "
              f"{_mean(r[2] for r in rows):.2f} dB), against what the model showed before leaving "
              f"{_mean(r[1] for r in rows):.2f} dB; {len(rows)} world(s)")
    verdict = lambda ok: "PASS" if ok else "FAIL"  # noqa: E731
    collapse_text = (f"worst {worst[1]} x{worst[2]:.2f} (world {worst[0]}; the truth x{worst[3]:.2f})"
                     if worst else "no walk")
    print(f"SUMMARY: PSNR blocks {target_blocks[0]}-{target_blocks[-1]} {verdict(psnr_ok)} "
          f"{model_db:.2f} dB vs repeat {repeat_db:.2f} (+{model_db - repeat_db:.2f}, target +{PSNR_MARGIN_DB:.0f}), "
          f"random {random_db:.2f}; sign {verdict(sign_ok)} {100 * sign_rate:.1f}% of {measured} "
          f"(target {100 * SIGN_TARGET:.0f}%); magnitude {verdict(magnitude_ok)} median |g|/|t| "
          f"{', '.join(f'{k} {v:.2f}' for k, v in medians.items())} ({100 * within:.0f}% of blocks within "
          f"{100 * MAGNITUDE_TOLERANCE:.0f}%); collapse block {last} vs {COLLAPSE_BLOCK} {verdict(collapse_ok)} "
          f"{collapse_text} (within {100 * COLLAPSE_TOLERANCE:.0f}%)")
    return psnr_ok and sign_ok and magnitude_ok and collapse_ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="embedded", help="embedded, or a diffusers-layout folder")
    parser.add_argument("--seeds", type=int, default=2, help="held-out worlds, from the first")
    parser.add_argument("--blocks", type=int, default=8, help="blocks each held key script runs after block 0")
    parser.add_argument("--pairs", type=int, default=len(PAIRS), help=f"how many of the pairs {PAIRS}")
    parser.add_argument("--walk-blocks", type=int, default=64, help="blocks of the mixed walk after block 0")
    parser.add_argument("--baseline-worlds", type=int, default=1,
                        help="worlds the random-weights baseline runs on, from the first (it costs as much as "
                             "the model and barely varies)")
    parser.add_argument("--dtype", default="fp32", choices=DTYPE_CHOICES)
    parser.add_argument("--random-weights", action="store_true",
                        help="evaluate the preset's random weights as the model (the harness without training)")
    parser.add_argument("--quick", action="store_true", help="1 world, 2 blocks, 1 pair, an 8-block walk")
    parser.add_argument("--revisit", action=argparse.BooleanOptionalAction, default=True,
                        help="turn away and back (J then L held 1, 2, 4 blocks) and print the memory figures")
    parser.add_argument("--per-key", action="store_true",
                        help="also print, per held key, the median motion ratio at each block (before the table)")
    args = parser.parse_args(argv)
    if args.quick:
        args.seeds, args.blocks, args.pairs, args.walk_blocks = 1, 2, 1, 8
    if not 1 <= args.seeds <= len(HELD_OUT_SEEDS):
        parser.error(f"--seeds must be within 1..{len(HELD_OUT_SEEDS)}")
    if args.blocks < 1 or not 0 <= args.pairs <= len(PAIRS):
        parser.error(f"--blocks must be >= 1 and --pairs within 0..{len(PAIRS)}")
    if args.walk_blocks < COLLAPSE_BLOCK + 1:
        parser.error(f"--walk-blocks must be > {COLLAPSE_BLOCK} (the collapse check compares with block "
                     f"{COLLAPSE_BLOCK})")
    began = time.perf_counter()
    records, note, blocks_run = evaluate(args)
    ok = report(records, args, note, blocks_run, time.perf_counter() - began)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
