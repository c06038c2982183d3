"""The camera command in force, stepped one latent frame at a time: a held velocity, or a move toward a target.

Pure geometry on numpy float64; it knows nothing of any wire format. Semantics are vLLM-Omni's camera modality
as ../shared/reference/vllm-omni-realtime-protocol.md §2.2 states them ([CAM]):

- velocity: a per-latent-frame SE3 delta Δ composed on the right, T ← T·Δ (so it moves in the camera's current
  local frame), held until replaced. 0.05 forward held for one chunk of 3 latent frames moves 0.15.
- target: an absolute pose relative to the session start (the identity). From the pose the command began at,
  translation is interpolated linearly and rotation by nlerp (shortest arc) over `steps` latent steps, step k
  (1-based) at u = k/steps; the last step lands exactly on the target. `steps` is
  round(transition_chunks × latent_frames_per_chunk); 0 snaps to the target at the first frame ([CAM] takes
  max(1, steps), so 0 and 1 behave alike). Once reached, the command is finished: `advance` returns None for it,
  as [CAM] clears its active event, and the pose then holds. (A caller reports the event completed when a
  target motion comes back None.)
- no command (None): the camera holds still.

Quaternions are (x, y, z, w), the wire's order, turned into matrices by the standard right-hand formula ([CAM]).

Axes. Our poses are camera.py's: camera-to-world 4x4, +x right, +y down, +z forward (OpenCV). The reference
calls vLLM-Omni's frame "Unity semantics, +X right, +Y up, +Z forward, same as LingBot's native camera frame";
+Y up with +X right and +Z forward is not right-handed, so that description cannot be taken literally. What is
concrete is the numbers: upstream's key conversion [CU] gives I = +4° about +X and L = +6° about +Y, whose
matrices are exactly camera.py's rotation_x(+4) (i, look up) and rotation_y(+6) (l, turn right), and W/D are
+z/+x as ours. So payloads are applied to our poses as they are, with no axis flip. One consequence: a +y
translation moves the camera down the picture (+y is down here); no upstream client sends y.

Public API
----------
    quaternion_matrix(q_xyzw) -> [3, 3]          normalising; ValueError on zero or non-finite
    matrix_quaternion(rotation) -> [4] (x, y, z, w), w >= 0
    nlerp(q0, q1, u) -> [4]                      normalised lerp along the shorter arc
    pose_matrix(translation, q_xyzw) -> [4, 4]
    CameraMotion.velocity(translation, rotation_xyzw)
    CameraMotion.toward(start_pose, translation, rotation_xyzw, steps)
    advance(motion, pose, frames) -> (poses [frames, 4, 4], motion after them, or None)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

MODES = ("velocity", "target")

# A pose given to `advance` must be rigid to this tolerance (max |RᵀR - I|); what it returns is projected back
# onto SO(3) after every composition, so long velocity holds never drift.
_RIGID_TOL = 1e-6


def quaternion_matrix(q_xyzw: Sequence[float]) -> np.ndarray:
    """The 3x3 rotation of a quaternion (x, y, z, w), normalised first."""
    q = np.asarray(q_xyzw, dtype=np.float64)
    if q.shape != (4,) or not np.isfinite(q).all():
        raise ValueError(f"a quaternion must be 4 finite numbers (x, y, z, w); got {q_xyzw!r}")
    norm = math.hypot(*q)  # hypot: no overflow for huge components
    if norm == 0.0:
        raise ValueError("a rotation quaternion must be non-zero")
    x, y, z, w = q / norm
    return np.array([
        [1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)],
        [2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)],
        [2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)],
    ])


def matrix_quaternion(rotation: np.ndarray) -> np.ndarray:
    """(x, y, z, w) of a 3x3 rotation, with w >= 0; via its largest component, for accuracy at every angle."""
    r = np.asarray(rotation, dtype=np.float64)
    trace = r[0, 0] + r[1, 1] + r[2, 2]
    squares = [1 + r[0, 0] - r[1, 1] - r[2, 2], 1 - r[0, 0] + r[1, 1] - r[2, 2],
               1 - r[0, 0] - r[1, 1] + r[2, 2], 1 + trace]  # 4x², 4y², 4z², 4w²
    i = int(np.argmax(squares))
    big = math.sqrt(max(squares[i], 0.0)) / 2
    a, b, c = r[2, 1] - r[1, 2], r[0, 2] - r[2, 0], r[1, 0] - r[0, 1]  # 4wx, 4wy, 4wz
    xy, xz, yz = r[0, 1] + r[1, 0], r[0, 2] + r[2, 0], r[1, 2] + r[2, 1]  # 4xy, 4xz, 4yz
    q = [np.array([big, xy / (4 * big), xz / (4 * big), a / (4 * big)]),
         np.array([xy / (4 * big), big, yz / (4 * big), b / (4 * big)]),
         np.array([xz / (4 * big), yz / (4 * big), big, c / (4 * big)]),
         np.array([a / (4 * big), b / (4 * big), c / (4 * big), big])][i]
    q = q / np.linalg.norm(q)
    return -q if q[3] < 0 else q


def nlerp(q0: Sequence[float], q1: Sequence[float], u: float) -> np.ndarray:
    """Normalised linear interpolation of unit quaternions; q1 is flipped when needed for the shorter arc."""
    a, b = np.asarray(q0, dtype=np.float64), np.asarray(q1, dtype=np.float64)
    if np.dot(a, b) < 0:  # q and -q are one rotation
        b = -b
    q = a + (b - a) * u
    return q / np.linalg.norm(q)


def pose_matrix(translation: Sequence[float], q_xyzw: Sequence[float]) -> np.ndarray:
    t = np.asarray(translation, dtype=np.float64)
    if t.shape != (3,) or not np.isfinite(t).all():
        raise ValueError(f"a translation must be 3 finite numbers; got {translation!r}")
    pose = np.eye(4)
    pose[:3, :3] = quaternion_matrix(q_xyzw)
    pose[:3, 3] = t
    return pose


def _rigid(pose: object, what: str) -> np.ndarray:
    """A private float64 copy of a rigid 4x4 pose; ValueError otherwise."""
    p = np.array(pose, dtype=np.float64)
    if p.shape != (4, 4) or not np.isfinite(p).all():
        raise ValueError(f"{what} must be a finite 4x4 matrix; got shape {p.shape}")
    r = p[:3, :3]
    if (np.abs(r.T @ r - np.eye(3)).max() > _RIGID_TOL or np.linalg.det(r) < 0
            or not np.array_equal(p[3], [0.0, 0.0, 0.0, 1.0])):
        raise ValueError(f"{what} must be rigid (orthonormal rotation, det +1, last row 0 0 0 1)")
    return p


def _frozen(p: np.ndarray) -> np.ndarray:
    p.setflags(write=False)
    return p


@dataclass(frozen=True, eq=False)
class CameraMotion:
    """The camera command in force. velocity: `delta`. target: `start` (the pose when it began), `target`
    (absolute, session start = identity), `steps` (latent steps of the transition; 0 snaps), `done` (taken)."""

    mode: str
    delta: np.ndarray | None = None
    start: np.ndarray | None = None
    target: np.ndarray | None = None
    steps: int = 0
    done: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be 'velocity' or 'target'; got {self.mode!r}")
        needed = ("delta",) if self.mode == "velocity" else ("start", "target")
        for name in needed:
            object.__setattr__(self, name, _frozen(_rigid(getattr(self, name), f"CameraMotion.{name}")))
        for name in ("steps", "done"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"CameraMotion.{name} must be an integer >= 0; got {value!r}")

    @classmethod
    def velocity(cls, translation: Sequence[float], rotation_xyzw: Sequence[float]) -> CameraMotion:
        return cls("velocity", delta=pose_matrix(translation, rotation_xyzw))

    @classmethod
    def toward(cls, start_pose: np.ndarray, translation: Sequence[float], rotation_xyzw: Sequence[float],
               steps: int) -> CameraMotion:
        return cls("target", start=start_pose, target=pose_matrix(translation, rotation_xyzw), steps=steps)


def _between(start: np.ndarray, target: np.ndarray, u: float) -> np.ndarray:
    pose = np.eye(4)
    pose[:3, :3] = quaternion_matrix(nlerp(matrix_quaternion(start[:3, :3]), matrix_quaternion(target[:3, :3]), u))
    pose[:3, 3] = start[:3, 3] + (target[:3, 3] - start[:3, 3]) * u
    return pose


def advance(motion: CameraMotion | None, pose: np.ndarray,
            frames: int) -> tuple[np.ndarray, CameraMotion | None]:
    """The next `frames` latent-frame poses [frames, 4, 4] from `pose`, and the motion in force after them
    (a velocity stays; a target is None once reached). Pure: nothing passed in is modified."""
    if isinstance(frames, bool) or not isinstance(frames, int) or frames < 0:
        raise ValueError(f"frames must be an integer >= 0; got {frames!r}")
    pose = _rigid(pose, "pose")
    out = np.empty((frames, 4, 4))
    for k in range(frames):
        if motion is None:
            pass  # still camera
        elif motion.mode == "velocity":
            pose = pose @ motion.delta
            u, _, vt = np.linalg.svd(pose[:3, :3])  # back onto SO(3): products of rotations drift slowly
            pose[:3, :3] = u @ vt
        else:
            done, total = motion.done + 1, max(motion.steps, 1)
            if done >= total:
                pose, motion = motion.target.copy(), None
            else:
                pose, motion = _between(motion.start, motion.target, done / total), replace(motion, done=done)
        out[k] = pose
    return out, motion


__all__ = ["MODES", "CameraMotion", "advance", "matrix_quaternion", "nlerp", "pose_matrix", "quaternion_matrix"]
