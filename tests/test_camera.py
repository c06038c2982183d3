"""Camera path: action integrator, Plücker maps, hardened trajectory files, SLERP resampling."""

from __future__ import annotations

import dataclasses
import io
import math
import os
import pickle
import struct

import numpy as np
import pytest
import torch

from lingbot_core.config import EMBEDDED, LINGBOT_WORLD_V2_14B, CameraConfig, tiny_config
from lingbot_core.model.camera import (
    ActionError,
    CameraState,
    TrajectoryError,
    VALID_KEYS,
    integrate_actions,
    intrinsics_for,
    load_trajectory,
    plan_trajectory,
    plucker_block,
    reference_intrinsics,
    resample_trajectory,
    rotation_x,
    rotation_y,
    trajectory_blocks,
    trajectory_translation_scale,
    validate_trajectory,
)

CFG = CameraConfig()
assert CFG.focal_at == "target"  # the real checkpoint's conventions; tests that need our presets' say so
FPB = tiny_config().transformer.num_frames_per_block


def pose(rotation=np.eye(3), translation=(0.0, 0.0, 0.0)) -> np.ndarray:
    out = np.eye(4)
    out[:3, :3] = rotation
    out[:3, 3] = translation
    return out


# ---------------------------------------------------------------------------------------------
# Actions


def test_valid_keys():
    assert VALID_KEYS == frozenset("wasdijkl")


# ---------------------------------------------------------------------------------------------
# Integrator


def test_w_moves_forward_along_plus_z_from_identity():
    poses, state = integrate_actions(CameraState.initial(), [["w"], ["w"], []], CFG)
    assert poses.shape == (3, 4, 4) and poses.dtype == np.float64
    np.testing.assert_allclose(poses[0], pose(translation=(0, 0, CFG.move_step)), atol=1e-15)
    np.testing.assert_allclose(poses[1], pose(translation=(0, 0, 2 * CFG.move_step)), atol=1e-15)
    np.testing.assert_array_equal(poses[2], poses[1])
    np.testing.assert_array_equal(state.pose, poses[2])


def test_each_key_direction():
    step, yaw, pitch = CFG.move_step, CFG.yaw_step_deg, CFG.pitch_step_deg
    expected = {
        "s": pose(translation=(0, 0, -step)),
        "d": pose(translation=(step, 0, 0)),
        "a": pose(translation=(-step, 0, 0)),
        "l": pose(rotation_y(yaw)),
        "j": pose(rotation_y(-yaw)),
        "i": pose(rotation_x(pitch)),
        "k": pose(rotation_x(-pitch)),
    }
    for key, want in expected.items():
        poses, _ = integrate_actions(CameraState.initial(), [[key]], CFG)
        np.testing.assert_allclose(poses[0], want, atol=1e-15, err_msg=key)
    # OpenCV: +y is down, so looking up (i) gives the forward axis a negative y; turning right (l) a positive x.
    up, _ = integrate_actions(CameraState.initial(), [["i"]], CFG)
    right, _ = integrate_actions(CameraState.initial(), [["l"]], CFG)
    assert up[0, 1, 2] < 0 and right[0, 0, 2] > 0
    # opposite keys cancel
    both, _ = integrate_actions(CameraState.initial(), [["w", "s", "a", "d", "i", "k", "j", "l"]], CFG)
    np.testing.assert_array_equal(both[0], np.eye(4))


def test_yaw_then_w_moves_along_rotated_axis():
    poses, _ = integrate_actions(CameraState.initial(), [["l"], ["l"], ["w"]], CFG)
    angle = math.radians(2 * CFG.yaw_step_deg)
    np.testing.assert_allclose(poses[2, :3, 3], CFG.move_step * np.array([math.sin(angle), 0, math.cos(angle)]),
                               atol=1e-15)
    np.testing.assert_allclose(poses[2, :3, :3], rotation_y(2 * CFG.yaw_step_deg), atol=1e-15)


def test_pitch_does_not_lift_movement_and_composes_as_documented():
    # R' = R_y(yaw) R R_x(pitch): yaw about world up, pitch about the camera's own x axis.
    poses, _ = integrate_actions(CameraState.initial(), [["i", "l"], ["w", "d"]], CFG)
    np.testing.assert_allclose(poses[0, :3, :3], rotation_y(CFG.yaw_step_deg) @ rotation_x(CFG.pitch_step_deg),
                               atol=1e-15)
    yaw = math.radians(CFG.yaw_step_deg)
    forward = np.array([math.sin(yaw), 0, math.cos(yaw)])
    right = np.array([math.cos(yaw), 0, -math.sin(yaw)])
    np.testing.assert_allclose(poses[1, :3, 3], CFG.move_step * (forward + right), atol=1e-15)


