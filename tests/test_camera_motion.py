"""Camera commands stepped per latent frame (camera_motion.py): velocity and target, as vLLM-Omni's [CAM] does."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lingbot_core.model.camera import rotation_x, rotation_y
from lingbot_core.model.camera_motion import (
    CameraMotion,
    advance,
    matrix_quaternion,
    nlerp,
    pose_matrix,
    quaternion_matrix,
)

IDENTITY_Q = (0.0, 0.0, 0.0, 1.0)


def axis_quaternion(axis: str, deg: float) -> tuple[float, float, float, float]:
    half = math.radians(deg) / 2
    v = {"x": (1, 0, 0), "y": (0, 1, 0), "z": (0, 0, 1)}[axis]
    return (*(math.sin(half) * c for c in v), math.cos(half))


def assert_rigid(poses: np.ndarray, tol: float = 1e-9) -> None:
    for pose in poses.reshape(-1, 4, 4):
        r = pose[:3, :3]
        assert np.abs(r.T @ r - np.eye(3)).max() < tol
        assert abs(np.linalg.det(r) - 1) < tol
        assert np.array_equal(pose[3], [0.0, 0.0, 0.0, 1.0])


# ---------------------------------------------------------------- quaternions


def test_quaternion_matrix_is_the_standard_right_hand_formula_and_normalises():
    np.testing.assert_allclose(quaternion_matrix(axis_quaternion("x", 4)), rotation_x(4), atol=1e-15)
    np.testing.assert_allclose(quaternion_matrix(axis_quaternion("y", 6)), rotation_y(6), atol=1e-15)
    scaled = [7 * c for c in axis_quaternion("y", 30)]
    np.testing.assert_allclose(quaternion_matrix(scaled), rotation_y(30), atol=1e-15)
    np.testing.assert_allclose(quaternion_matrix([1e300, 0, 0, 1e300]), rotation_x(90), atol=1e-15)  # no overflow


@pytest.mark.parametrize("q", [(0, 0, 0, 0), (0, 0, math.nan, 1), (math.inf, 0, 0, 1), (0, 0, 1), "abcd"])
def test_quaternion_matrix_refuses_zero_and_non_finite(q):
    with pytest.raises(ValueError):
        quaternion_matrix(q)


def test_matrix_quaternion_round_trips_at_every_angle():
    rng = np.random.default_rng(1)
    quats = list(rng.normal(size=(200, 4))) + [np.array(axis_quaternion(a, 180)) for a in "xyz"]
    for q in quats:
        q = q / np.linalg.norm(q)
        back = matrix_quaternion(quaternion_matrix(q))
        assert back[3] >= 0
        assert min(np.abs(back - q).max(), np.abs(back + q).max()) < 1e-12


def test_nlerp_takes_the_shorter_arc_and_stays_unit():
    a, b = np.array(IDENTITY_Q), -np.array(axis_quaternion("y", 90))  # b given on the far hemisphere
    mid = nlerp(a, b, 0.5)
    assert abs(np.linalg.norm(mid) - 1) < 1e-15
    np.testing.assert_allclose(quaternion_matrix(mid), rotation_y(45), atol=1e-15)


# ---------------------------------------------------------------- velocity


def test_velocity_forward_held_one_chunk_moves_0_15():
    poses, motion = advance(CameraMotion.velocity([0, 0, 0.05], IDENTITY_Q), np.eye(4), 3)
    np.testing.assert_allclose(poses[:, :3, 3], [[0, 0, 0.05], [0, 0, 0.10], [0, 0, 0.15]], atol=1e-15)
    np.testing.assert_allclose(poses[:, :3, :3], np.broadcast_to(np.eye(3), (3, 3, 3)), atol=1e-15)
    assert motion is not None and motion.mode == "velocity"  # a velocity is held until replaced
    again, _ = advance(motion, poses[-1], 1)
    np.testing.assert_allclose(again[0, :3, 3], [0, 0, 0.20], atol=1e-15)


def test_velocity_composes_in_the_cameras_local_frame():
    start = np.eye(4)
    start[:3, :3] = rotation_y(90)  # looking along world +x
    start[:3, 3] = [1.0, 2.0, 3.0]
    poses, _ = advance(CameraMotion.velocity([0, 0, 0.05], IDENTITY_Q), start, 2)
    np.testing.assert_allclose(poses[:, :3, 3], [[1.05, 2, 3], [1.10, 2, 3]], atol=1e-14)


@pytest.mark.parametrize("axis,deg,expected", [("y", 6, rotation_y(6)), ("y", -6, rotation_y(-6)),
                                               ("x", 4, rotation_x(4)), ("x", -4, rotation_x(-4))])
def test_velocity_rotations_are_our_keys_matrices(axis, deg, expected):
    """6° about +Y is our "l" (rotation_y(6)); 4° about +X is our "i" (rotation_x(4)): no axis flip."""
    poses, _ = advance(CameraMotion.velocity([0, 0, 0], axis_quaternion(axis, deg)), np.eye(4), 1)
    np.testing.assert_allclose(poses[0, :3, :3], expected, atol=1e-15)


def test_no_motion_holds_the_pose():
    start = pose_matrix([1, 2, 3], axis_quaternion("y", 20))
    poses, motion = advance(None, start, 4)
    assert motion is None and poses.shape == (4, 4, 4)
    assert all(np.array_equal(p, start) for p in poses)
    empty, motion = advance(CameraMotion.velocity([0, 0, 1], IDENTITY_Q), start, 0)
    assert empty.shape == (0, 4, 4) and motion.mode == "velocity"


# ---------------------------------------------------------------- target


def test_target_reaches_exactly_on_its_last_step_then_holds():
    target_q = axis_quaternion("y", 90)
    motion = CameraMotion.toward(np.eye(4), [0.3, 0.0, 0.6], target_q, steps=3)  # transition_chunks 1 = 3 steps
    poses, after = advance(motion, np.eye(4), 2)
    np.testing.assert_allclose(poses[:, :3, 3], [[0.1, 0, 0.2], [0.2, 0, 0.4]], atol=1e-15)  # linear, u = k/3
    assert after is not None and after.done == 2
    poses2, after2 = advance(after, poses[-1], 3)
    assert after2 is None  # reached: the command is over
    assert np.array_equal(poses2[0], pose_matrix([0.3, 0.0, 0.6], target_q))  # exactly, on step 3
    assert np.array_equal(poses2[1], poses2[0]) and np.array_equal(poses2[2], poses2[0])  # and holds


def test_target_rotation_is_nlerp_on_the_arc():
    motion = CameraMotion.toward(np.eye(4), [0, 0, 0], axis_quaternion("y", 90), steps=3)
    poses, _ = advance(motion, np.eye(4), 3)
    half = math.radians(45)
    for k, pose in enumerate(poses, start=1):
        q = matrix_quaternion(pose[:3, :3])
        u = k / 3
        raw = np.array([0, u * math.sin(half), 0, (1 - u) + u * math.cos(half)])  # lerp of the endpoints
        np.testing.assert_allclose(q, raw / np.linalg.norm(raw), atol=1e-14)
        assert abs(q[0]) < 1e-15 and abs(q[2]) < 1e-15  # on the arc: still a pure yaw
    angles = [math.degrees(2 * math.atan2(matrix_quaternion(p[:3, :3])[1], matrix_quaternion(p[:3, :3])[3]))
              for p in poses]
    assert 0 < angles[0] < angles[1] < angles[2] == pytest.approx(90, abs=1e-12)
    assert angles[0] != pytest.approx(30)  # nlerp, not slerp: not evenly spaced in angle


def test_target_interpolates_from_the_pose_it_began_at():
    start = pose_matrix([1.0, 0.0, 0.0], IDENTITY_Q)
    poses, _ = advance(CameraMotion.toward(start, [0, 0, 0], IDENTITY_Q, steps=4), start, 4)
    np.testing.assert_allclose(poses[:, 0, 3], [0.75, 0.5, 0.25, 0.0], atol=1e-15)


@pytest.mark.parametrize("steps", [0, 1])
def test_target_zero_steps_snaps_at_the_first_frame(steps):
    target = pose_matrix([0, 0, 2], axis_quaternion("x", 10))
    poses, motion = advance(CameraMotion.toward(np.eye(4), [0, 0, 2], axis_quaternion("x", 10), steps), np.eye(4), 2)
    assert motion is None
    assert np.array_equal(poses[0], target) and np.array_equal(poses[1], target)


def test_motion_refuses_bad_values():
    with pytest.raises(ValueError):
        CameraMotion("spin", delta=np.eye(4))
    with pytest.raises(ValueError):
        CameraMotion.toward(np.eye(4), [0, 0, 0], IDENTITY_Q, steps=-1)
    with pytest.raises(ValueError):
        CameraMotion.velocity([0, 0, math.inf], IDENTITY_Q)
    with pytest.raises(ValueError):
        advance(None, np.diag([2.0, 1, 1, 1]), 1)  # not rigid
    with pytest.raises(ValueError):
        advance(None, np.eye(4), -1)


def test_every_pose_is_rigid_over_1000_random_commands():
    rng = np.random.default_rng(1234)
    pose, motion = np.eye(4), None
    for _ in range(1000):
        translation = rng.normal(scale=0.2, size=3)
        rotation = rng.normal(size=4)
        if rng.random() < 0.5:
            motion = CameraMotion.velocity(translation, rotation)
        else:
            motion = CameraMotion.toward(pose, translation, rotation, int(rng.integers(0, 7)))
        poses, motion = advance(motion, pose, int(rng.integers(1, 6)))
        assert_rigid(poses)
        pose = poses[-1]
    # A long velocity hold stays rigid too (products of rotations are re-projected each frame).
    poses, _ = advance(CameraMotion.velocity([0.01, 0, 0.05], rng.normal(size=4)), pose, 5000)
    assert_rigid(poses[-1:])
