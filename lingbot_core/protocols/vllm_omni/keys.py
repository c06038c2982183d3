"""Our keys as vLLM-Omni camera payloads, converted as upstream's example client does ([CU]
`wasd_to_camera_payload`, reference §2.2 "Converting keys"): the engine refuses key tokens ([CAM]).

Per latent frame: translation [0.05·(d−a), 0, 0.05·(w−s)]; pitch 4° about +X (i positive, k negative); yaw 6°
about +Y (l positive, j negative); q = pitch ⊗ yaw (Hamilton product, (x, y, z, w) order), so its matrix is
R_x(pitch)·R_y(yaw). The steps equal CameraConfig's defaults (move_step, pitch_step_deg, yaw_step_deg).

Sent as `velocity` (T ← T·Δ, in the camera's local frame), this matches our key integrator
(camera.integrate_actions) for any single key from an upright camera (no pitch). It differs:
- once the camera is pitched: velocity moves along the camera's own (tilted) forward and right axes and yaws
  about its own tilted Y, where our integrator moves along the yaw-only horizontal axes and yaws about world Y;
- for keys combined in one frame: velocity translates along the axes from before this frame's rotation and
  applies pitch then yaw in the local frame (R·R_x·R_y); ours rotates first (R_y·R·R_x) and moves along the
  new axes;
- at the pitch limit: velocity has none; ours drops a pitch step that would pass ±85°.
`script_from_blocks` sends the request-scoped `extra_params.camera_action_script`, which the engine integrates
as our integrator does ([ACT]), so it has none of these differences.
"""

from __future__ import annotations

import math
from typing import Collection, Sequence

from lingbot_core.protocols.vllm_omni.messages import SCRIPT_FRAMES_PER_CHUNK, SCRIPT_KEYS, camera_payload

MOVE_STEP = 0.05
PITCH_STEP_DEG = 4.0
YAW_STEP_DEG = 6.0


def _keys(keys: Collection[str]) -> frozenset[str]:
    if isinstance(keys, str) or not all(isinstance(k, str) and k in SCRIPT_KEYS for k in keys):
        raise ValueError(f"keys must be a collection of w a s d i j k l; got {keys!r}")
    return frozenset(keys)


def velocity_delta(keys: Collection[str]) -> tuple[tuple[float, float, float], tuple[float, float, float, float]]:
    """(translation, quaternion (x, y, z, w)) of one latent frame with `keys` held."""
    k = _keys(keys)
    pitch = math.radians(PITCH_STEP_DEG * (("i" in k) - ("k" in k))) / 2  # half-angles
    yaw = math.radians(YAW_STEP_DEG * (("l" in k) - ("j" in k))) / 2
    # (sp, 0, 0, cp) ⊗ (0, sy, 0, cy), expanded: the zero terms drop out.
    sp, cp, sy, cy = math.sin(pitch), math.cos(pitch), math.sin(yaw), math.cos(yaw)
    translation = (MOVE_STEP * (("d" in k) - ("a" in k)), 0.0, MOVE_STEP * (("w" in k) - ("s" in k)))
    return translation, (sp * cy, cp * sy, sp * sy, cp * cy)


def velocity_payload(keys: Collection[str]) -> dict:
    """`multi_modal_data.camera` holding `keys`; no keys is zero motion, the stop event ([CUI] on release)."""
    return camera_payload("velocity", *velocity_delta(keys))


def script_from_blocks(blocks: Sequence[Sequence[Collection[str]]]) -> list[list[list[str]]]:
    """`extra_params.camera_action_script`: per chunk, 3 latent frames of sorted lower-case key tokens."""
    script = []
    for index, block in enumerate(blocks):
        if len(block) != SCRIPT_FRAMES_PER_CHUNK:
            raise ValueError(f"block {index} has {len(block)} latent frames; a chunk has {SCRIPT_FRAMES_PER_CHUNK}")
        script.append([sorted(_keys(frame)) for frame in block])
    return script


__all__ = ["MOVE_STEP", "PITCH_STEP_DEG", "YAW_STEP_DEG", "script_from_blocks", "velocity_delta", "velocity_payload"]
