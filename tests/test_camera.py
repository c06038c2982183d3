"""Camera path: action integrator, Plücker maps, hardened trajectory files, SLERP resampling."""

from __future__ import annotations

import io
import math
import os
import pickle
import struct

import numpy as np
import pytest
import torch

from lingbot_core.config import CameraConfig, tiny_config
from lingbot_core.model.camera import (
    ActionError,
    CameraState,
    TrajectoryError,
    VALID_KEYS,
    integrate_actions,
    intrinsics_for,
    load_trajectory,
    plucker_block,
    reference_intrinsics,
    resample_trajectory,
    rotation_x,
    rotation_y,
    trajectory_blocks,
    validate_frame_actions,
    validate_trajectory,
)

CFG = CameraConfig()
FPB = tiny_config().transformer.num_frames_per_block


def pose(rotation=np.eye(3), translation=(0.0, 0.0, 0.0)) -> np.ndarray:
    out = np.eye(4)
    out[:3, :3] = rotation
    out[:3, 3] = translation
    return out


# ---------------------------------------------------------------------------------------------
# Actions


def test_validate_frame_actions_accepts_and_normalises():
    out = validate_frame_actions([["w", "d"], [], ("i", "i")], 3)
    assert out == (frozenset("wd"), frozenset(), frozenset("i"))
    assert VALID_KEYS == frozenset("wasdijkl")


@pytest.mark.parametrize("frames, fragment", [
    ("www", "got str"),
    ({"frames": []}, "got dict"),
    ([["w"], ["w"]], "exactly 3"),
    ([["w"]] * 4, "exactly 3"),
    ([["w"], ["x"], []], "unknown key 'x'"),
    ([["w"], ["W"], []], "unknown key 'W'"),
    ([["w"], [1], []], "non-string key 1"),
    ([["w"], "wd", []], "frame 1 must be a list"),
    ([["w"], None, []], "frame 1 must be a list"),
])
def test_validate_frame_actions_refuses(frames, fragment):
    with pytest.raises(ActionError, match=fragment.replace("(", r"\(")):
        validate_frame_actions(frames, 3)


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


def test_pitch_clamps_at_limit_and_state_tracks_it():
    presses = int(CFG.pitch_limit_deg / CFG.pitch_step_deg) + 5
    poses, state = integrate_actions(CameraState.initial(), [["i"]] * presses, CFG)
    assert state.pitch_deg == CFG.pitch_limit_deg
    forward = poses[-1, :3, 2]
    np.testing.assert_allclose(math.degrees(math.asin(-forward[1])), CFG.pitch_limit_deg, atol=1e-9)
    np.testing.assert_allclose(poses[-1], pose(rotation_x(CFG.pitch_limit_deg)), atol=1e-12)
    # one press down leaves the limit by exactly one step
    poses, state = integrate_actions(state, [["k"]], CFG)
    assert state.pitch_deg == CFG.pitch_limit_deg - CFG.pitch_step_deg
    np.testing.assert_allclose(poses[0], pose(rotation_x(state.pitch_deg)), atol=1e-12)
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


def test_intrinsics_scale_with_resolution():
    assert intrinsics_for(CFG, CFG.reference_width, CFG.reference_height) == (
        CFG.focal_px, CFG.focal_px, CFG.reference_width / 2, CFG.reference_height / 2)
    fx, fy, cx, cy = intrinsics_for(CFG, 224, 128)
    assert (cx, cy) == (112.0, 64.0)
    assert fx == pytest.approx(CFG.focal_px * 224 / CFG.reference_width)
    assert fy == pytest.approx(CFG.focal_px * 128 / CFG.reference_height)
    np.testing.assert_array_equal(reference_intrinsics(CFG, 2),
                                  [[CFG.focal_px, CFG.focal_px, CFG.reference_width / 2, CFG.reference_height / 2]] * 2)


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
    maps = plucker_block(np.eye(4), poses, reference_intrinsics(CFG, 3), width, height, CFG)
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
    "F=0": (npy_bytes(np.zeros((0, 4, 4))), "has 0 frames"),
    "F=4097": (npy_bytes(np.broadcast_to(np.eye(4), (4097, 4, 4))), "has 4097 frames"),
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
    intr_count = 4097 if case == "F=4097" else 0 if case == "F=0" else 3
    write_npy(root / "traj" / "intrinsics.npy", reference_intrinsics(CFG, max(intr_count, 1)))
    with pytest.raises(TrajectoryError, match=fragment) as err:
        load_trajectory(bad, root / "traj" / "intrinsics.npy", root)
    assert "poses.npy" in str(err.value)
    assert bad.read_bytes() == data


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
        with pytest.raises(TrajectoryError, match="outside the trusted root"):
            load_trajectory(path, "traj/intrinsics.npy", root)
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
