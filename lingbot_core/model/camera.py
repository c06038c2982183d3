"""Actions -> camera poses -> Plücker maps, and hardened camera-trajectory files.

All maths is numpy float64; torch appears only in `plucker_block`'s return value. Every constant
(step sizes, focal length, reference frame, file limits) comes from `CameraConfig`.

Conventions
-----------
Poses are 4x4 camera-to-world matrices in the OpenCV camera convention: +x right, +y down,
+z forward. Rotations are right-handed:

    R_x(a) = [[1, 0, 0], [0, c, -s], [0, s, c]]    R_y(a) = [[c, 0, s], [0, 1, 0], [-s, 0, c]]

so a positive pitch tips the forward axis (0, 0, 1) to (0, -sin a, cos a): up, since +y is down;
and a positive yaw turns it to (sin a, 0, cos a): right. Hence

    i: pitch +pitch_step (look up)     k: pitch -pitch_step (look down)
    l: yaw   +yaw_step   (turn right)  j: yaw   -yaw_step   (turn left)
    w/s: +/- move_step along the horizontal forward axis (R[0,2], 0, R[2,2]), normalised
    d/a: +/- move_step along the horizontal right axis  (R[0,0], 0, R[2,0]), normalised

Opposite keys in one frame cancel. Within one frame the rotation is applied first,
R' = R_y(yaw) . R . R_x(pitch), and the move uses the axes of R'. Pitch is tracked in
`CameraState.pitch_deg` (relative to the session's start pose). As upstream does, a pitch step
that would take it past +-pitch_limit is dropped whole (with 4-degree steps and an 85-degree limit
the pitch stops at 84), so the pose's pitch can never pass the limit.

Public API
----------
    VALID_KEYS                                                  frozenset("wasdijkl")
    ActionError(ValueError), TrajectoryError(ValueError)
    CameraState(pose, pitch_deg);  CameraState.initial()
    integrate_actions(state, frames_actions, cfg) -> (poses [F,4,4] float64, CameraState)
    intrinsics_for(cfg, width, height) -> (fx, fy, cx, cy)      key input, in pixels of a width x height frame
    reference_intrinsics(cfg, num_frames, width, height) -> [F, 4]   the same, in reference pixels
    plucker_block(anchor_pose, poses, intrinsics, width, height, cfg, translation_scale=None)
                                                                -> torch.float32 [F, 6, H, W]
    load_trajectory(poses_path, intrinsics_path, trusted_root, cfg) -> (poses [F,4,4], intrinsics [F,4])
    plan_trajectory(poses, intrinsics, frames_per_block, temporal_factor, num_blocks) -> TrajectoryPlan
    validate_trajectory(poses, intrinsics, cfg) -> (poses, intrinsics)   float64 copies
    resample_trajectory(poses, intrinsics, num_frames) -> (poses, intrinsics)
    trajectory_blocks(poses, intrinsics, num_blocks, frames_per_block) -> tuple[TrajectoryBlock, ...]

Anchors: a block's Plücker sequence is [anchor + its poses]. For an action-driven session the
anchor of block 0 is the identity (`CameraState.initial().pose`) and later anchors are the previous
block's last pose. For a trajectory file the anchor of block 0 is the trajectory's own first pose
(so the first frame has zero motion whatever world frame the file uses); later anchors are again
the previous block's last pose.

Normalisation: key input divides a block's translations by the largest step of [anchor + its poses]
(per block, as upstream's realtime tick path does). A trajectory file is normalised once over the
whole trajectory, as upstream's offline path embeds it: `plan_trajectory` measures the largest
latent-frame step and every block passes it as `translation_scale`, so a slow block stays slow and the
blocks together equal the one-shot embedding of the whole trajectory.
"""

from __future__ import annotations

import math
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Collection, NamedTuple, Sequence

import numpy as np
import torch
from numpy.lib import format as npy_format

from lingbot_core.config import CameraConfig

VALID_KEYS: frozenset[str] = frozenset("wasdijkl")

# Below this the horizontal part of an axis has no usable direction (camera looking straight
# up or down); the move is skipped rather than amplifying noise.
_DEGENERATE_AXIS = 1e-9
# |det R| below this is treated as a singular rotation block.
_SINGULAR_DET = 1e-9
# A pose file's rotation R must be rigid: max |R^T R - I| within this (float32 files sit near 1e-7;
# a scaled or sheared matrix is far outside it). Translations beyond _MAX_TRANSLATION (in the file's
# units) are refused: the relative-pose products would overflow long before such a camera means anything.
_ORTHONORMAL_TOL = 1e-3
_MAX_TRANSLATION = 1e6


class ActionError(ValueError):
    """A per-frame action list is malformed."""


