"""A procedural 3D world the embedded model can be trained on and checked against.

    scene.py       seeded worlds: look, endless per-cell objects, fixed train / held-out seed ranges
    render.py      vectorised torch ray caster and shader: frames for any pose and intrinsics
    trajectory.py  camera paths through the camera module's integrator (keys, pose files)
"""

from lingbot_core.world.render import Buffers, render, render_buffers, to_uint8
from lingbot_core.world.scene import (HELD_OUT_SEEDS, OBJECT_KINDS, TRAIN_SEEDS, World, WorldConfig, make_world,
                                      objects_near, seed_split)
from lingbot_core.world.trajectory import CameraPath, file_path, held_keys, key_path, pixel_intrinsics, pixel_poses

__all__ = ["Buffers", "CameraPath", "HELD_OUT_SEEDS", "OBJECT_KINDS", "TRAIN_SEEDS", "World", "WorldConfig",
           "file_path", "held_keys", "key_path", "make_world", "objects_near", "pixel_intrinsics", "pixel_poses",
           "render", "render_buffers", "seed_split", "to_uint8"]