def test_pitch_step_past_the_limit_is_dropped_whole():
    """Upstream's clamp: 4-degree steps under an 85-degree limit stop at 84, never a partial step to 85."""
    top = CFG.pitch_step_deg * int(CFG.pitch_limit_deg // CFG.pitch_step_deg)
    assert top == 84.0
    presses = int(CFG.pitch_limit_deg / CFG.pitch_step_deg) + 5
    poses, state = integrate_actions(CameraState.initial(), [["i"]] * presses, CFG)
    assert state.pitch_deg == top
    forward = poses[-1, :3, 2]
    np.testing.assert_allclose(math.degrees(math.asin(-forward[1])), top, atol=1e-9)
    np.testing.assert_allclose(poses[-1], pose(rotation_x(top)), atol=1e-12)
    np.testing.assert_array_equal(poses[-5:], np.broadcast_to(poses[-6], (5, 4, 4)))  # the dropped presses
    # one press down leaves it by exactly one step; the same holds looking down
    poses, state = integrate_actions(state, [["k"]], CFG)
    assert state.pitch_deg == top - CFG.pitch_step_deg
    np.testing.assert_allclose(poses[0], pose(rotation_x(state.pitch_deg)), atol=1e-12)
    _, state = integrate_actions(CameraState.initial(), [["k"]] * presses, CFG)
    assert state.pitch_deg == -top
    # a dropped pitch step still lets yaw and movement of the same frame act
    at_top = CameraState(pose(rotation_x(top)), top)
    poses, state = integrate_actions(at_top, [["i", "l", "w"]], CFG)
    assert state.pitch_deg == top
    np.testing.assert_allclose(poses[0, :3, :3], rotation_y(CFG.yaw_step_deg) @ rotation_x(top), atol=1e-12)
    # a limit the steps land on exactly is reached (a step "passes" the limit only beyond it)
    exact = CameraConfig(pitch_step_deg=5.0, pitch_limit_deg=85.0)
    _, state = integrate_actions(CameraState.initial(), [["i"]] * 20, exact)
    assert state.pitch_deg == 85.0
    # and w at the limit still moves horizontally by one full step
    poses, _ = integrate_actions(CameraState(pose(rotation_x(CFG.pitch_limit_deg)), CFG.pitch_limit_deg),
                                 [["w"]], CFG)
    np.testing.assert_allclose(poses[0, :3, 3], (0, 0, CFG.move_step), atol=1e-15)


def test_integrator_is_pure_and_blockwise_equals_one_shot():
    script = [["w", "l"], ["i"], ["d"], ["j", "s"], ["k", "a"], ["w"], ["i", "i"], [], ["l", "w"]]
    start = CameraState.initial()
    before = start.pose.copy()
    one_shot, final = integrate_actions(start, script, CFG)
    np.testing.assert_array_equal(start.pose, before)
    assert start.pitch_deg == 0.0
    assert not start.pose.flags.writeable
    state, pieces = start, []
    for b in range(0, len(script), FPB):
        block, state = integrate_actions(state, script[b:b + FPB], CFG)
        pieces.append(block)
    np.testing.assert_array_equal(np.concatenate(pieces), one_shot)
    np.testing.assert_array_equal(state.pose, final.pose)
    assert state.pitch_deg == final.pitch_deg
    with pytest.raises(ActionError, match="unknown key 'q'"):
        integrate_actions(start, [["q"]], CFG)


# ---------------------------------------------------------------------------------------------
# Intrinsics and Plücker maps


def test_key_intrinsics_keep_500px_at_any_size_for_the_real_checkpoint():
    """Upstream's realtime path: fx = fy = 500 px at the target size, principal point at the centre."""
    assert CFG.focal_at == "target"
    for width, height in [(832, 480), (224, 128), (1280, 720), (64, 32)]:
        assert intrinsics_for(CFG, width, height) == (500.0, 500.0, width / 2, height / 2)
        # the reference-frame form plucker_block takes comes back to the same pixels
        ref = reference_intrinsics(CFG, 2, width, height)
        scaled = ref * np.array([width / 832, height / 480, width / 832, height / 480])
        np.testing.assert_allclose(scaled, [[500.0, 500.0, width / 2, height / 2]] * 2, rtol=1e-14)
    # at 832x480 both conventions agree exactly
    np.testing.assert_array_equal(reference_intrinsics(CFG, 2), [[500.0, 500.0, 416.0, 240.0]] * 2)
    np.testing.assert_array_equal(reference_intrinsics(CameraConfig(focal_at="reference"), 2),
                                  reference_intrinsics(CFG, 2))


def test_our_presets_may_scale_the_focal_length_instead():
    own = CameraConfig(focal_at="reference")
    fx, fy, cx, cy = intrinsics_for(own, 224, 128)
    assert (cx, cy) == (112.0, 64.0)
    assert fx == pytest.approx(500 * 224 / 832) and fy == pytest.approx(500 * 128 / 480)
    np.testing.assert_array_equal(reference_intrinsics(own, 1, 224, 128), [[500.0, 500.0, 416.0, 240.0]])
    assert EMBEDDED.camera.focal_at == "reference" and LINGBOT_WORLD_V2_14B.camera.focal_at == "target"
    with pytest.raises(ValueError, match="focal_at"):
        CameraConfig(focal_at="scaled")


def test_rollout_key_path_uses_500px_at_the_output_size(monkeypatch):
    """The key path's map at a non-reference size is the map of 500 px intrinsics (not 500 * W / 832)."""
    from lingbot_core.blocks import rollout
    from lingbot_core.boundary.requests import BlockControl

    config = dataclasses.replace(tiny_config(), camera=CFG)
    poses, intrinsics, _ = rollout._block_camera(config, CameraState.initial(),
                                                 BlockControl(actions=(frozenset("w"),) * FPB))
    got = plucker_block(np.eye(4), poses, intrinsics, config.width, config.height, CFG)
    focal = np.tile([500.0 * 832 / config.width, 500.0 * 480 / config.height, 416.0, 240.0], (FPB, 1))
    np.testing.assert_allclose(got.numpy(), plucker_block(np.eye(4), poses, focal, config.width, config.height,
                                                          CFG).numpy(), atol=1e-7)
    x, y = 0, 0  # corner pixel: its ray's slope is (0.5 - W/2) / 500
    direction = got[0, 3:, y, x].double().numpy()
    assert direction[0] / direction[2] == pytest.approx((0.5 - config.width / 2) / 500.0, rel=1e-6)


def reference_plucker(anchor, poses, intrinsics, width, height, cfg):
    """Loop-per-pixel oracle, written straight from the reference description."""
    seq = [anchor] + list(poses)
    rel = [np.linalg.inv(seq[0]) @ p for p in seq]
    deltas = [np.eye(4)] + [np.linalg.inv(rel[i - 1]) @ rel[i] for i in range(1, len(rel))]
    largest = max(np.linalg.norm(d[:3, 3]) for d in deltas)
    out = np.zeros((len(seq), 6, height, width))
    for f, d in enumerate(deltas):
        t = d[:3, 3] / largest if largest > 0 else d[:3, 3]
        if f == 0:
            continue
        fx, fy, cx, cy = intrinsics[f - 1]
        fx, cx = fx * width / cfg.reference_width, cx * width / cfg.reference_width
        fy, cy = fy * height / cfg.reference_height, cy * height / cfg.reference_height
        for y in range(height):
            for x in range(width):
                ray = np.array([(x + 0.5 - cx) / fx, (y + 0.5 - cy) / fy, 1.0])
                ray = d[:3, :3] @ (ray / np.linalg.norm(ray))
                out[f, :3, y, x] = t
                out[f, 3:, y, x] = ray / np.linalg.norm(ray)
    return out[1:]


def test_fresh_identity_anchor_frame0_is_plain_pixel_rays():
    width, height = 6, 4
    poses, _ = integrate_actions(CameraState.initial(), [[], ["w"], ["l"]], CFG)
    maps = plucker_block(np.eye(4), poses, reference_intrinsics(CFG, 3, width, height), width, height, CFG)
    assert maps.dtype == torch.float32 and maps.shape == (3, 6, height, width)
    fx, fy, cx, cy = intrinsics_for(CFG, width, height)
    xs, ys = np.meshgrid(np.arange(width) + 0.5, np.arange(height) + 0.5)
    rays = np.stack([(xs - cx) / fx, (ys - cy) / fy, np.ones_like(xs)])
    rays /= np.linalg.norm(rays, axis=0)
    assert torch.count_nonzero(maps[0, :3]) == 0
    np.testing.assert_allclose(maps[0, 3:].numpy(), rays, atol=1e-7)


def test_hand_computed_two_by_two():
    cfg = CFG
    # Reference intrinsics chosen so that at 2x2 pixels fx = fy = 2 and cx = cy = 1.
    k = [2 * cfg.reference_width / 2, 2 * cfg.reference_height / 2, cfg.reference_width / 2, cfg.reference_height / 2]
    yaw90 = np.array([[0.0, 0, 1], [0, 1, 0], [-1, 0, 0]])
    moved = pose(translation=(3, 0, 4))  # delta 1: translation norm 5 (the largest)
    turned = pose(yaw90, (3, 0, 4))  # delta 2: pure 90 degree yaw
    maps = plucker_block(np.eye(4), np.stack([moved, turned]), np.array([k, k]), 2, 2, cfg).numpy()
    n = math.sqrt(1 + 2 * 0.25**2)
    # pixel centres 0.5, 1.5 -> (x - 1) / 2 = -0.25, +0.25
    plain = np.array([[[-0.25, 0.25], [-0.25, 0.25]],  # x
                      [[-0.25, -0.25], [0.25, 0.25]],  # y
                      [[1.0, 1.0], [1.0, 1.0]]]) / n  # z
    # yaw90 maps (a, b, c) -> (c, b, -a)
    turned_rays = np.stack([plain[2], plain[1], -plain[0]])
    expected = np.zeros((2, 6, 2, 2))
    expected[0, :3] = np.array([0.6, 0.0, 0.8])[:, None, None]
    expected[0, 3:] = plain
    expected[1, 3:] = turned_rays
    np.testing.assert_allclose(maps, expected, atol=1e-7)


def test_plucker_equals_loop_oracle_with_general_anchor_and_intrinsics():
    rng = np.random.default_rng(0)
    anchor = pose(rotation_y(30) @ rotation_x(-10), (1.0, -2.0, 0.5))
    poses = np.stack([anchor @ pose(rotation_y(a) @ rotation_x(b), t)
                      for a, b, t in zip(rng.normal(0, 10, 3), rng.normal(0, 5, 3), rng.normal(0, 0.3, (3, 3)))])
    intr = reference_intrinsics(CFG, 3) * rng.uniform(0.8, 1.2, (3, 4))
    got = plucker_block(anchor, poses, intr, 7, 5, CFG).numpy()
    np.testing.assert_allclose(got, reference_plucker(anchor, poses, intr, 7, 5, CFG), atol=1e-6)


def test_blockwise_maps_with_carried_anchor_equal_direct_maps():
    script = [["w"], ["w", "l"], ["i"], [], [], [], ["d", "k"], ["j"], ["s", "w"]]
    width, height = 8, 4
    all_poses, _ = integrate_actions(CameraState.initial(), script, CFG)
    state = CameraState.initial()
    for b in range(len(script) // FPB):
        anchor = state.pose
        block, state = integrate_actions(state, script[b * FPB:(b + 1) * FPB], CFG)
        intr = reference_intrinsics(CFG, FPB)
        got = plucker_block(anchor, block, intr, width, height, CFG).numpy()
        direct_anchor = np.eye(4) if b == 0 else all_poses[b * FPB - 1]
        direct = reference_plucker(direct_anchor, all_poses[b * FPB:(b + 1) * FPB], intr, width, height, CFG)
        np.testing.assert_allclose(got, direct, atol=1e-6)
        if b == 1:  # a block with no motion: zero origins, no division by zero
            assert np.all(got[:, :3] == 0)


def test_trajectory_blocks_anchor_and_split():
    poses = np.stack([pose(translation=(i, 0, 0)) for i in range(2 * FPB)])
    intr = reference_intrinsics(CFG, 2 * FPB)
    blocks = trajectory_blocks(poses, intr, 2, FPB)
    np.testing.assert_array_equal(blocks[0].anchor, poses[0])
    np.testing.assert_array_equal(blocks[1].anchor, poses[FPB - 1])
    np.testing.assert_array_equal(np.concatenate([b.poses for b in blocks]), poses)
    first = plucker_block(*blocks[0], 4, 4, CFG).numpy()
    assert np.all(first[0, :3] == 0)  # the trajectory's own first pose is its own anchor
    with pytest.raises(TrajectoryError, match="need 9"):
        trajectory_blocks(poses, intr, 3, FPB)


# ---------------------------------------------------------------------------------------------
# A trajectory file as upstream prepares it: truncate, take to latent frames, normalise once


def upstream_trajectory_embedding(pixel_poses, intrinsics, num_frames, width, height, cfg):
    """One-shot oracle written from upstream's offline path (the official generate and vLLM-Omni):
    truncate to num_frames, sample one pose per latent frame, make relative to the first, framewise
    deltas, divide every translation by the largest over the WHOLE trajectory, embed all frames at once."""
    poses = pixel_poses[:num_frames]
    latent = (num_frames - 1) // 4 + 1
    idx = np.linspace(0, num_frames - 1, latent)
    assert np.all(idx == np.round(idx))  # the counts line up: every sample is a file frame
    poses, k = poses[idx.astype(int)], intrinsics[:num_frames][idx.astype(int)]
    rel = np.linalg.inv(poses[0]) @ poses
    rel[0] = np.eye(4)
    deltas = rel.copy()
    deltas[1:] = np.linalg.inv(rel[:-1]) @ rel[1:]
    largest = np.linalg.norm(deltas[:, :3, 3], axis=-1).max()
    if largest > 0:
        deltas[:, :3, 3] /= largest
    out = np.zeros((latent, 6, height, width))
    xs, ys = np.meshgrid(np.arange(width) + 0.5, np.arange(height) + 0.5)
    for f in range(latent):
        fx, cx = k[f, 0] * width / cfg.reference_width, k[f, 2] * width / cfg.reference_width
        fy, cy = k[f, 1] * height / cfg.reference_height, k[f, 3] * height / cfg.reference_height
        rays = np.stack([(xs - cx) / fx, (ys - cy) / fy, np.ones_like(xs)], -1)
        rays /= np.linalg.norm(rays, axis=-1, keepdims=True)
        rays = rays @ deltas[f, :3, :3].T
        out[f, :3] = deltas[f, :3, 3][:, None, None]
        out[f, 3:] = np.moveaxis(rays, -1, 0)
    return out


def official_style_poses(frames: int, seed: int = 0) -> np.ndarray:
    """A walk like the official examples': real-world scale (~100 units in all), slow then fast, turning."""
    rng = np.random.default_rng(seed)
    speed = np.where(np.arange(frames) < frames // 2, 0.02, 0.2)  # the first half crawls
    yaw = np.cumsum(rng.normal(0, 0.3, frames))
    position = np.cumsum(np.stack([np.sin(np.radians(yaw)), 0.01 * rng.normal(size=frames),
                                   np.cos(np.radians(yaw))], -1) * speed[:, None], axis=0)
    offset = pose(rotation_y(40.0) @ rotation_x(-5.0), (120.0, -3.0, 75.0))  # an arbitrary world frame
    return np.stack([offset @ pose(rotation_y(a) @ rotation_x(2 * math.sin(i / 50)), t)
                     for i, (a, t) in enumerate(zip(yaw, position))])


def test_trajectory_is_normalised_over_the_whole_trajectory_like_upstream():
    frames, width, height = 57, 8, 6  # 57 = 12 * 5 - 3: five blocks
    poses = official_style_poses(frames)
    intr = np.tile([480.0, 510.0, 410.0, 236.0], (frames, 1)) + np.linspace(0, 8, frames)[:, None]
    plan = plan_trajectory(poses, intr, FPB, 4)
    assert len(plan.blocks) == 5 and plan.frames_used == frames and plan.frames_dropped == 0
    got = np.concatenate([plucker_block(b.anchor, b.poses, b.intrinsics, width, height, CFG,
                                        plan.translation_scale).numpy() for b in plan.blocks])
    oracle = upstream_trajectory_embedding(poses, intr, frames, width, height, CFG)
    np.testing.assert_allclose(got, oracle, atol=2e-6)
    # The slow first blocks stay slow: per-block normalisation would have made them full speed.
    step = np.linalg.norm(got[:, :3, 0, 0], axis=1)  # each latent frame's normalised step
    assert step[1:6].max() < 0.2 and step.max() == pytest.approx(1.0, abs=1e-6)
    per_block = plucker_block(plan.blocks[0].anchor, plan.blocks[0].poses, plan.blocks[0].intrinsics, width,
                              height, CFG).numpy()
    assert np.linalg.norm(per_block[:, :3, 0, 0], axis=1).max() == pytest.approx(1.0, abs=1e-6)
    np.testing.assert_allclose(per_block[:, 3:], got[:FPB, 3:], atol=1e-6)  # directions agree either way
    # the scale is the trajectory's largest latent-frame step
    latent = poses[::4]
    assert plan.translation_scale == pytest.approx(
        max(np.linalg.norm((np.linalg.inv(a) @ b)[:3, 3]) for a, b in zip(latent[:-1], latent[1:])), rel=1e-12)
    assert trajectory_translation_scale(np.broadcast_to(poses[0], (4, 4, 4))) == 0.0


def test_a_still_trajectory_has_no_motion_and_no_division_by_zero():
    poses = np.broadcast_to(pose(rotation_y(10), (5, 0, 5)), (21, 4, 4))
    plan = plan_trajectory(poses, reference_intrinsics(CFG, 21), FPB, 4)
    assert plan.translation_scale == 0.0
    maps = [plucker_block(b.anchor, b.poses, b.intrinsics, 4, 4, CFG, plan.translation_scale) for b in plan.blocks]
    assert all(torch.count_nonzero(m[:, :3]) == 0 for m in maps)
    with pytest.raises(ValueError, match="translation_scale"):
        plucker_block(np.eye(4), poses[:3], reference_intrinsics(CFG, 3), 4, 4, CFG, float("nan"))


@pytest.mark.parametrize("frames,num_blocks,blocks,used,dropped", [
    (961, 10, 10, 117, 844),  # --blocks 10 on an official 961-frame file: its first 117 frames, ~4 a latent frame
    (961, None, 80, 957, 4),  # no block count: the whole blocks it covers, rounding down
    (241, None, 20, 237, 4),  # 241 frames -> 61 latent frames -> 20 whole blocks (upstream rounds down)
    (9, None, 1, 9, 0),
    (20, None, 1, 9, 11),
    (21, None, 2, 21, 0),
    (4125, None, 344, 4125, 0),
])
def test_truncation_for_a_requested_frame_count(frames, num_blocks, blocks, used, dropped):
    poses = np.stack([pose(rotation_y(0.1 * i), (0, 0, i)) for i in range(frames)])
    intr = reference_intrinsics(CFG, frames)
    plan = plan_trajectory(poses, intr, FPB, 4, num_blocks)
    assert (len(plan.blocks), plan.frames_used, plan.frames_dropped) == (blocks, used, dropped)
    latent = np.concatenate([b.poses for b in plan.blocks])
    np.testing.assert_array_equal(latent, poses[0:used:4])  # exact file frames, 4 apart
    assert plan.translation_scale == pytest.approx(4.0)  # the file moves 1 a frame, so 4 a latent frame


def test_too_short_trajectories_are_refused_not_stretched():
    intr = reference_intrinsics(CFG, 20)
    poses = np.broadcast_to(np.eye(4), (20, 4, 4))
    with pytest.raises(TrajectoryError, match="the trajectory has 8 frames; one block needs 9"):
        plan_trajectory(poses[:8], intr[:8], FPB, 4)
    with pytest.raises(TrajectoryError, match=r"2 blocks need 21 trajectory frames; the trajectory has 20 "
                                              r"\(enough for 1 blocks\)"):
        plan_trajectory(poses, intr, FPB, 4, 2)
    with pytest.raises(ValueError, match="positive integer"):
        plan_trajectory(poses, intr, FPB, 4, 0)


# ---------------------------------------------------------------------------------------------
# SLERP resampling


def test_resample_endpoints_exact_and_midpoint_of_90_degree_yaw():
    poses = np.stack([pose(translation=(0, 0, 0)), pose(rotation_y(90), (2.0, 0, 4.0))])
    intr = np.array([[500.0, 500, 416, 240], [600.0, 400, 400, 200]])
    out_p, out_k = resample_trajectory(poses, intr, 3)
    np.testing.assert_array_equal(out_p[0], poses[0])
    np.testing.assert_array_equal(out_p[-1], poses[-1])
    np.testing.assert_allclose(out_p[1], pose(rotation_y(45), (1.0, 0, 2.0)), atol=1e-12)
    np.testing.assert_allclose(out_k[1], [550, 450, 408, 220])
    same_p, same_k = resample_trajectory(poses, intr, 2)
    np.testing.assert_array_equal(same_p, poses)
    np.testing.assert_array_equal(same_k, intr)


def test_resample_takes_short_arc_and_matches_per_segment_slerp():
    # yaw 0 -> 170 -> -170 (i.e. +190): the second segment must pass through 180, not back through 0.
    poses = np.stack([pose(rotation_y(a)) for a in (0, 170, -170)])
    intr = reference_intrinsics(CFG, 3)
    out, _ = resample_trajectory(poses, intr, 5)  # samples at 0, 0.5, 1, 1.5, 2
    np.testing.assert_allclose(out[1], pose(rotation_y(85)), atol=1e-12)
    np.testing.assert_allclose(out[3], pose(rotation_y(180)), atol=1e-12)
    down, _ = resample_trajectory(out, reference_intrinsics(CFG, 5), 3)
    np.testing.assert_allclose(down, poses, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# Trajectory files


def good_arrays(frames: int):
    angles = np.linspace(0, 60, frames)
    poses = np.stack([pose(rotation_y(a), (0.01 * i, 0, 0.05 * i)) for i, a in enumerate(angles)])
    return poses, reference_intrinsics(CFG, frames)


def write_npy(path, array, version=(1, 0)):
    with open(path, "wb") as fp:
        np.lib.format.write_array(fp, np.asarray(array), version=version)


@pytest.fixture
def root(tmp_path):
    r = tmp_path / "root"
    (r / "traj").mkdir(parents=True)
    return r


@pytest.mark.parametrize("version", [(1, 0), (2, 0)])
def test_good_files_load(root, version):
    poses, intr = good_arrays(5)
    write_npy(root / "traj" / "poses.npy", poses.astype(np.float32), version)
    write_npy(root / "traj" / "intrinsics.npy", intr.astype(np.int32), version)
    got_p, got_k = load_trajectory(root / "traj" / "poses.npy", "traj/intrinsics.npy", root)
    assert got_p.dtype == np.float64 and got_k.dtype == np.float64
    np.testing.assert_array_equal(got_p, poses.astype(np.float32))
    np.testing.assert_array_equal(got_k, intr.astype(np.int32))


def test_fortran_order_and_big_endian_load(root):
    poses, intr = good_arrays(4)
    write_npy(root / "p.npy", np.asfortranarray(poses))
    write_npy(root / "k.npy", intr.astype(">f8"))
    got_p, got_k = load_trajectory("p.npy", "k.npy", root)
    np.testing.assert_array_equal(got_p, poses)
    np.testing.assert_array_equal(got_k, intr)


def test_129_frames_load_and_resample_without_cap(root):
    poses, intr = good_arrays(129)
    write_npy(root / "p.npy", poses)
    write_npy(root / "k.npy", intr)
    got_p, got_k = load_trajectory("p.npy", "k.npy", root)
    assert len(got_p) == 129
    num_latent = 45 * FPB  # more than the 30 latent frames an old cap allowed
    out_p, out_k = resample_trajectory(got_p, got_k, num_latent)
    assert out_p.shape == (num_latent, 4, 4) and out_k.shape == (num_latent, 4)
    np.testing.assert_array_equal(out_p[[0, -1]], poses[[0, -1]])
    # poses are a uniform yaw sweep, so the resampled yaw is uniform too
    yaws = np.degrees(np.arctan2(out_p[:, 0, 2], out_p[:, 2, 2]))
    np.testing.assert_allclose(yaws, np.linspace(0, 60, num_latent), atol=1e-9)
    blocks = trajectory_blocks(out_p, out_k, 45, FPB)
    assert len(blocks) == 45


def npy_bytes(array, version=(1, 0)) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.asarray(array), version=version, allow_pickle=True)
    return buf.getvalue()


def raw_npy(header: str, version: int, payload: bytes) -> bytes:
    length_fmt = "<H" if version == 1 else "<I"
    return b"\x93NUMPY" + bytes([version, 0]) + struct.pack(length_fmt, len(header)) + header.encode() + payload


GOOD_P, GOOD_K = good_arrays(3)


def _v3():
    data = npy_bytes(GOOD_P, (2, 0))
    return data[:6] + bytes([3, 0]) + data[8:]


BAD_POSES = {
    "v3 header": (_v3(), "version 3.0"),
    "object dtype": (npy_bytes(np.array([None] * 48, dtype=object).reshape(3, 4, 4)), "dtype object"),
    "pickled": (pickle.dumps(GOOD_P), "not an NPY file"),
    "complex dtype": (npy_bytes(GOOD_P.astype(complex)), "dtype complex128"),
    "bool dtype": (npy_bytes(GOOD_P > 0), "dtype bool"),
    "structured dtype": (npy_bytes(np.zeros((3, 4, 4), dtype=[("a", "<f8")])), "dtype"),
    "truncated": (npy_bytes(GOOD_P)[:-8], "does not match its header"),
    "trailing bytes": (npy_bytes(GOOD_P) + b"\0" * 8, "does not match its header"),
    "NaN": (npy_bytes(np.where(np.arange(48).reshape(3, 4, 4) == 20, np.nan, GOOD_P)), "frame 1 has a non-finite"),
    "inf": (npy_bytes(np.where(np.arange(48).reshape(3, 4, 4) == 47, np.inf, GOOD_P)), "frame 2 has a non-finite"),
    "F=0": (npy_bytes(np.zeros((0, 4, 4))), "has no frames"),
    "wrong shape": (npy_bytes(GOOD_P[:, :3]), r"shape \[3, 3, 4\] is wrong"),
    "wrong rank": (npy_bytes(GOOD_P.reshape(3, 16)), r"shape \[3, 16\] is wrong"),
    "singular rotation": (npy_bytes(np.zeros((3, 4, 4))), "frame 0 rotation is singular"),
    "huge header": (raw_npy("{" + " " * (CFG.max_npy_header_bytes + 10) + "}", 2, b""), "exceeds the limit"),
    "header length past the file": (raw_npy("", 2, b"")[:-4] + struct.pack("<I", 1000), "bad NPY header"),
    "garbage header": (raw_npy("{'descr': __import__('os')}\n", 1, b""), "bad NPY header"),
    "empty file": (b"", "not an NPY file"),
}


@pytest.mark.parametrize("case", sorted(BAD_POSES))
def test_bad_pose_file_refused_and_left_intact(root, case):
    data, fragment = BAD_POSES[case]
    bad = root / "traj" / "poses.npy"
    bad.write_bytes(data)
    intr_count = 0 if case == "F=0" else 3
    write_npy(root / "traj" / "intrinsics.npy", reference_intrinsics(CFG, max(intr_count, 1)))
    with pytest.raises(TrajectoryError, match=fragment) as err:
        load_trajectory(bad, root / "traj" / "intrinsics.npy", root)
    assert "poses.npy" in str(err.value)
    assert bad.read_bytes() == data


def test_a_4125_frame_trajectory_loads_through_the_file_path(root):
    """No frame cap: upstream validated a 344-block, 4,125-frame rollout. The bound is bytes."""
    frames = 4125
    poses, intr = good_arrays(frames)
    write_npy(root / "traj" / "poses.npy", poses)
    write_npy(root / "traj" / "intrinsics.npy", intr)
    got_p, got_k = load_trajectory("traj/poses.npy", "traj/intrinsics.npy", root)
    np.testing.assert_array_equal(got_p, poses)
    np.testing.assert_array_equal(got_k, intr)
    plan = plan_trajectory(got_p, got_k, frames_per_block=3, temporal_factor=4)
    assert len(plan.blocks) == 344 and plan.frames_used == 12 * 344 - 3 == 4125 and plan.frames_dropped == 0
    validate_trajectory(poses, intr)  # arrays from elsewhere obey the same (byte) bound


def test_trajectory_files_are_bounded_by_bytes(root):
    small = CameraConfig(max_trajectory_file_bytes=65 * 128 - 1)  # not quite 65 float64 poses
    poses, intr = good_arrays(65)
    write_npy(root / "p.npy", poses)
    write_npy(root / "k.npy", intr)
    data = (root / "p.npy").read_bytes()
    with pytest.raises(TrajectoryError, match=rf"p.npy: file of {len(data)} bytes exceeds the limit of"):
        load_trajectory("p.npy", "k.npy", root, small)
    assert (root / "p.npy").read_bytes() == data
    with pytest.raises(TrajectoryError, match="65 frames take 8320 bytes as float64; the limit is 8319"):
        validate_trajectory(poses, intr, small)
    # float32 halves the bytes, so more frames fit the same bound
    write_npy(root / "p.npy", poses.astype(np.float32))
    write_npy(root / "k.npy", intr.astype(np.float32))
    assert len(load_trajectory("p.npy", "k.npy", root, small)[0]) == 65


def test_bad_intrinsics_refused(root):
    write_npy(root / "p.npy", GOOD_P)
    for data, fragment in [(npy_bytes(GOOD_K[:, :3]), r"shape \[3, 3\] is wrong"),
                           (npy_bytes(GOOD_K * np.array([0, 1, 1, 1])), "focal lengths must be positive")]:
        (root / "k.npy").write_bytes(data)
        with pytest.raises(TrajectoryError, match=fragment) as err:
            load_trajectory("p.npy", "k.npy", root)
        assert "k.npy" in str(err.value)


def test_mismatched_frame_counts(root):
    write_npy(root / "p.npy", GOOD_P)
    write_npy(root / "k.npy", reference_intrinsics(CFG, 4))
    with pytest.raises(TrajectoryError, match="p.npy has 3 frames but k.npy has 4"):
        load_trajectory("p.npy", "k.npy", root)


def test_symlinks_refused(root, tmp_path):
    write_npy(root / "traj" / "poses.npy", GOOD_P)
    write_npy(root / "traj" / "intrinsics.npy", GOOD_K)
    os.symlink(root / "traj" / "poses.npy", root / "link.npy")
    with pytest.raises(TrajectoryError, match="link.npy is a symlink"):
        load_trajectory("link.npy", "traj/intrinsics.npy", root)
    os.symlink(root / "traj", root / "linkdir")
    with pytest.raises(TrajectoryError, match="linkdir is a symlink"):
        load_trajectory("linkdir/poses.npy", "traj/intrinsics.npy", root)
    # a symlink pointing outside the root is refused as a symlink before anything is read
    outside = tmp_path / "outside.npy"
    write_npy(outside, GOOD_P)
    os.symlink(outside, root / "escape.npy")
    with pytest.raises(TrajectoryError, match="symlink"):
        load_trajectory("escape.npy", "traj/intrinsics.npy", root)
    assert (root / "traj" / "poses.npy").exists() and outside.exists()


def test_paths_outside_root_refused(root, tmp_path):
    write_npy(root / "traj" / "intrinsics.npy", GOOD_K)
    outside = tmp_path / "poses.npy"
    write_npy(outside, GOOD_P)
    for path in (outside, "../poses.npy", root / "traj" / ".." / ".." / "poses.npy"):
        with pytest.raises(TrajectoryError, match="outside the folder files are taken from") as caught:
            load_trajectory(path, "traj/intrinsics.npy", root)
        assert str(tmp_path) not in str(caught.value)  # a server's folders are not told to its visitors
    with pytest.raises(TrajectoryError, match="cannot be read"):
        load_trajectory("traj/missing.npy", "traj/intrinsics.npy", root)
    with pytest.raises(TrajectoryError, match="not a regular file"):
        load_trajectory("traj", "traj/intrinsics.npy", root)


def test_validate_trajectory_for_arrays_from_elsewhere():
    p, k = validate_trajectory(GOOD_P.tolist(), GOOD_K)
    np.testing.assert_array_equal(p, GOOD_P)
    reflected = GOOD_P.copy()
    reflected[1, :3, 0] *= -1
    cases = [
        ((GOOD_P, GOOD_K[:2]), "poses has 3 frames but intrinsics has 2"),
        ((np.where(np.isclose(GOOD_P, 1), np.nan, GOOD_P), GOOD_K), "frame 0 has a non-finite"),
        ((GOOD_P * np.array([1, 1, 0, 1])[:, None], GOOD_K), "frame 0 rotation is singular"),
        ((reflected, GOOD_K), "frame 1 rotation is singular or reflected"),
        ((GOOD_P.astype(object), GOOD_K), "dtype object"),
        ((GOOD_P[:, :3], GOOD_K), "shape"),
    ]
    for args, fragment in cases:
        with pytest.raises(TrajectoryError, match=fragment):
            validate_trajectory(*args)


# ---------------------------------------------------------------------------------------------
# A camera that does not move has exactly zero translation (fidelity audit 2, N1). Upstream inverts
# poses rigidly ([R^T, -R^T t]: vLLM-Omni, the official SE3_inverse, SGLang's se3_inverse) and gets 0;
# a general matrix inverse left 1e-17 .. 1e-30 there, which the per-block normalisation scaled up to a
# unit step, so a turn read as a full-speed walk.


def _key_blocks(script, state=None, cfg=CFG):
    """[(anchor, poses)] of a session driven block by block by `script`: one key set per latent frame."""
    state = state or CameraState.initial()
    blocks = []
    for frames in script:
        poses, next_state = integrate_actions(state, frames, cfg)
        blocks.append((state.pose, poses))
        state = next_state
    return blocks, state


def _origins(anchor, poses, scale=None):
    return plucker_block(anchor, poses, reference_intrinsics(CFG, len(poses), 8, 6), 8, 6, CFG, scale)[:, :3]


def test_a_turn_after_a_walk_has_exactly_zero_translation():
    j, w = [{"j"}] * FPB, [{"w"}] * FPB
    blocks, _ = _key_blocks([j, w, j])
    maps = [_origins(a, p) for a, p in blocks]
    assert torch.count_nonzero(maps[0]) == 0 and torch.count_nonzero(maps[2]) == 0
    # the walk itself is a unit step forward on each frame
    np.testing.assert_allclose(maps[1][:, :, 0, 0].numpy(), np.tile([0.0, 0.0, 1.0], (FPB, 1)), atol=1e-7)


def test_random_key_sessions_give_no_translation_to_blocks_without_moves():
    moves = set("wasd")
    checked = 0
    for seed in range(12):
        rng = np.random.default_rng(seed)
        script = []
        for _ in range(60):
            kind = rng.random()
            if kind < 0.3:
                keys = [set()] * FPB
            elif kind < 0.6:
                keys = [set(rng.choice(list("ijkl"), size=rng.integers(1, 3), replace=False))] * FPB
            else:
                keys = [set(rng.choice(list("wasdijkl"), size=rng.integers(0, 3), replace=False)) for _ in range(FPB)]
            script.append(keys)
        blocks, _ = _key_blocks(script)
        for frames, (anchor, poses) in zip(script, blocks):
            if not any(moves & set(keys) for keys in frames):
                assert torch.count_nonzero(_origins(anchor, poses)) == 0
                checked += 1
    assert checked > 300


def test_the_still_map_of_action_guidance_is_still_in_every_state():
    from lingbot_core.config import EMBEDDED
    from lingbot_core.blocks.rollout import _still_plucker
    rng = np.random.default_rng(1)
    state = CameraState.initial()
    intrinsics = reference_intrinsics(EMBEDDED.camera, FPB, EMBEDDED.width, EMBEDDED.height)
    for _ in range(500):
        keys = [set(rng.choice(list("wasdijkl"), size=rng.integers(0, 3), replace=False)) for _ in range(FPB)]
        _, state = integrate_actions(state, keys, EMBEDDED.camera)
        still = _still_plucker(EMBEDDED, state, intrinsics, "cpu", torch.float32)
        assert torch.count_nonzero(still[:, :, :3]) == 0


def test_pose_files_that_pan_in_place_have_no_translation():
    for seed in range(20):
        rng = np.random.default_rng(seed)
        frames = 12 * int(rng.integers(1, 5)) - 3
        where = rng.normal(0, 10.0 ** rng.integers(-2, 4), 3)  # the camera's fixed place, at any scale
        yaw, pitch = np.cumsum(rng.normal(0, 2.0, frames)), np.cumsum(rng.normal(0, 1.0, frames))
        offset = pose(rotation_y(rng.uniform(-180, 180)) @ rotation_x(rng.uniform(-30, 30)))
        poses = np.stack([offset @ pose(rotation_y(a) @ rotation_x(b)) for a, b in zip(yaw, pitch)])
        poses[:, :3, 3] = where
        plan = plan_trajectory(poses.astype(np.float32).astype(np.float64), reference_intrinsics(CFG, frames), FPB, 4)
        assert plan.translation_scale == 0.0
        for block in plan.blocks:
            assert torch.count_nonzero(_origins(block.anchor, block.poses, plan.translation_scale)) == 0
            assert torch.count_nonzero(_origins(block.anchor, block.poses)) == 0  # per-block normalisation too


def test_the_rigid_inverse_equals_the_general_one_on_moving_paths():
    poses = official_style_poses(120, seed=3)
    from lingbot_core.model import camera
    np.testing.assert_allclose(camera._relative_to(poses[0], poses), np.linalg.inv(poses[0]) @ poses, atol=1e-9)
    np.testing.assert_allclose(camera._steps(poses), np.linalg.inv(poses[:-1]) @ poses[1:], atol=1e-9)


def test_error_messages_name_files_without_their_folders(root):
    """Hardening 2 (minor): an NPY error quotes the file's name, never the server path it was stored under."""
    deep = root / ("x" * 40) / ("y" * 40)
    deep.mkdir(parents=True)
    write_npy(deep / "poses.npy", GOOD_P[:, :3])  # a wrong shape
    write_npy(deep / "intrinsics.npy", GOOD_K)
    with pytest.raises(TrajectoryError) as caught:
        load_trajectory(deep / "poses.npy", deep / "intrinsics.npy", root)
    message = str(caught.value)
    assert message.startswith("poses.npy: shape") and str(root) not in message and "xxxx" not in message


def test_a_long_file_is_cut_before_its_frames_are_checked(root):
    """Only the frames a video uses are checked: a bad frame after them does not refuse the file (upstream
    drops those frames), and the file's whole frame count is still told."""
    poses = np.repeat(GOOD_P[:1], 100, axis=0)
    poses[90, 0, 0] = np.nan
    write_npy(root / "p.npy", poses)
    write_npy(root / "k.npy", reference_intrinsics(CFG, 100))
    from lingbot_core.model.camera import read_trajectory
    p, k, frames = read_trajectory("p.npy", "k.npy", root, CFG, max_frames=21)
    assert p.shape == (21, 4, 4) and k.shape == (21, 4) and frames == 100
    with pytest.raises(TrajectoryError, match="frame 90 has a non-finite value"):
        read_trajectory("p.npy", "k.npy", root, CFG)