class TrajectoryError(ValueError):
    """A camera trajectory (file or arrays) is unusable."""


# ----------------------------------------------------------------------------------------------
# Actions


def _frame_keys(keys: object, index: int) -> frozenset[str]:
    # A bare string would iterate as characters ("wd" -> w, d); refuse it so typos stay visible.
    if not isinstance(keys, (list, tuple, set, frozenset)):
        raise ActionError(f"actions for frame {index} must be a list of keys; got {type(keys).__name__}")
    for key in keys:
        if not isinstance(key, str):
            raise ActionError(f"actions for frame {index} contain a non-string key {key!r} "
                              f"({type(key).__name__})")
        if key not in VALID_KEYS:
            raise ActionError(f"actions for frame {index} contain unknown key {key!r}; "
                              f"valid keys are {''.join(sorted(VALID_KEYS))}")
    return frozenset(keys)


# ----------------------------------------------------------------------------------------------
# Integrator


@dataclass(frozen=True, eq=False)
class CameraState:
    """The tail of an action-driven camera path: last camera-to-world pose and tracked pitch."""

    pose: np.ndarray  # [4, 4] float64, read-only
    pitch_deg: float = 0.0

    def __post_init__(self) -> None:
        pose = np.array(self.pose, dtype=np.float64)  # always a private copy
        if pose.shape != (4, 4) or not np.isfinite(pose).all():
            raise ValueError(f"CameraState.pose must be a finite 4x4 matrix; got shape {pose.shape}")
        pose.setflags(write=False)
        object.__setattr__(self, "pose", pose)
        object.__setattr__(self, "pitch_deg", float(self.pitch_deg))

    @classmethod
    def initial(cls) -> "CameraState":
        return cls(np.eye(4), 0.0)


def rotation_x(deg: float) -> np.ndarray:
    a = math.radians(deg)
    c, s = math.cos(a), math.sin(a)
    return np.array([[1.0, 0.0, 0.0], [0.0, c, -s], [0.0, s, c]])


def rotation_y(deg: float) -> np.ndarray:
    a = math.radians(deg)
    c, s = math.cos(a), math.sin(a)
    return np.array([[c, 0.0, s], [0.0, 1.0, 0.0], [-s, 0.0, c]])


def _horizontal(x: float, z: float) -> np.ndarray | None:
    norm = math.hypot(x, z)
    if norm < _DEGENERATE_AXIS:
        return None
    return np.array([x / norm, 0.0, z / norm])


def integrate_actions(state: CameraState, frames_actions: Sequence[Collection[str]],
                      cfg: CameraConfig) -> tuple[np.ndarray, CameraState]:
    """Step the camera once per latent frame; returns each frame's pose [F, 4, 4] and the new tail.

    Pure: `state` is never modified.
    """
    frames = [_frame_keys(keys, i) for i, keys in enumerate(frames_actions)]
    rotation = state.pose[:3, :3].copy()
    position = state.pose[:3, 3].copy()
    pitch = state.pitch_deg
    poses = np.empty((len(frames), 4, 4))
    for index, keys in enumerate(frames):
        new_pitch = pitch + cfg.pitch_step_deg * (("i" in keys) - ("k" in keys))
        if abs(new_pitch) > cfg.pitch_limit_deg:  # upstream drops the step whole rather than clipping it
            new_pitch = pitch
        yaw = cfg.yaw_step_deg * (("l" in keys) - ("j" in keys))
        rotation = rotation_y(yaw) @ rotation @ rotation_x(new_pitch - pitch)
        pitch = new_pitch

        forward = _horizontal(rotation[0, 2], rotation[2, 2])
        right = _horizontal(rotation[0, 0], rotation[2, 0])
        ahead = ("w" in keys) - ("s" in keys)
        aside = ("d" in keys) - ("a" in keys)
        if ahead and forward is not None:
            position = position + cfg.move_step * ahead * forward
        if aside and right is not None:
            position = position + cfg.move_step * aside * right

        poses[index] = np.eye(4)
        poses[index, :3, :3] = rotation
        poses[index, :3, 3] = position
    tail = poses[-1] if len(frames) else state.pose
    return poses, CameraState(tail, pitch)


# ----------------------------------------------------------------------------------------------
# Intrinsics and Plücker maps


