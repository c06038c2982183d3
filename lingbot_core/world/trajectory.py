"""Camera paths for the world renderer, through the camera module's own integrator and conventions.

The demo turns keys into one pose per LATENT frame (`camera.integrate_actions`, three a block) and
describes them to the model as Plücker maps; the VAE turns latent frame k >= 1 into pixel frames
4k-3 .. 4k and latent frame 0 into pixel frame 0 (temporal factor 4). The renderer draws pixel
frames, so a key path is integrated exactly as the demo does and then spread over pixel frames:
pixel frame 4k is latent pose k, and the three pixel frames before it are interpolated from latent
pose k-1 (rotation SLERP, translation linear: `camera.resample_trajectory`). N blocks give
12N - 3 pixel frames, as the decoder produces.

Pixel frame 0 (the start image) is latent pose 0. In the app keys act from the next block on, so
block 0 carries no key and latent pose 0 is the start pose (the identity), where the start image
is rendered.

Intrinsics: key input uses `camera.intrinsics_for(cfg, width, height)`, whatever convention the
camera config names (`focal_at`), so the picture and the Plücker map agree. Trajectory files hold
intrinsics in the config's reference frame (832x480) and are scaled to the output size, as
`plucker_block` scales them.
"""

from __future__ import annotations

import os
from typing import Collection, NamedTuple, Sequence

import numpy as np

from lingbot_core.config import CameraConfig, ModelConfig
from lingbot_core.model import camera


class CameraPath(NamedTuple):
    frame_actions: tuple[frozenset[str], ...]  # one key set per latent frame
    latent_poses: np.ndarray  # [L, 4, 4] camera-to-world, what the model's Plücker maps describe
    pixel_poses: np.ndarray  # [(L-1)*temporal_factor + 1, 4, 4] one per rendered frame
    intrinsics: np.ndarray  # [4] (fx, fy, cx, cy) in pixels of the model's width x height frame
    end_state: camera.CameraState  # the integrator's tail, to continue the path


def held_keys(keys_per_block: Sequence[str | Collection[str]], frames_per_block: int) -> tuple[frozenset[str], ...]:
    """Per-latent-frame key sets for keys held through whole blocks: ["w", "jw", ""] -> 3 blocks."""
    frames: list[frozenset[str]] = []
    for index, keys in enumerate(keys_per_block):
        chosen = frozenset(keys)
        unknown = chosen - camera.VALID_KEYS
        if unknown:
            raise camera.ActionError(f"block {index} holds unknown key(s) {sorted(unknown)}; valid keys are "
                                     f"{''.join(sorted(camera.VALID_KEYS))}")
        frames.extend([chosen] * frames_per_block)
    return tuple(frames)


def pixel_poses(latent_poses: np.ndarray, temporal_factor: int) -> np.ndarray:
    """Latent poses [L, 4, 4] -> pixel poses [(L-1)*temporal_factor + 1, 4, 4] (pixel 4k = latent k)."""
    latent_poses = np.asarray(latent_poses, dtype=np.float64)
    count = (len(latent_poses) - 1) * temporal_factor + 1
    # Intrinsics ride along unchanged; resample_trajectory samples [0, L-1] uniformly, so sample k
    # sits at latent position k / temporal_factor and whole positions return the latent pose exactly.
    dummy = np.ones((len(latent_poses), 4))
    poses, _ = camera.resample_trajectory(latent_poses, dummy, count)
    return poses


def key_path(frame_actions: Sequence[Collection[str]], config: ModelConfig,
             start: camera.CameraState | None = None) -> CameraPath:
    """Integrate per-latent-frame key sets as the demo does, from `start` (the session's initial pose)."""
    start = camera.CameraState.initial() if start is None else start
    latent, end = camera.integrate_actions(start, frame_actions, config.camera)
    if len(latent) == 0:
        raise ValueError("a camera path needs at least one latent frame")
    intrinsics = np.array(camera.intrinsics_for(config.camera, config.width, config.height))
    frames = tuple(frozenset(keys) for keys in frame_actions)
    return CameraPath(frames, latent, pixel_poses(latent, config.vae_temporal_factor), intrinsics, end)


def pixel_intrinsics(reference: np.ndarray, cfg: CameraConfig, width: int, height: int) -> np.ndarray:
    """Trajectory-file intrinsics [..., 4] in the reference frame -> pixels of a width x height frame."""
    sx, sy = width / cfg.reference_width, height / cfg.reference_height
    return np.asarray(reference, dtype=np.float64) * np.array([sx, sy, sx, sy])


def file_path(poses_path: str | os.PathLike, intrinsics_path: str | os.PathLike, trusted_root: str | os.PathLike,
              config: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """A `poses.npy` / `intrinsics.npy` pair, loaded by the camera module's hardened reader.

    Returns pixel-frame poses [F, 4, 4] and intrinsics [F, 4] in pixels of the model's frame, ready
    for `render`. The file's frames are pixel frames, so nothing is resampled.
    """
    poses, reference = camera.load_trajectory(poses_path, intrinsics_path, trusted_root, config.camera)
    return poses, pixel_intrinsics(reference, config.camera, config.width, config.height)
