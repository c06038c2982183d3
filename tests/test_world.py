"""The procedural world: its geometry against the camera module's maths, determinism, the seed split.

Renders are small (at most 128x224 rays) and use one thread, so the whole file runs in seconds.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lingbot_core.config import PRESETS
from lingbot_core.model import camera
from lingbot_core.world import (HELD_OUT_SEEDS, TRAIN_SEEDS, World, WorldConfig, held_keys, key_path, make_world,
                                objects_near, pixel_poses, render, render_buffers, seed_split)

EMBEDDED = PRESETS["embedded"]
FPB = EMBEDDED.transformer.num_frames_per_block
SEED = HELD_OUT_SEEDS.start
W, H = 160, 96
K = np.array([100.0, 100.0, W / 2, H / 2])  # fx, fy, cx, cy in pixels of a 160x96 frame


pytestmark = pytest.mark.usefixtures("single_thread")  # conftest.py: one intra-op thread for the module


def empty_world(sun_direction=None) -> World:
    """A world with no objects and, optionally, the sun placed by hand."""
    world = make_world(SEED, WorldConfig(objects_per_cell=0.0, start_objects=0))
    # For the sun: a dark clear sky, so the disc does not saturate against it.
    style = world.style if sun_direction is None else dataclasses.replace(
        world.style, sun_direction=tuple(sun_direction), cloud_cover=0.0, sky_zenith=(0.05, 0.05, 0.1),
        sky_horizon=(0.1, 0.1, 0.15))
    return dataclasses.replace(world, style=style)


def sun_centroid(world: World, pose: np.ndarray) -> tuple[float, float]:
    """Centroid (x, y) in pixels of the sun disc: where the render differs from one without a sun."""
    dark = dataclasses.replace(world, style=dataclasses.replace(world.style, sun_colour=(0.0, 0.0, 0.0)))
    lit = render_buffers(world, pose, K, W, H).rgb[0].sum(0)
    unlit = render_buffers(dark, pose, K, W, H).rgb[0].sum(0)
    disc = ((lit - unlit) > 1.5).double()  # the disc adds about the sun colour; the halo far less
    assert disc.sum() > 10, "the sun disc is not in the frame"
    ys, xs = torch.meshgrid(torch.arange(H) + 0.5, torch.arange(W) + 0.5, indexing="ij")
    return float((disc * xs).sum() / disc.sum()), float((disc * ys).sum() / disc.sum())


# ---------------------------------------------------------------------------------------------
# Geometry against the camera maths


@pytest.mark.parametrize("steps", [1, 2, 3])
def test_yaw_moves_a_distant_point_by_f_tan_theta(steps):
    # The sun is a point at infinity straight ahead (azimuth 0), 10 degrees up: turning right by
    # theta with the integrator's own 'l' key must move it left by fx * tan(theta) pixels.
    elevation = math.radians(10.0)
    world = empty_world((0.0, -math.sin(elevation), math.cos(elevation)))
    poses, _ = camera.integrate_actions(camera.CameraState.initial(), [["l"]] * steps, EMBEDDED.camera)
    x0, y0 = sun_centroid(world, np.eye(4))
    x1, y1 = sun_centroid(world, poses[-1])
    theta = math.radians(EMBEDDED.camera.yaw_step_deg * steps)
    assert x0 == pytest.approx(K[2], abs=0.05)
    assert y0 == pytest.approx(K[3] - K[1] * math.tan(elevation), abs=0.3)
    assert x0 - x1 == pytest.approx(K[0] * math.tan(theta), abs=0.3)


def test_horizon_row_follows_pitch():
    # With no objects, a ray hits the ground exactly when it points below the horizontal: at pitch a
    # (the integrator's 'i' key) that is every pixel row whose centre lies below cy + fy * tan(a).
    world = empty_world()
    for steps in (0, 1, 3):
        poses, _ = camera.integrate_actions(camera.CameraState.initial(), [["i"]] * steps or [[]], EMBEDDED.camera)
        ids = render_buffers(world, poses[-1], K, W, H).object_id[0]
        pitch = math.radians(EMBEDDED.camera.pitch_step_deg * steps)
        rows = torch.arange(H) + 0.5
        expected = torch.where(rows > K[3] + K[1] * math.tan(pitch), 0, -1)
        assert torch.equal(ids, expected[:, None].expand(H, W))


def test_walking_forward_makes_the_nearest_object_grow():
    world = make_world(SEED)
    path = key_path(held_keys(["", "w", "w"], FPB), EMBEDDED)
    first, last = path.pixel_poses[0], path.pixel_poses[-1]
    before = render_buffers(world, first, K, W, H)
    after = render_buffers(world, last, K, W, H)
    # The nearest object that lies wholly inside the first frame.
    ids = before.object_id[0]
    border = torch.cat([ids[0], ids[-1], ids[:, 0], ids[:, -1]]).unique()
    candidates = [i for i in ids.unique().tolist() if i >= 1 and i not in border.tolist()]
    assert candidates, "the start view shows no whole object"
    nearest = min(candidates, key=lambda i: float(before.depth[0][ids == i].min()))
    z_before = _z_depth(before, nearest, first)
    z_after = _z_depth(after, nearest, last)
    moved = np.linalg.norm(last[:3, 3] - first[:3, 3])
    assert moved == pytest.approx(2 * FPB * EMBEDDED.camera.move_step)
    # Straight ahead (no turn), the object's camera z shrinks by the distance walked ...
    assert z_before - z_after == pytest.approx(moved, rel=0.1)
    # ... and its image area grows as 1 / z^2.
    area_before = int((ids == nearest).sum())
    area_after = int((after.object_id[0] == nearest).sum())
    assert area_after / area_before == pytest.approx((z_before / z_after) ** 2, rel=0.2)


def _z_depth(buffers, object_id: int, pose: np.ndarray) -> float:
    """Median camera-z of an object's pixels (depth along the unit ray times the ray's z component)."""
    ys, xs = torch.nonzero(buffers.object_id[0] == object_id, as_tuple=True)
    rays = torch.stack([(xs + 0.5 - K[2]) / K[0], (ys + 0.5 - K[3]) / K[1], torch.ones(len(xs))], -1).double()
    cos = 1.0 / rays.norm(dim=-1)
    return float((buffers.depth[0][ys, xs].double() * cos).median())


# ---------------------------------------------------------------------------------------------
# Resolution and supersampling


def test_supersampling_is_the_average_of_a_finer_render():
    # render(s=2) must equal a 2x render with 2x intrinsics, 2x2 averaged: sub-pixel centres
    # (x + 0.5) / 2 average to the pixel centre.
    world = make_world(SEED)
    coarse = render(world, np.eye(4), K / 2, W // 2, H // 2, supersample=2)
    fine = render_buffers(world, np.eye(4), K, W, H).rgb  # K is in pixels of W x H: twice the coarse K
    assert torch.allclose(coarse, F.avg_pool2d(fine, 2), atol=1e-6)


def test_two_resolutions_agree_when_downsampled():
    world = make_world(SEED)
    pose = key_path(held_keys(["", "wl"], FPB), EMBEDDED).pixel_poses[-1]
    low = render(world, pose, K / 2, W // 2, H // 2, supersample=2)
    high = render(world, pose, K, W, H, supersample=2)
    error = (F.avg_pool2d(high, 2) - low).abs()
    psnr = -10 * math.log10(float((error ** 2).mean()))
    assert float(error.mean()) < 0.02
    assert psnr > 27


# ---------------------------------------------------------------------------------------------
# Determinism and the seed split


def test_same_seed_same_world_and_pixels():
    path = key_path(held_keys(["", "w"], FPB), EMBEDDED)
    a = render(make_world(SEED), path.pixel_poses[::6], path.intrinsics, W, H, supersample=1)
    b = render(make_world(SEED), path.pixel_poses[::6], path.intrinsics, W, H, supersample=1)
    assert torch.equal(a, b)
    c = render(make_world(SEED + 1), path.pixel_poses[::6], path.intrinsics, W, H, supersample=1)
    assert float((a - c).abs().mean()) > 0.02


def test_a_clip_renders_the_same_pixels_as_its_frames_alone():
    # Frames are cast in batches over the objects near the whole clip; each frame alone (its own,
    # smaller object draw, a batch of one) must hit the same objects at the same depths and come out
    # the same up to float rounding (vector kernels round a tensor's tail elements differently).
    world = make_world(SEED)
    path = key_path(held_keys(["", "wl", "wj"], FPB), EMBEDDED)
    poses = path.pixel_poses[::8]
    clip = render_buffers(world, poses, K, W, H)
    for index, pose in enumerate(poses):
        alone = render_buffers(world, pose, K, W, H)
        assert torch.equal(alone.object_id[0], clip.object_id[index])
        assert torch.allclose(alone.depth[0], clip.depth[index], rtol=1e-6, atol=0)
        assert torch.allclose(alone.rgb[0], clip.rgb[index], rtol=0, atol=1e-6)


def test_objects_do_not_depend_on_the_order_cells_are_drawn_in():
    world = make_world(SEED)
    near = objects_near(world, np.array([[0.0, 0.0]]), 3.0)
    wide = objects_near(world, np.array([[0.0, 0.0], [40.0, -25.0]]), 3.0)
    # Every object near the origin comes out identical when far cells are drawn too.
    keep = torch.isin(wide.bound_id, near.bound_id)
    assert torch.equal(wide.bound_centre[keep], near.bound_centre)
    assert torch.equal(wide.bound_radius[keep], near.bound_radius)


def test_seed_ranges_are_disjoint_and_checked():
    assert TRAIN_SEEDS.stop <= HELD_OUT_SEEDS.start or HELD_OUT_SEEDS.stop <= TRAIN_SEEDS.start
    assert len(TRAIN_SEEDS) > 0 and len(HELD_OUT_SEEDS) > 0
    assert seed_split(TRAIN_SEEDS.start) == "train" and seed_split(TRAIN_SEEDS.stop - 1) == "train"
    assert seed_split(HELD_OUT_SEEDS.start) == "held_out" and seed_split(HELD_OUT_SEEDS.stop - 1) == "held_out"
    for bad in (-1, HELD_OUT_SEEDS.stop, 2**40):
        with pytest.raises(ValueError, match="outside the train range"):
            make_world(bad)
    with pytest.raises(ValueError, match="integer"):
        make_world(1.5)


# ---------------------------------------------------------------------------------------------
# Camera paths


def test_key_path_is_the_integrators_path_spread_over_pixel_frames():
    keys = held_keys(["", "w", "jw", "i"], FPB)
    path = key_path(keys, EMBEDDED)
    latent, _ = camera.integrate_actions(camera.CameraState.initial(), keys, EMBEDDED.camera)
    assert np.array_equal(path.latent_poses, latent)
    factor = EMBEDDED.vae_temporal_factor
    assert len(path.pixel_poses) == EMBEDDED.pixel_frames_for_blocks(4)  # 12N - 3, as the decoder yields
    assert np.array_equal(path.pixel_poses[::factor], latent)  # pixel frame 4k is latent pose k
    # Between two latent poses, positions move linearly.
    middle = path.pixel_poses[factor * 4 + 2, :3, 3]
    assert np.allclose(middle, (latent[4, :3, 3] + latent[5, :3, 3]) / 2)
    assert np.allclose(path.intrinsics, camera.intrinsics_for(EMBEDDED.camera, EMBEDDED.width, EMBEDDED.height))


def test_renderer_rays_are_the_rays_the_model_is_told_about():
    # Block 0 of a session: anchor and pose are the start pose, so the Plücker direction channels are
    # the camera-frame rays of the intrinsics the rollout hands plucker_block. The renderer must cast
    # exactly those rays through key_path's intrinsics.
    cfg, width, height = EMBEDDED.camera, EMBEDDED.width, EMBEDDED.height
    reference = camera.reference_intrinsics(cfg, 1, width, height)
    told = camera.plucker_block(np.eye(4), np.eye(4)[None], reference, width, height, cfg)[0, 3:]  # [3, H, W]
    fx, fy, cx, cy = key_path(held_keys([""], FPB), EMBEDDED).intrinsics
    xs = (np.arange(width) + 0.5 - cx) / fx
    ys = (np.arange(height) + 0.5 - cy) / fy
    rays = np.stack(np.broadcast_arrays(xs[None, :], ys[:, None], np.ones((height, width))))
    rays = rays / np.linalg.norm(rays, axis=0, keepdims=True)
    assert np.allclose(told.numpy(), rays, atol=1e-6)


def test_pose_files_load_through_the_camera_module_and_scale_to_the_frame(tmp_path):
    from lingbot_core.world import file_path

    poses = np.repeat(np.eye(4)[None], 5, axis=0)
    poses[:, 2, 3] = np.linspace(0.0, 0.4, 5)
    reference = np.tile([500.0, 500.0, 416.0, 240.0], (5, 1))  # 832x480 reference pixels
    np.save(tmp_path / "poses.npy", poses)
    np.save(tmp_path / "intrinsics.npy", reference)
    loaded, pixels = file_path("poses.npy", "intrinsics.npy", tmp_path, EMBEDDED)
    assert np.array_equal(loaded, poses)
    sx, sy = EMBEDDED.width / 832, EMBEDDED.height / 480
    assert np.allclose(pixels, [500 * sx, 500 * sy, EMBEDDED.width / 2, EMBEDDED.height / 2])
    np.save(tmp_path / "bad.npy", np.zeros((5, 3)))
    with pytest.raises(camera.TrajectoryError, match="shape"):
        file_path("poses.npy", "bad.npy", tmp_path, EMBEDDED)


def test_pixel_poses_of_a_single_latent_frame():
    assert np.array_equal(pixel_poses(np.eye(4)[None], 4), np.eye(4)[None])


def test_bad_input_is_refused_with_a_message():
    world = make_world(SEED)
    with pytest.raises(camera.ActionError, match="unknown key"):
        held_keys(["w", "x"], FPB)
    with pytest.raises(ValueError, match="width must be a positive integer"):
        render(world, np.eye(4), K, 0, H)
    with pytest.raises(ValueError, match="supersample"):
        render(world, np.eye(4), K, W, H, supersample=0)
    with pytest.raises(camera.TrajectoryError, match="focal lengths must be positive"):
        render(world, np.eye(4), np.array([0.0, 100.0, 80.0, 48.0]), W, H)
    with pytest.raises(camera.TrajectoryError, match="non-finite"):
        render(world, np.full((4, 4), np.nan), K, W, H)


# ---------------------------------------------------------------------------------------------
# Training clips (training/data.py)


def test_training_clips_are_reproducible_train_worlds_with_app_like_scripts():
    from training.data import actions_to_array, array_to_actions, make_clip, sample_script

    small = dataclasses.replace(EMBEDDED, height=32, width=64)
    a = make_clip(7, 3, small, num_blocks=2, supersample=1)
    b = make_clip(7, 3, small, num_blocks=2, supersample=1)
    assert a.world_seed == b.world_seed and a.frame_actions == b.frame_actions
    assert torch.equal(a.video, b.video)
    assert seed_split(a.world_seed) == "train"
    assert a.video.shape == (3, small.pixel_frames_for_blocks(2), 32, 64)
    assert float(a.video.min()) >= -1.0 and float(a.video.max()) <= 1.0
    assert len({make_clip(7, i, small, 1, 1).world_seed for i in range(3)}) == 3
    # The poses are the integrator's for the script.
    latent, _ = camera.integrate_actions(camera.CameraState.initial(), a.frame_actions, EMBEDDED.camera)
    assert np.array_equal(a.latent_poses, latent)

    rng = np.random.default_rng(0)
    for _ in range(50):
        script = sample_script(rng, 5, FPB)
        assert len(script) == 5 * FPB
        assert all(keys == frozenset() for keys in script[:FPB])  # block 0 is still, as in the app
        for keys in script:
            assert not ({"w", "s"} <= keys or {"a", "d"} <= keys or {"i", "k"} <= keys or {"j", "l"} <= keys)
        assert array_to_actions(actions_to_array(script)) == script


def test_hold_scripts_repeat_whole_blocks_and_leave_the_default_scripts_unchanged():
    import hashlib

    from training.data import ScriptConfig, actions_to_array, sample_script

    # The default scripts are those the shipped model's first 380 clips were rendered with (a hold
    # setting that drew even at 0 would have changed every clip after it).
    digest = hashlib.sha256(np.stack([actions_to_array(sample_script(np.random.default_rng([0, i]), 6, FPB))
                                      for i in range(50)]).tobytes()).hexdigest()
    assert digest == "16fd8e289e37f958c9f7eb0a1a6a3ca93dd0dc2acf736ed3331355604acea5fe"
    # hold 1: every block from block 2 on presses block 1's keys for the whole block, also when
    # block 1 pressed them for part of it only.
    for partial in (0.0, 1.0):
        for i in range(20):
            script = sample_script(np.random.default_rng([0, i]), 6, FPB, ScriptConfig(hold=1.0, partial=partial))
            block1 = frozenset().union(*script[FPB:2 * FPB])
            assert set(script[2 * FPB:]) == {block1}
    # hold 0.75: about that share of later blocks press the previous block's keys for the whole block
    # (a fresh block that happens to equal it counts too), and no block presses opposite keys.
    repeats = blocks = 0
    for i in range(200):
        script = sample_script(np.random.default_rng([1, i]), 6, FPB, ScriptConfig(hold=0.75))
        per_block = [script[b * FPB:(b + 1) * FPB] for b in range(6)]
        for b in range(2, 6):
            blocks += 1
            repeats += per_block[b] == (frozenset().union(*per_block[b - 1]),) * FPB
        for keys in script:
            assert not ({"w", "s"} <= keys or {"a", "d"} <= keys or {"i", "k"} <= keys or {"j", "l"} <= keys)
    assert 0.72 < repeats / blocks < 0.85
    with pytest.raises(ValueError, match="probability"):
        sample_script(np.random.default_rng(0), 6, FPB, ScriptConfig(hold=1.5))


def test_first_keys_scripts_press_one_of_those_keys_in_block_1_and_hold_it():
    """--first-keys ikad --hold 1.0: every clip holds a pitch or a sideways step (alone or in a pair)
    from block 1 to its end, each of the keys about equally often; the default scripts stay unchanged
    (the digest test above), and a key outside WASDIJKL is refused."""
    from training.data import ScriptConfig, sample_script

    counts = {k: 0 for k in "ikad"}
    for i in range(400):
        script = sample_script(np.random.default_rng([3, i]), 6, FPB, ScriptConfig(hold=1.0, first_keys="ikad"))
        block1 = frozenset().union(*script[FPB:2 * FPB])
        firsts = block1 & set("ikad")
        assert firsts and len(block1) <= 2
        assert set(script[2 * FPB:]) == {block1}
        for key in firsts:
            counts[key] += 1
    assert all(80 <= n <= 150 for n in counts.values()), counts
    # Without first_keys the same generator gives the default script, draw for draw.
    assert (sample_script(np.random.default_rng([3, 1]), 6, FPB, ScriptConfig(first_keys=""))
            == sample_script(np.random.default_rng([3, 1]), 6, FPB))
    for bad in ("x", "ii"):
        with pytest.raises(ValueError, match="first_keys"):
            ScriptConfig(first_keys=bad)


def test_pitched_starts_are_states_a_session_reaches_and_level_clips_stay_unchanged():
    """--start-pitch starts a clip pitched by whole pitch steps within the limit, tracked for the
    limit as a session tracks it; start_state recovers that state from the clip's first pose; a
    level setting draws nothing, so the clips the shipped model trained on render the same."""
    from training.data import ScriptConfig, make_clip, pitched_state, sample_start, start_state

    cfg = EMBEDDED.camera
    pitches = {sample_start(np.random.default_rng([2, i]), cfg, ScriptConfig(start_pitch=84.0)).pitch_deg
               for i in range(400)}
    assert pitches <= {cfg.pitch_step_deg * k for k in range(-21, 22)}
    assert max(pitches) == 84.0 and min(pitches) == -84.0 and len(pitches) > 30
    # A session holding I from the level start reaches exactly the pitched state (pose and pitch).
    poses, held = camera.integrate_actions(camera.CameraState.initial(), [frozenset("i")] * 5, cfg)
    np.testing.assert_allclose(pitched_state(20.0).pose, held.pose, atol=1e-12)
    assert held.pitch_deg == 20.0
    # Recovered from a pose that also turned: the yaw leaves the pitch alone.
    turned = camera.integrate_actions(pitched_state(-48.0), [frozenset("j")] * 4, cfg)[1]
    assert start_state(turned.pose).pitch_deg == pytest.approx(-48.0, abs=1e-6)

    small = dataclasses.replace(EMBEDDED, height=32, width=64)
    level = make_clip(7, 3, small, num_blocks=2, supersample=1)
    assert np.array_equal(level.latent_poses[0], np.eye(4))
    assert np.array_equal(make_clip(7, 3, small, 2, 1, ScriptConfig(start_pitch=0.0)).video, level.video)
    pitched = next(c for c in (make_clip(7, i, small, 2, 1, ScriptConfig(start_pitch=84.0)) for i in range(3, 20))
                   if abs(start_state(c.latent_poses[0]).pitch_deg) >= 20.0)
    start = start_state(pitched.latent_poses[0])
    latent, _ = camera.integrate_actions(start, pitched.frame_actions, cfg)
    np.testing.assert_allclose(pitched.latent_poses, latent, atol=1e-12)
    with pytest.raises(ValueError, match="start_pitch"):
        ScriptConfig(start_pitch=120.0)