def reference_intrinsics(cfg: CameraConfig, num_frames: int, width: int | None = None,
                         height: int | None = None) -> np.ndarray:
    """Key-input intrinsics [F, 4] = (fx, fy, cx, cy) for a width x height output, in reference pixels.

    That is the frame `plucker_block` takes intrinsics in (it scales them to the output). With
    cfg.focal_at == "target" the focal length is focal_px once scaled to the output (upstream's realtime
    convention for the real checkpoint); with "reference" it is focal_px at the reference size.
    The principal point is the frame's centre either way. Width and height default to the reference size.
    """
    width = cfg.reference_width if width is None else width
    height = cfg.reference_height if height is None else height
    if width < 1 or height < 1:
        raise ValueError(f"width and height must be positive; got {width}x{height}")
    fx = fy = cfg.focal_px
    if cfg.focal_at == "target":
        fx, fy = cfg.focal_px * cfg.reference_width / width, cfg.focal_px * cfg.reference_height / height
    row = [fx, fy, cfg.reference_width / 2, cfg.reference_height / 2]
    return np.tile(np.array(row, dtype=np.float64), (num_frames, 1))


def _scale_intrinsics(intrinsics: np.ndarray, cfg: CameraConfig, width: int, height: int) -> np.ndarray:
    """Reference-frame (fx, fy, cx, cy) [..., 4] -> pixels of a width x height frame."""
    sx = width / cfg.reference_width
    sy = height / cfg.reference_height
    return intrinsics * np.array([sx, sy, sx, sy])


def intrinsics_for(cfg: CameraConfig, width: int, height: int) -> tuple[float, float, float, float]:
    """Key-input (fx, fy, cx, cy) in pixels of a width x height frame, following cfg.focal_at."""
    if cfg.focal_at == "target":  # exact, rather than through the reference frame and back
        return float(cfg.focal_px), float(cfg.focal_px), width / 2, height / 2
    fx, fy, cx, cy = _scale_intrinsics(reference_intrinsics(cfg, 1, width, height)[0], cfg, width, height)
    return float(fx), float(fy), float(cx), float(cy)


def _relative_to(base: np.ndarray, poses: np.ndarray) -> np.ndarray:
    """inv(base) @ poses [..., 4, 4] for rigid poses, as upstream's SE(3) inverse [R^T, -R^T t] gives it.

    The translation is taken as R^T (t - t_base), a difference first, so a camera that has not moved gets
    exactly 0. A general matrix inverse (np.linalg.inv) leaves rounding noise of 1e-17 or less there,
    which the per-block normalisation (divide by the largest step) then scales up to a unit step: a pure
    turn would read as a full-speed walk."""
    rotation_t = base[:3, :3].T
    out = np.zeros(poses.shape)
    out[..., :3, :3] = rotation_t @ poses[..., :3, :3]
    out[..., :3, 3] = (poses[..., :3, 3] - base[:3, 3]) @ rotation_t.T
    out[..., 3, 3] = 1.0
    return out


def _steps(poses: np.ndarray) -> np.ndarray:
    """inv(poses[i]) @ poses[i + 1] [F-1, 4, 4], each step of a rigid path, exact as `_relative_to` is."""
    rotation_t = np.swapaxes(poses[:-1, :3, :3], -1, -2)
    out = np.zeros((len(poses) - 1, 4, 4))
    out[:, :3, :3] = rotation_t @ poses[1:, :3, :3]
    out[:, :3, 3] = np.einsum("fij,fj->fi", rotation_t, poses[1:, :3, 3] - poses[:-1, :3, 3])
    out[:, 3, 3] = 1.0
    return out


def _normalise(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v, axis=-1, keepdims=True)


def plucker_block(anchor_pose: np.ndarray, poses: np.ndarray, intrinsics: np.ndarray,
                  width: int, height: int, cfg: CameraConfig,
                  translation_scale: float | None = None) -> torch.Tensor:
    """Plücker map of one block: float32 [F, 6, H, W] = [ray origin xyz, ray direction xyz].

    anchor_pose [4, 4]: the pose before this block; its row is used for the relative/delta/normalise
    steps and dropped from the output. poses [F, 4, 4] camera-to-world; intrinsics [F, 4] in
    reference pixels (scaled here by width/reference_width and height/reference_height).
    translation_scale: None divides the translations by the largest step of [anchor + poses] (key
    input, per block); a number divides them by it (a trajectory's largest step over all its blocks,
    from `plan_trajectory`; 0 means a trajectory that never moves).
    """
    anchor_pose = np.asarray(anchor_pose, dtype=np.float64)
    poses = np.asarray(poses, dtype=np.float64)
    intrinsics = np.asarray(intrinsics, dtype=np.float64)
    if anchor_pose.shape != (4, 4):
        raise ValueError(f"anchor_pose must be [4, 4]; got {list(anchor_pose.shape)}")
    if poses.ndim != 3 or poses.shape[1:] != (4, 4) or len(poses) == 0:
        raise ValueError(f"poses must be [F, 4, 4] with F >= 1; got {list(poses.shape)}")
    if intrinsics.shape != (len(poses), 4):
        raise ValueError(f"intrinsics must be [{len(poses)}, 4]; got {list(intrinsics.shape)}")
    if width < 1 or height < 1:
        raise ValueError(f"width and height must be positive; got {width}x{height}")

    sequence = np.concatenate([anchor_pose[None], poses])  # [F+1, 4, 4]
    relative = _relative_to(sequence[0], sequence)
    deltas = np.broadcast_to(np.eye(4), sequence.shape).copy()
    deltas[1:] = _steps(relative)
    origins = deltas[:, :3, 3]  # [F+1, 3]
    if translation_scale is None:
        largest = np.linalg.norm(origins, axis=-1).max()
    else:
        largest = float(translation_scale)
        if not (math.isfinite(largest) and largest >= 0):
            raise ValueError(f"translation_scale must be a finite number >= 0; got {translation_scale!r}")
    if largest > 0:
        origins = origins / largest
    # Drop the anchor row now that it has taken part in the relative/delta/normalise steps.
    origins, rotations = origins[1:], deltas[1:, :3, :3]

    k = _scale_intrinsics(intrinsics, cfg, width, height)  # [F, 4]
    fx, fy, cx, cy = (k[:, i, None, None] for i in range(4))  # each [F, 1, 1]
    xs = (np.arange(width) + 0.5)[None, None, :]  # [1, 1, W]
    ys = (np.arange(height) + 0.5)[None, :, None]  # [1, H, 1]
    shape = (len(poses), height, width)
    camera_rays = np.stack([np.broadcast_to((xs - cx) / fx, shape), np.broadcast_to((ys - cy) / fy, shape),
                            np.ones(shape)], axis=-1)  # [F, H, W, 3]
    directions = _normalise(np.einsum("fij,fhwj->fhwi", rotations, _normalise(camera_rays)))
    origin_map = np.broadcast_to(origins[:, None, None, :], directions.shape)  # [F, H, W, 3]
    maps = np.concatenate([origin_map, directions], axis=-1).transpose(0, 3, 1, 2)  # [F, 6, H, W]
    return torch.from_numpy(np.ascontiguousarray(maps, dtype=np.float32))


# ----------------------------------------------------------------------------------------------
# Trajectory files


def _resolve_under_root(path: str | os.PathLike, root: Path, root_real: Path) -> Path:
    """The real path of `path`, refusing escapes from `root` and symlinks at or below it."""
    raw, name = Path(path), _file_name(path)
    candidate = Path(os.path.abspath(raw if raw.is_absolute() else root / raw))
    for base in (Path(os.path.abspath(root)), root_real):
        if candidate.is_relative_to(base):
            parts = candidate.relative_to(base).parts
            break
    else:
        raise TrajectoryError(f"{name}: is outside the folder files are taken from")
    if not parts:
        raise TrajectoryError(f"{name}: is the folder files are taken from, not a file")
    current = root_real
    for part in parts:
        current = current / part
        try:
            info = os.lstat(current)
        except OSError as exc:
            raise TrajectoryError(f"{name}: cannot be read ({exc.strerror})") from exc
        if stat.S_ISLNK(info.st_mode):
            raise TrajectoryError(f"{name}: {_file_name(current)} is a symlink; symlinks are not allowed")
    if not stat.S_ISREG(info.st_mode):
        raise TrajectoryError(f"{name}: is not a regular file")
    if not Path(os.path.realpath(current)).is_relative_to(root_real):  # belt and braces
        raise TrajectoryError(f"{name}: resolves outside the folder files are taken from")
    return current


def _read_npy(path: Path, name: str, trailing_shape: tuple[int, ...], cfg: CameraConfig) -> np.ndarray:
    """Read one numeric NPY (v1/v2) of shape [F, *trailing_shape] without pickle or trusting sizes."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise TrajectoryError(f"{name}: cannot be opened ({exc.strerror})") from exc
    with os.fdopen(fd, "rb") as fp:
        info = os.fstat(fp.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise TrajectoryError(f"{name}: is not a regular file")
        file_size = info.st_size
        if file_size > cfg.max_trajectory_file_bytes:
            raise TrajectoryError(f"{name}: file of {file_size} bytes exceeds the limit of "
                                  f"{cfg.max_trajectory_file_bytes} bytes")
        try:
            version = npy_format.read_magic(fp)
        except ValueError as exc:
            raise TrajectoryError(f"{name}: is not an NPY file ({exc})") from exc
        if version not in ((1, 0), (2, 0)):
            raise TrajectoryError(f"{name}: NPY format version {version[0]}.{version[1]} is not allowed; "
                                  "only 1.0 and 2.0")
        # Check the declared header length ourselves: numpy would read all of it before its check.
        length_format = "<H" if version == (1, 0) else "<I"
        length_bytes = fp.read(struct.calcsize(length_format))
        if len(length_bytes) != struct.calcsize(length_format):
            raise TrajectoryError(f"{name}: file ends inside the NPY header")
        (header_length,) = struct.unpack(length_format, length_bytes)
        if header_length > cfg.max_npy_header_bytes:
            raise TrajectoryError(f"{name}: NPY header of {header_length} bytes exceeds the limit of "
                                  f"{cfg.max_npy_header_bytes}")
        fp.seek(npy_format.MAGIC_LEN)
        read_header = npy_format.read_array_header_1_0 if version == (1, 0) else npy_format.read_array_header_2_0
        try:
            shape, fortran_order, dtype = read_header(fp, max_header_size=cfg.max_npy_header_bytes)
        except (ValueError, TypeError, SyntaxError) as exc:
            raise TrajectoryError(f"{name}: bad NPY header ({exc})") from exc
        data_offset = fp.tell()

        if dtype.kind not in "fiu" or dtype.hasobject:
            raise TrajectoryError(f"{name}: dtype {dtype} is not allowed; need a float or integer dtype")
        expected = "[F, " + ", ".join(map(str, trailing_shape)) + "]"
        if len(shape) != 1 + len(trailing_shape) or tuple(shape[1:]) != trailing_shape:
            raise TrajectoryError(f"{name}: shape {list(shape)} is wrong; need {expected}")
        if shape[0] < 1:
            raise TrajectoryError(f"{name}: has no frames")
        data_size = math.prod(shape) * dtype.itemsize
        if file_size != data_offset + data_size:
            raise TrajectoryError(f"{name}: file size {file_size} bytes does not match its header "
                                  f"({data_offset} header + {data_size} data = {data_offset + data_size})")
        data = fp.read(data_size)
        if len(data) != data_size:
            raise TrajectoryError(f"{name}: file changed while reading (short read)")
    # As stored: validate_trajectory bounds it by these bytes, then makes the float64 copy.
    return np.frombuffer(data, dtype=dtype).reshape(shape, order="F" if fortran_order else "C")


def load_trajectory(poses_path: str | os.PathLike, intrinsics_path: str | os.PathLike,
                    trusted_root: str | os.PathLike,
                    cfg: CameraConfig = CameraConfig()) -> tuple[np.ndarray, np.ndarray]:
    """Load `poses.npy` [F, 4, 4] (c2w, OpenCV) and `intrinsics.npy` [F, 4] (reference pixels).

    Relative paths are taken relative to `trusted_root`. Returns float64 arrays; any problem
    raises `TrajectoryError` naming the file (by its name only: a server's folders stay its own).
    """
    poses, intrinsics, _ = read_trajectory(poses_path, intrinsics_path, trusted_root, cfg)
    return poses, intrinsics


def read_trajectory(poses_path: str | os.PathLike, intrinsics_path: str | os.PathLike,
                    trusted_root: str | os.PathLike, cfg: CameraConfig = CameraConfig(),
                    max_frames: int | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """`load_trajectory` that checks and returns only the first `max_frames` frames (a video of N blocks uses
    the first 12N - 3; upstream drops the rest), and also the files' frame count."""
    root = Path(trusted_root)
    if not root.is_dir():
        raise TrajectoryError("the trusted root is not a directory")
    root_real = Path(os.path.realpath(root))
    names = (_file_name(poses_path), _file_name(intrinsics_path))
    poses = _read_npy(_resolve_under_root(poses_path, root, root_real), names[0], (4, 4), cfg)
    intrinsics = _read_npy(_resolve_under_root(intrinsics_path, root, root_real), names[1], (4,), cfg)
    if len(poses) != len(intrinsics):
        raise TrajectoryError(f"{names[0]} has {len(poses)} frames but {names[1]} has {len(intrinsics)}")
    frames = len(poses)
    if max_frames is not None:
        poses, intrinsics = poses[:max_frames], intrinsics[:max_frames]
    poses, intrinsics = validate_trajectory(poses, intrinsics, cfg, names=names)
    return poses, intrinsics, frames


def _file_name(path: str | os.PathLike) -> str:
    """A file named in a message: its name, quoted briefly (never the folders it sits in)."""
    name = Path(path).name
    return name if len(name) <= 60 and name.isprintable() else repr(name[:60]) + "..."


def validate_trajectory(poses: object, intrinsics: object, cfg: CameraConfig = CameraConfig(),
                        names: tuple[str, str] = ("poses", "intrinsics")) -> tuple[np.ndarray, np.ndarray]:
    """Value checks for a trajectory from anywhere; returns float64 copies.

    poses [F, 4, 4]: finite, rotation block orthonormal (within _ORTHONORMAL_TOL) with det > 0,
    translations within _MAX_TRANSLATION. intrinsics [F, 4]: finite,
    fx > 0 and fy > 0. F >= 1 and equal in both; each array's values fit max_trajectory_file_bytes.
    """
    checked = []
    for array, name, trailing in ((poses, names[0], (4, 4)), (intrinsics, names[1], (4,))):
        array = np.asarray(array)
        if array.dtype.kind not in "fiu":
            raise TrajectoryError(f"{name}: dtype {array.dtype} is not allowed; need a float or integer dtype")
        if array.ndim != 1 + len(trailing) or array.shape[1:] != trailing:
            raise TrajectoryError(f"{name}: shape {list(array.shape)} is wrong; need [F, "
                                  + ", ".join(map(str, trailing)) + "]")
        if len(array) < 1:
            raise TrajectoryError(f"{name}: has no frames")
        if array.nbytes > cfg.max_trajectory_file_bytes:  # the bound a file has, for arrays from elsewhere
            raise TrajectoryError(f"{name}: {len(array)} frames take {array.nbytes} bytes as {array.dtype}; the "
                                  f"limit is {cfg.max_trajectory_file_bytes}")
        array = np.array(array, dtype=np.float64)
        bad = np.flatnonzero(~np.isfinite(array.reshape(len(array), -1)).all(axis=1))
        if bad.size:
            raise TrajectoryError(f"{name}: frame {bad[0]} has a non-finite value (NaN or inf)")
        checked.append(array)
    poses, intrinsics = checked
    if len(poses) != len(intrinsics):
        raise TrajectoryError(f"{names[0]} has {len(poses)} frames but {names[1]} has {len(intrinsics)}")
    dets = np.linalg.det(poses[:, :3, :3])
    bad = np.flatnonzero(~(dets > _SINGULAR_DET))
    if bad.size:
        raise TrajectoryError(f"{names[0]}: frame {bad[0]} rotation is singular or reflected "
                              f"(det {dets[bad[0]]:.3g})")
    with np.errstate(over="ignore", invalid="ignore"):  # a 1e308-scaled matrix overflows here: refused below
        rotations = poses[:, :3, :3]
        drift = np.abs(rotations.transpose(0, 2, 1) @ rotations - np.eye(3)).max(axis=(1, 2))
    bad = np.flatnonzero(~(drift <= _ORTHONORMAL_TOL))
    if bad.size:
        raise TrajectoryError(f"{names[0]}: frame {bad[0]} rotation is not orthonormal (max |R^T R - I| = "
                              f"{drift[bad[0]]:.3g}, tolerance {_ORTHONORMAL_TOL:g}); poses must be rigid "
                              "camera-to-world transforms")
    distances = np.abs(poses[:, :3, 3]).max(axis=1)
    bad = np.flatnonzero(~(distances <= _MAX_TRANSLATION))
    if bad.size:
        raise TrajectoryError(f"{names[0]}: frame {bad[0]} translation {distances[bad[0]]:.3g} is beyond the "
                              f"limit of {_MAX_TRANSLATION:g}")
    bad = np.flatnonzero(~((intrinsics[:, 0] > 0) & (intrinsics[:, 1] > 0)))
    if bad.size:
        raise TrajectoryError(f"{names[1]}: frame {bad[0]} focal lengths must be positive; "
                              f"got fx={intrinsics[bad[0], 0]}, fy={intrinsics[bad[0], 1]}")
    return poses, intrinsics


# ----------------------------------------------------------------------------------------------
# Resampling


def _nearest_rotation(matrices: np.ndarray) -> np.ndarray:
    """Project [N, 3, 3] onto SO(3) (polar decomposition) so quaternion conversion is exact."""
    u, _, vt = np.linalg.svd(matrices)
    return u @ vt


def _matrix_to_quaternion(r: np.ndarray) -> np.ndarray:
    """[N, 3, 3] rotations -> [N, 4] unit quaternions (w, x, y, z), via the largest component."""
    trace = np.trace(r, axis1=-2, axis2=-1)
    squares = np.stack([1 + trace, 1 + r[:, 0, 0] - r[:, 1, 1] - r[:, 2, 2],
                        1 - r[:, 0, 0] + r[:, 1, 1] - r[:, 2, 2], 1 - r[:, 0, 0] - r[:, 1, 1] + r[:, 2, 2]], axis=-1)
    big = np.sqrt(np.maximum(squares, 0.0)) / 2  # [N, 4]
    d = 4 * np.maximum(big, 1e-300)
    a = r[:, 2, 1] - r[:, 1, 2]
    b = r[:, 0, 2] - r[:, 2, 0]
    c = r[:, 1, 0] - r[:, 0, 1]
    xy = r[:, 0, 1] + r[:, 1, 0]
    xz = r[:, 0, 2] + r[:, 2, 0]
    yz = r[:, 1, 2] + r[:, 2, 1]
    candidates = np.stack([
        np.stack([big[:, 0], a / d[:, 0], b / d[:, 0], c / d[:, 0]], -1),
        np.stack([a / d[:, 1], big[:, 1], xy / d[:, 1], xz / d[:, 1]], -1),
        np.stack([b / d[:, 2], xy / d[:, 2], big[:, 2], yz / d[:, 2]], -1),
        np.stack([c / d[:, 3], xz / d[:, 3], yz / d[:, 3], big[:, 3]], -1),
    ], axis=1)  # [N, 4 candidates, 4]
    q = candidates[np.arange(len(r)), np.argmax(squares, axis=-1)]
    return _normalise(q)


def _quaternion_to_matrix(q: np.ndarray) -> np.ndarray:
    w, x, y, z = np.moveaxis(q, -1, 0)
    return np.stack([
        np.stack([1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)], -1),
        np.stack([2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)], -1),
        np.stack([2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)], -1),
    ], axis=-2)


def _slerp(q0: np.ndarray, q1: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Shortest-arc spherical interpolation of [N, 4] unit quaternions at fractions u [N]."""
    dot = np.sum(q0 * q1, axis=-1)
    q1 = np.where(dot[:, None] < 0, -q1, q1)  # q and -q are the same rotation; take the short way
    dot = np.clip(np.abs(dot), 0.0, 1.0)
    theta = np.arccos(dot)
    sin_theta = np.sin(theta)
    nearly_equal = sin_theta < 1e-12  # fall back to lerp where the arc is too short to divide by
    safe = np.where(nearly_equal, 1.0, sin_theta)
    w0 = np.where(nearly_equal, 1 - u, np.sin((1 - u) * theta) / safe)
    w1 = np.where(nearly_equal, u, np.sin(u * theta) / safe)
    return _normalise(w0[:, None] * q0 + w1[:, None] * q1)


def resample_trajectory(poses: np.ndarray, intrinsics: np.ndarray,
                        num_frames: int) -> tuple[np.ndarray, np.ndarray]:
    """Resample to `num_frames` samples spread uniformly over [0, F-1].

    Rotation: quaternion SLERP; translation and intrinsics: linear. Samples that land on an input
    frame return it unchanged. No cap on F or num_frames.
    """
    poses = np.asarray(poses, dtype=np.float64)
    intrinsics = np.asarray(intrinsics, dtype=np.float64)
    if isinstance(num_frames, bool) or not isinstance(num_frames, (int, np.integer)) or num_frames < 1:
        raise ValueError(f"num_frames must be a positive integer; got {num_frames!r}")
    count = len(poses)
    if count == 0 or len(intrinsics) != count:
        raise ValueError(f"need equal, non-zero frame counts; got {count} poses and {len(intrinsics)} intrinsics")
    if num_frames == count:
        return poses.copy(), intrinsics.copy()
    if count == 1:
        return np.repeat(poses, num_frames, axis=0), np.repeat(intrinsics, num_frames, axis=0)

    # k*(F-1) is an exact integer, so the last sample lands exactly on F-1.
    positions = np.arange(num_frames) * (count - 1) / max(num_frames - 1, 1)
    lower = np.minimum(np.floor(positions).astype(np.int64), count - 2)
    u = positions - lower  # in [0, 1]
    upper = lower + 1

    quats = _matrix_to_quaternion(_nearest_rotation(poses[:, :3, :3]))
    out_poses = np.broadcast_to(np.eye(4), (num_frames, 4, 4)).copy()
    out_poses[:, :3, :3] = _quaternion_to_matrix(_slerp(quats[lower], quats[upper], u))
    out_poses[:, :3, 3] = (1 - u)[:, None] * poses[lower, :3, 3] + u[:, None] * poses[upper, :3, 3]
    out_intrinsics = (1 - u)[:, None] * intrinsics[lower] + u[:, None] * intrinsics[upper]
    # Samples exactly on an input frame keep that frame bit for bit.
    for hit, source in ((u == 0, lower), (u == 1, upper)):
        out_poses[hit] = poses[source[hit]]
        out_intrinsics[hit] = intrinsics[source[hit]]
    return out_poses, out_intrinsics


class TrajectoryBlock(NamedTuple):
    anchor: np.ndarray  # [4, 4] the pose before this block
    poses: np.ndarray  # [frames_per_block, 4, 4]
    intrinsics: np.ndarray  # [frames_per_block, 4] reference pixels


def trajectory_blocks(poses: np.ndarray, intrinsics: np.ndarray, num_blocks: int,
                      frames_per_block: int) -> tuple[TrajectoryBlock, ...]:
    """Split a trajectory of exactly num_blocks * frames_per_block latent frames into blocks.

    Block 0's anchor is the trajectory's own first pose; block b's anchor is block b-1's last pose.
    Resample first (`resample_trajectory`) to reach the right frame count.
    """
    poses = np.asarray(poses, dtype=np.float64)
    intrinsics = np.asarray(intrinsics, dtype=np.float64)
    needed = num_blocks * frames_per_block
    if num_blocks < 1 or frames_per_block < 1 or len(poses) != needed or len(intrinsics) != needed:
        raise TrajectoryError(f"trajectory has {len(poses)} poses and {len(intrinsics)} intrinsics; "
                              f"{num_blocks} blocks of {frames_per_block} frames need {needed} of each "
                              "(resample first)")
    blocks = []
    for b in range(num_blocks):
        start = b * frames_per_block
        anchor = poses[0] if b == 0 else poses[start - 1]
        blocks.append(TrajectoryBlock(anchor.copy(), poses[start:start + frames_per_block].copy(),
                                      intrinsics[start:start + frames_per_block].copy()))
    return tuple(blocks)


# ----------------------------------------------------------------------------------------------
# A trajectory file, prepared as upstream's offline path prepares it


def trajectory_translation_scale(poses: np.ndarray) -> float:
    """The largest framewise step of a whole latent-frame trajectory, after making it relative to its first pose.

    Upstream divides every translation of the trajectory by this one number (0: a camera that never moves).
    """
    poses = np.asarray(poses, dtype=np.float64)
    if len(poses) < 2:
        return 0.0
    steps = _steps(_relative_to(poses[0], poses))
    return float(np.linalg.norm(steps[:, :3, 3], axis=-1).max())


class TrajectoryPlan(NamedTuple):
    """A trajectory cut to whole blocks of latent frames, with the one normalisation they all share."""

    blocks: tuple[TrajectoryBlock, ...]
    translation_scale: float  # the largest latent-frame step of the whole (used) trajectory
    frames_used: int  # pixel frames the video covers: 12N - 3 for N blocks
    frames_dropped: int  # the file's frames after those


def plan_trajectory(poses: np.ndarray, intrinsics: np.ndarray, frames_per_block: int, temporal_factor: int,
                    num_blocks: int | None = None) -> TrajectoryPlan:
    """Truncate a pixel-rate trajectory to what the video needs, take it to latent frames, and measure its scale.

    As upstream: the file's poses count video frames; N blocks need the first 12N - 3 of them (with 3
    latent frames a block and a temporal factor of 4), and without a block count the video is the whole
    blocks the file covers, rounding down. Those frames are sampled at every `temporal_factor`-th frame
    (exact file frames, no interpolation, when the counts line up as they do here; otherwise SLERP).
    A file too short for the requested blocks is refused rather than stretched.
    """
    poses = np.asarray(poses, dtype=np.float64)
    intrinsics = np.asarray(intrinsics, dtype=np.float64)
    count = len(poses)
    if count < 1 or len(intrinsics) != count:
        raise TrajectoryError(f"need equal, non-zero frame counts; got {count} poses and {len(intrinsics)} intrinsics")
    if frames_per_block < 1 or temporal_factor < 1:
        raise ValueError("frames_per_block and temporal_factor must be positive")
    first_block_frames = frames_per_block * temporal_factor - (temporal_factor - 1)
    whole_blocks = ((count - 1) // temporal_factor + 1) // frames_per_block  # rounding down, as upstream
    if num_blocks is None:
        if whole_blocks < 1:
            raise TrajectoryError(f"the trajectory has {count} frames; one block needs {first_block_frames}")
        num_blocks = whole_blocks
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, (int, np.integer)) or num_blocks < 1:
        raise ValueError(f"num_blocks must be a positive integer; got {num_blocks!r}")
    used = num_blocks * frames_per_block * temporal_factor - (temporal_factor - 1)
    if used > count:
        raise TrajectoryError(f"{num_blocks} blocks need {used} trajectory frames; the trajectory has {count} "
                              f"(enough for {whole_blocks} blocks)")
    latent_poses, latent_intrinsics = resample_trajectory(poses[:used], intrinsics[:used],
                                                          num_blocks * frames_per_block)
    blocks = trajectory_blocks(latent_poses, latent_intrinsics, num_blocks, frames_per_block)
    return TrajectoryPlan(blocks, trajectory_translation_scale(latent_poses), used, count - used)
