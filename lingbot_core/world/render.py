"""Ray casting and shading of a `World`: pixels for any camera pose and pinhole intrinsics.

One ray per pixel (or per sub-pixel with `supersample`), cast from the camera centre through the
pixel centre with the camera module's conventions: pose = camera-to-world 4x4 (OpenCV, +y down),
intrinsics (fx, fy, cx, cy) in pixels of the rendered frame, ray direction R @ ((x+0.5-cx)/fx,
(y+0.5-cy)/fy, 1) -- the same rays `plucker_block` describes to the model.

Per frame, in float32 torch, all rays at once:
1. cull: objects whose bounding sphere (grown by the reach of its shadow) is beyond the fog
   cut-off (`World.fog_distance`, where at most 3% of a surface still shows) or outside the view
   cone are dropped;
2. primary hits: the nearest front-facing hit over the ground plane and every primitive, each
   solved analytically; a ray is only paired with the primitives whose projected bounding sphere
   covers its 8x8-pixel tile, so the cost follows the pixels objects cover, not rays x objects;
3. shading: albedo x (ambient sky light + sun light x Lambert x shadow), where the shadow is a
   second cast towards the sun (binned the same way, in the plane across the sun); textures
   (ground, specks, foliage, windows) are value noise looked up in the world's table, each octave
   faded out where it would be finer than two pixels (so low resolutions do not shimmer);
4. fog towards the horizon colour with distance; sky gradient, sun disc and halo, and a cloud layer
   where nothing is hit.

A camera inside an object sees out of it (only front faces are hit). Output colours are in [0, 1].
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from lingbot_core.model.camera import validate_trajectory
from lingbot_core.world.scene import Primitives, World, objects_near

_NEAR = 1e-3  # hits closer than this along the ray are ignored (self-intersection of shadow rays)
_SHADOW_BIAS = 2e-3  # shadow rays start this far off the surface, along its normal
_SKY_ID, _GROUND_ID = -1, 0
_RAYS_PER_BATCH = 2**18  # frames are cast together up to about this many rays (bounds memory)


# Rays per pixel side of the training clips, the example start pictures and the ground truth: the pictures
# the model learned from are 2x2 supersampled, so every picture compared with them is rendered the same way.
SUPERSAMPLE = 2

class Buffers(NamedTuple):
    rgb: torch.Tensor  # [F, 3, H, W] float32 in [0, 1]
    depth: torch.Tensor  # [F, H, W] float32 distance along the (unit) ray; inf for the sky
    object_id: torch.Tensor  # [F, H, W] int64: -1 sky, 0 ground, >= 1 the object's stable id


def render(world: World, poses: np.ndarray, intrinsics: np.ndarray, width: int, height: int,
           supersample: int = 2) -> torch.Tensor:
    """Colour frames [F, 3, height, width] in [0, 1], averaging supersample x supersample rays a pixel.

    poses [F, 4, 4] camera-to-world; intrinsics [F, 4] or [4]: (fx, fy, cx, cy) in pixels of a
    width x height frame.
    """
    if isinstance(supersample, bool) or not isinstance(supersample, int) or supersample < 1:
        raise ValueError(f"supersample must be a positive integer; got {supersample!r}")
    poses, intrinsics = _check(poses, intrinsics, width, height)
    scaled = intrinsics * supersample  # (x+0.5)/s sub-pixel centres average to the pixel centre
    rgb = render_buffers(world, poses, scaled, width * supersample, height * supersample).rgb
    return F.avg_pool2d(rgb, supersample) if supersample > 1 else rgb


def render_buffers(world: World, poses: np.ndarray, intrinsics: np.ndarray, width: int,
                   height: int) -> Buffers:
    """One ray per pixel: colour, depth and object id (no supersampling: ids and depths do not average).

    Frames are cast together in batches; every ray's result depends only on its own frame, so a clip
    renders the same pixels as its frames rendered one at a time.
    """
    poses, intrinsics = _check(poses, intrinsics, width, height)
    # Every object a frame could show, or whose shadow it could show, in one draw for the clip.
    prims = objects_near(world, poses[:, [0, 2], 3], world.fog_distance + world.object_reach)
    batch = max(1, _RAYS_PER_BATCH // (width * height))
    parts = [_render_batch(world, prims, poses[i:i + batch], intrinsics[i:i + batch], width, height)
             for i in range(0, len(poses), batch)]
    return Buffers(*(torch.cat(chunk) for chunk in zip(*parts)))


def to_uint8(rgb: torch.Tensor) -> np.ndarray:
    """[F, 3, H, W] in [0, 1] -> [F, H, W, 3] uint8, rounded."""
    return (rgb.clamp(0, 1) * 255 + 0.5).to(torch.uint8).permute(0, 2, 3, 1).contiguous().numpy()


def _check(poses, intrinsics, width: int, height: int) -> tuple[np.ndarray, np.ndarray]:
    for name, value in (("width", width), ("height", height)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be a positive integer; got {value!r}")
    poses = np.asarray(poses, dtype=np.float64)
    intrinsics = np.asarray(intrinsics, dtype=np.float64)
    if poses.ndim == 2:
        poses = poses[None]
    if intrinsics.ndim == 1 and poses.ndim == 3:
        intrinsics = np.broadcast_to(intrinsics, (len(poses), *intrinsics.shape))
    return validate_trajectory(poses, intrinsics)


# ----------------------------------------------------------------------------------------------
# One frame


class _Frames(NamedTuple):
    """A batch of F pinhole cameras, as float32 tensors."""

    rotation: torch.Tensor  # [F, 3, 3] camera-to-world
    origin: torch.Tensor  # [F, 3]
    k: torch.Tensor  # [F, 4] fx, fy, cx, cy in pixels
    width: int
    height: int


def _rotate(rotation: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """rotation [..., 3, 3] @ v [..., 3], as products and 3-term sums: no BLAS call, whose blocking
    (and so rounding) could depend on how many frames share a batch."""
    return (rotation[..., :, 0] * v[..., 0:1] + rotation[..., :, 1] * v[..., 1:2]
            + rotation[..., :, 2] * v[..., 2:3])


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Dot product over a last axis of 3, written out (a reduction over 3 elements is slow in torch)."""
    return a[..., 0] * b[..., 0] + a[..., 1] * b[..., 1] + a[..., 2] * b[..., 2]


def _render_batch(world: World, prims: Primitives, poses: np.ndarray, ks: np.ndarray, width: int,
                  height: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    frames = _Frames(torch.from_numpy(poses[:, :3, :3].astype(np.float32)),
                     torch.from_numpy(poses[:, :3, 3].astype(np.float32)),
                     torch.from_numpy(ks.astype(np.float32)), width, height)
    count, pixels = len(poses), width * height
    fx, fy, cx, cy = frames.k.unbind(-1)
    xs = (torch.arange(width, dtype=torch.float32)[None, :] + 0.5 - cx[:, None]) / fx[:, None]  # [F, W]
    ys = (torch.arange(height, dtype=torch.float32)[None, :] + 0.5 - cy[:, None]) / fy[:, None]  # [F, H]
    camera_rays = torch.stack([xs[:, None, :].expand(count, height, width), ys[:, :, None].expand(count, height, width),
                               torch.ones(count, height, width)], dim=-1)  # [F, H, W, 3]
    dirs = F.normalize(_rotate(frames.rotation[:, None, None], F.normalize(camera_rays, dim=-1)), dim=-1)
    dirs = dirs.reshape(-1, 3)  # [R, 3], R = F * H * W, frame-major
    frame_of = torch.arange(count).repeat_interleave(pixels)
    origin = frames.origin.index_select(0, frame_of)  # [R, 3]
    tiles = -(-width // _TILE) * -(-height // _TILE)
    tile = ((torch.arange(height) // _TILE)[:, None] * (-(-width // _TILE))
            + (torch.arange(width) // _TILE)[None, :]).reshape(-1)
    ray_keys = (torch.arange(count)[:, None] * tiles + tile[None, :]).reshape(-1)

    visible = _cull(world, prims, poses, ks, width, height)
    t, kind_of, row_of, plane_of = _cast(prims, visible, origin, dirs,
                                         lambda mask, c, r: _screen_pairs(frames, mask, c, r, ray_keys),
                                         world.config.eye_height)
    point = origin + t[:, None] * dirs
    normal, albedo, object_id = _surface(prims, kind_of, row_of, plane_of, point, t, dirs)
    focal = torch.sqrt(fx * fy).index_select(0, frame_of)
    rgb = _shade(world, prims, visible, origin, frame_of, dirs, t, normal, albedo, object_id, focal)
    depth = torch.where(object_id == _SKY_ID, torch.full_like(t, math.inf), t)
    return (rgb.reshape(count, height, width, 3).permute(0, 3, 1, 2), depth.reshape(count, height, width),
            object_id.reshape(count, height, width))


def _cull(world: World, prims: Primitives, poses: np.ndarray, ks: np.ndarray, width: int,
          height: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per primitive kind: the rows that any frame keeps, and which frames keep each [F, rows].

    A frame keeps the objects it can show or see the shadow of: those whose bounding sphere, grown
    by the reach of its shadow, is nearer than the fog cut-off and meets the view cone.
    """
    fx, fy, cx, cy = (ks[:, i:i + 1] for i in range(4))  # [F, 1]
    # Half-angle of a cone around the optical axis that holds the whole frustum.
    corner = np.hypot(np.maximum(cx, width - cx) / fx, np.maximum(cy, height - cy) / fy)
    half_angle = np.arctan(corner)  # [F, 1]
    centre = prims.bound_centre.double().numpy()
    radius = (prims.bound_radius + prims.bound_height * world.sun_slope).double().numpy()
    offset = centre[None] - poses[:, None, :3, 3]  # [F, N, 3]
    distance = np.linalg.norm(offset, axis=-1)
    forward = poses[:, :3, 2] / np.linalg.norm(poses[:, :3, 2], axis=-1, keepdims=True)
    cos_angle = np.einsum("fnk,fk->fn", offset, forward) / np.maximum(distance, 1e-9)
    angle = np.arccos(np.clip(cos_angle, -1.0, 1.0))
    slack = np.arcsin(np.clip(radius / np.maximum(distance, 1e-9), 0.0, 1.0))
    keep = (distance - radius < world.fog_distance) & ((distance <= radius) | (angle <= half_angle + slack))
    keep = torch.from_numpy(keep)  # [F, N objects]
    order = torch.argsort(prims.bound_id)
    sorted_ids = prims.bound_id[order]
    out = {}
    for kind in KINDS:
        owner = order[torch.searchsorted(sorted_ids, getattr(prims, f"{kind}_id"))]  # object of each primitive
        kept = keep[:, owner]  # [F, M]
        rows = kept.any(0).nonzero().squeeze(1)
        out[kind] = (rows, kept[:, rows])
    return out


# ----------------------------------------------------------------------------------------------
# Intersections. Testing every ray against every primitive costs rays x primitives; instead each
# primitive's bounding sphere is binned (screen tiles for camera rays, cells of the plane across the
# sun for shadow rays) and a ray is tested only against the primitives of its bin. The per-pair
# solvers below take gathered origins o [N, 3], unit directions d [N, 3] and primitive rows [N], and
# return t [N] (inf where missed; front faces only).

KINDS = ("ellipsoid", "cylinder", "cone", "polytope")


def _roots(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Roots (-b -+ sqrt(b^2 - a c)) / a of a t^2 + 2 b t + c (nan where none; order swaps if a < 0)."""
    root = torch.sqrt(b * b - a * c)  # nan where the discriminant is negative
    return (-b - root) / a, (-b + root) / a


def _valid(t: torch.Tensor) -> torch.Tensor:
    return torch.where(t > _NEAR, t, math.inf)  # nan compares False: misses become inf too


def _pack(prims: Primitives, kind: str, rows: torch.Tensor) -> torch.Tensor:
    """The given primitives' parameters as one [M, K] matrix, so a pair needs a single gather.

    ellipsoid: centre xyz, radii xyz. cylinder: centre x z, y_top, y_bottom, radius.
    cone: apex xyz, height, radius. polytope: its planes, flattened (P x (nx, ny, nz, w)).
    """
    if kind == "ellipsoid":
        parts = [prims.ellipsoid_centre, prims.ellipsoid_radii]
    elif kind == "cylinder":
        parts = [prims.cylinder_centre_xz, prims.cylinder_y_top[:, None], prims.cylinder_y_bottom[:, None],
                 prims.cylinder_radius[:, None]]
    elif kind == "cone":
        parts = [prims.cone_apex, prims.cone_height[:, None], prims.cone_radius[:, None]]
    else:
        parts = [prims.polytope_planes.flatten(1)]
    return torch.cat(parts, 1).index_select(0, rows)


def _t_ellipsoid(q: torch.Tensor, o: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    r = q[:, 3:6]
    oc = (o - q[:, 0:3]) / r  # in the frame where the ellipsoid is a unit sphere
    dc = d / r
    near, _ = _roots(_dot(dc, dc), _dot(oc, dc), _dot(oc, oc) - 1.0)
    return _valid(near)


def _t_cylinder(q: torch.Tensor, o: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    top, bottom, r = q[:, 2], q[:, 3], q[:, 4]
    ox, oz = o[:, 0] - q[:, 0], o[:, 2] - q[:, 1]
    dx, dy, dz = d.unbind(-1)
    side, _ = _roots(dx * dx + dz * dz, ox * dx + oz * dz, ox * ox + oz * oz - r * r)
    y = o[:, 1] + side * dy
    side = torch.where((y >= top) & (y <= bottom), side, math.nan)
    cap = (top - o[:, 1]) / dy  # the top disc, seen from above
    px, pz = ox + cap * dx, oz + cap * dz
    cap = torch.where((px * px + pz * pz <= r * r) & (dy > 0), cap, math.nan)
    return torch.minimum(_valid(side), _valid(cap))


def _t_cone(q: torch.Tensor, o: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    h, r = q[:, 3], q[:, 4]
    rel = o - q[:, 0:3]
    k2 = (r / h) ** 2  # the radius grows by r/h per unit below the apex (y down)
    dx, dy, dz = d.unbind(-1)
    ox, oy, oz = rel.unbind(-1)
    t1, t2 = _roots(dx * dx + dz * dz - k2 * dy * dy, ox * dx + oz * dz - k2 * oy * dy, ox * ox + oz * oz - k2 * oy * oy)
    best = torch.full_like(h, math.inf)
    for t in (t1, t2):  # either root may be the near one, or lie on the mirrored cone above the apex
        y = oy + t * dy
        best = torch.minimum(best, _valid(torch.where((y >= 0) & (y <= h), t, math.nan)))
    base = (h - oy) / dy  # the base disc, seen from below
    px, pz = ox + base * dx, oz + base * dz
    base = torch.where((px * px + pz * pz <= r * r) & (dy < 0), base, math.nan)
    return torch.minimum(best, _valid(base))


def _t_polytope(q: torch.Tensor, o: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """t [N] and the index of the plane the ray enters through [N]."""
    planes = q.reshape(len(q), -1, 4)  # [N, P, 4]
    denom = _dot(planes, d[:, None])  # _dot reads the first three of (nx, ny, nz, w)
    num = planes[..., 3] - _dot(planes, o[:, None])
    t = num / denom
    t_near, plane = torch.where(denom < 0, t, -math.inf).max(-1)
    t_far = torch.where(denom > 0, t, math.inf).min(-1).values
    outside = ((denom == 0) & (num < 0)).any(-1)  # parallel to a face and outside it
    return _valid(torch.where((t_near <= t_far) & ~outside, t_near, math.nan)), plane


_SOLVERS = {"ellipsoid": _t_ellipsoid, "cylinder": _t_cylinder, "cone": _t_cone}


def _bounds(kind: str, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Bounding spheres (centre [M, 3], radius [M]) of packed primitives (see `_pack`)."""
    if kind == "ellipsoid":
        return q[:, 0:3], q[:, 3:6].amax(-1)
    if kind == "cylinder":
        top, bottom = q[:, 2], q[:, 3]
        centre = torch.stack([q[:, 0], (top + bottom) / 2, q[:, 1]], -1)
        return centre, torch.hypot(q[:, 4], (bottom - top) / 2)
    if kind == "cone":
        h = q[:, 3]
        centre = q[:, 0:3] + torch.stack([torch.zeros_like(h), h / 2, torch.zeros_like(h)], -1)
        return centre, torch.hypot(q[:, 4], h / 2)
    raise ValueError("polytope bounds come from Primitives.polytope_bound")


def _join(ray_keys: torch.Tensor, prim_keys: torch.Tensor, prim_rows: torch.Tensor, num_keys: int):
    """All (ray, primitive row) pairs that share a bin key in [0, num_keys): (ray index [N], row [N])."""
    order = torch.argsort(prim_keys, stable=True)
    rows = prim_rows[order]
    per_key = torch.bincount(prim_keys, minlength=num_keys)
    start = torch.cumsum(per_key, 0) - per_key
    counts = per_key[ray_keys]
    ray_index = torch.repeat_interleave(torch.arange(len(ray_keys)), counts)
    first = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    within = torch.arange(len(ray_index)) - first
    return ray_index, rows[start[ray_keys][ray_index] + within]


def _boxes_to_keys(x0: torch.Tensor, x1: torch.Tensor, y0: torch.Tensor, y1: torch.Tensor, columns: int):
    """Expand inclusive integer boxes [M] into (box index [K], key = y * columns + x [K])."""
    widths, heights = (x1 - x0 + 1).clamp(min=0), (y1 - y0 + 1).clamp(min=0)
    counts = widths * heights
    box = torch.repeat_interleave(torch.arange(len(counts)), counts)
    offset = torch.arange(len(box)) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    xs = x0[box] + offset % widths[box]
    ys = y0[box] + torch.div(offset, widths[box], rounding_mode="floor")
    return box, ys * columns + xs


_TILE = 8  # pixels per side of a screen bin


def _screen_pairs(frames: _Frames, mask: torch.Tensor, centre: torch.Tensor, radius: torch.Tensor,
                  ray_keys: torch.Tensor):
    """(ray, primitive) pairs whose ray passes a tile that the primitive's projected bounding sphere
    covers in the ray's own frame. mask [F, M]: the frames that keep each primitive."""
    width, height = frames.width, frames.height
    # World -> camera frame: R^T (c - o), R orthonormal.
    local = _rotate(frames.rotation.transpose(1, 2)[:, None], centre[None] - frames.origin[:, None])  # [F, M, 3]
    x, y, z = local.unbind(-1)
    fx, fy, cx, cy = (v[:, None] for v in frames.k.unbind(-1))  # [F, 1]
    tiles_x, tiles_y = -(-width // _TILE), -(-height // _TILE)
    ahead = z - radius > 1e-2

    def extent(lateral: torch.Tensor, focal: torch.Tensor, principal: torch.Tensor):
        # Exact extent of a sphere's projection along one image axis: tangents from the centre of
        # projection to the circle the sphere projects to in that axis's plane (valid when z > radius).
        dist = torch.sqrt(lateral * lateral + z * z)
        theta = torch.atan2(lateral, z)
        alpha = torch.asin((radius / dist.clamp(min=1e-9)).clamp(max=1.0))
        low = focal * torch.tan((theta - alpha).clamp(-1.5, 1.5)) + principal
        high = focal * torch.tan((theta + alpha).clamp(-1.5, 1.5)) + principal
        return low, high

    lx, hx = extent(x, fx, cx)
    ly, hy = extent(y, fy, cy)
    # Pixel p is hit only if its centre p + 0.5 lies in [low, high]; one pixel of margin for rounding.
    # A sphere that reaches the camera's plane gets the whole frame.
    x0 = torch.where(ahead, torch.floor(lx - 1.5), 0.0).clamp(0, width - 1).long() // _TILE
    x1 = torch.where(ahead, torch.ceil(hx + 0.5), float(width)).clamp(0, width - 1).long() // _TILE
    y0 = torch.where(ahead, torch.floor(ly - 1.5), 0.0).clamp(0, height - 1).long() // _TILE
    y1 = torch.where(ahead, torch.ceil(hy + 0.5), float(height)).clamp(0, height - 1).long() // _TILE
    off_screen = ahead & ((lx > width) | (hx < 0) | (ly > height) | (hy < 0))
    behind = z + radius < 0  # wholly behind the camera
    y1 = torch.where(off_screen | behind | ~mask, -1, y1)  # an empty box
    box, keys = _boxes_to_keys(x0.reshape(-1), x1.reshape(-1), y0.reshape(-1), y1.reshape(-1), tiles_x)
    prims_per_frame = centre.shape[0]
    keys = keys + torch.div(box, prims_per_frame, rounding_mode="floor") * (tiles_x * tiles_y)
    ray_index, box = _join(ray_keys, keys, box, len(frames.k) * tiles_x * tiles_y)
    return ray_index, box % prims_per_frame


_SHADOW_CELL = 0.25  # world units per side of a bin in the plane across the sun


def _sun_pairs(sun: torch.Tensor, points: torch.Tensor, point_frame: torch.Tensor, mask: torch.Tensor,
               centre: torch.Tensor, radius: torch.Tensor):
    """(ray, primitive) pairs for shadow rays from `points` towards `sun`: bins of the plane across
    the sun (an orthographic projection), per frame. mask [F, M]: the frames that keep each primitive."""
    helper = torch.tensor([1.0, 0.0, 0.0]) if abs(float(sun[0])) < 0.9 else torch.tensor([0.0, 0.0, 1.0])
    e1 = F.normalize(torch.linalg.cross(sun, helper), dim=0)
    e2 = torch.linalg.cross(sun, e1)
    basis = torch.stack([e1, e2])  # [2, 3]

    def project(v: torch.Tensor) -> torch.Tensor:  # [N, 3] -> [N, 2] bin coordinates, no BLAS (see _rotate)
        return torch.stack([_dot(v, basis[0]), _dot(v, basis[1])], -1) / _SHADOW_CELL

    p_uv = torch.floor(project(points)).long()
    c_uv = project(centre)
    r = radius / _SHADOW_CELL
    # Bins span the points' extent only; primitive boxes are clipped to it (beyond, no ray to block).
    first, last = p_uv.amin(0), p_uv.amax(0)
    columns, rows = int(last[0] - first[0]) + 1, int(last[1] - first[1]) + 1
    low = (torch.floor(c_uv - r[:, None]).long() - first).clamp(min=0)
    high = torch.minimum(torch.floor(c_uv + r[:, None]).long() - first, torch.tensor([columns - 1, rows - 1]))
    count, prims = mask.shape
    y1 = torch.where(mask, high[None, :, 1], -1)  # [F, M]: frames that culled a primitive get an empty box
    box, keys = _boxes_to_keys(low[:, 0].repeat(count), high[:, 0].repeat(count), low[:, 1].repeat(count),
                               y1.reshape(-1), columns)
    bins = columns * rows
    keys = keys + torch.div(box, prims, rounding_mode="floor") * bins
    ray_keys = point_frame * bins + (p_uv[:, 1] - first[1]) * columns + (p_uv[:, 0] - first[0])
    ray_index, box = _join(ray_keys, keys, box, count * bins)
    return ray_index, box % prims


def _cast(prims: Primitives, visible: dict[str, tuple[torch.Tensor, torch.Tensor]], o: torch.Tensor,
          d: torch.Tensor, pairs_for, ground_y: float | None):
    """Nearest hit per ray over the ground plane (unless None) and the visible primitives.

    o, d [R, 3]. `pairs_for(mask, centre, radius)` bins the rays against bounding spheres. Returns t [R] and, per ray,
    the winning (kind index, primitive row, polytope plane), kind -1 for the ground or nothing.
    """
    rays = d.shape[0]
    best = torch.full((rays,), math.inf) if ground_y is None else _valid((ground_y - o[:, 1]) / d[:, 1])
    candidates = []
    for kind_index, kind in enumerate(KINDS):
        rows, mask = visible[kind]
        if rows.numel() == 0:
            continue
        packed = _pack(prims, kind, rows)
        if kind == "polytope":
            bound = prims.polytope_bound.index_select(0, rows)
            centre, radius = bound[:, :3], bound[:, 3]
        else:
            centre, radius = _bounds(kind, packed)
        ray_index, box = pairs_for(mask, centre, radius)
        if ray_index.numel() == 0:
            continue
        q = packed.index_select(0, box)
        origin = o.index_select(0, ray_index)
        direction = d.index_select(0, ray_index)
        if kind == "polytope":
            t, plane = _t_polytope(q, origin, direction)
        else:
            t, plane = _SOLVERS[kind](q, origin, direction), None
        best = best.scatter_reduce(0, ray_index, t, reduce="amin")
        candidates.append((kind_index, ray_index, rows.index_select(0, box), t, plane))
    kind_of = torch.full((rays,), -1, dtype=torch.int64)
    row_of = torch.zeros(rays, dtype=torch.int64)
    plane_of = torch.zeros(rays, dtype=torch.int64)
    # The winner of each ray: a pair whose t equals the best (exact ties between two primitives are
    # resolved by the later write, in a fixed order).
    for kind_index, ray_index, prim_rows, t, plane in candidates:
        wins = ((t == best.index_select(0, ray_index)) & torch.isfinite(t)).nonzero().squeeze(1)
        winners = ray_index.index_select(0, wins)
        kind_of.index_fill_(0, winners, kind_index)
        row_of.index_copy_(0, winners, prim_rows.index_select(0, wins))
        if plane is not None:
            plane_of.index_copy_(0, winners, plane.index_select(0, wins))
    return best, kind_of, row_of, plane_of


def _surface(prims: Primitives, kind_of, row_of, plane_of, point: torch.Tensor, t: torch.Tensor,
             d: torch.Tensor):
    """Normal facing the ray [R, 3], albedo [R, 3] and object id [R] at each primary hit."""
    object_id = torch.where(torch.isfinite(t), _GROUND_ID, _SKY_ID).to(torch.int64)
    normal = torch.tensor([0.0, -1.0, 0.0]).repeat(len(d), 1)
    albedo = torch.zeros_like(d)
    for kind_index, kind in enumerate(KINDS):
        mine = (kind_of == kind_index).nonzero().squeeze(1)
        if mine.numel() == 0:
            continue
        rows = row_of.index_select(0, mine)
        q = _pack(prims, kind, rows)
        p = point.index_select(0, mine)
        slack = 1e-3 * (1 + t.index_select(0, mine))  # how close to a cap plane counts as on it
        if kind == "ellipsoid":
            n = (p - q[:, 0:3]) / (q[:, 3:6] * q[:, 3:6])
        elif kind == "cylinder":
            radial = torch.stack([p[:, 0] - q[:, 0], torch.zeros_like(p[:, 0]), p[:, 2] - q[:, 1]], -1)
            on_cap = (p[:, 1] - q[:, 2]).abs() < slack
            n = torch.where(on_cap[:, None], torch.tensor([0.0, -1.0, 0.0]), radial)
        elif kind == "cone":
            h, r = q[:, 3], q[:, 4]
            rel = p - q[:, 0:3]
            n = torch.stack([rel[:, 0], -(r / h) ** 2 * rel[:, 1], rel[:, 2]], -1)
            n = torch.where(((rel[:, 1] - h).abs() < slack)[:, None], torch.tensor([0.0, 1.0, 0.0]), n)
        else:
            planes = q.reshape(len(q), -1, 4)
            n = planes[torch.arange(len(q)), plane_of.index_select(0, mine), :3]
        normal.index_copy_(0, mine, F.normalize(n, dim=-1))
        albedo.index_copy_(0, mine, getattr(prims, f"{kind}_albedo").index_select(0, rows))
        object_id.index_copy_(0, mine, getattr(prims, f"{kind}_id").index_select(0, rows))
    facing = (_dot(normal, d) > 0)[:, None]
    return torch.where(facing, -normal, normal), albedo, object_id


# ----------------------------------------------------------------------------------------------
# Textures and shading


def _value_noise(table: torch.Tensor, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Smooth value noise in [0, 1] at lattice coordinates (u, v); the table tiles the plane.

    Bilinear lookup at coordinates whose fractional parts went through smoothstep: that is exactly
    smoothstep interpolation between lattice values, done by grid_sample's optimised kernel.
    `table` is the world's noise table padded with its first row and column (see `_padded`).
    """
    size = table.shape[0] - 1

    def warp(x: torch.Tensor) -> torch.Tensor:
        x = torch.remainder(x, size)
        f = torch.frac(x)
        return x - f + f * f * (3 - 2 * f)

    grid = torch.stack([warp(v), warp(u)], -1) * (2.0 / size) - 1.0  # grid_sample's x indexes columns
    return F.grid_sample(table[None, None], grid[None, None], mode="bilinear", align_corners=True)[0, 0, 0]


def _padded(noise: torch.Tensor) -> torch.Tensor:
    """The noise table with its first row and column repeated at the end, so lookups wrap."""
    padded = torch.cat([noise, noise[:1]], 0)
    return torch.cat([padded, padded[:, :1]], 1)


def _lod(cell: float, footprint: torch.Tensor) -> torch.Tensor:
    """1 where lattice cells span >= 4 pixels, 0 at <= 2 pixels: octaves finer than that would alias."""
    return (cell / (2.0 * footprint) - 1.0).clamp(0.0, 1.0)


def _octaves(table, u, v, footprint, octaves) -> torch.Tensor:
    """Sum of (noise - 0.5) * amplitude over (cell, amplitude, offset) octaves, each LOD-faded."""
    total = torch.zeros_like(u)
    for cell, amplitude, offset in octaves:
        fade = _lod(cell, footprint)
        if bool((fade > 0).any()):
            total = total + amplitude * fade * (_value_noise(table, u / cell + offset, v / cell + 2 * offset) - 0.5)
    return total


def _smoothstep(lo: float, hi: float, x: torch.Tensor) -> torch.Tensor:
    x = ((x - lo) / (hi - lo)).clamp(0, 1)
    return x * x * (3 - 2 * x)


def _shade(world: World, prims: Primitives, visible: dict[str, tuple[torch.Tensor, torch.Tensor]],
           origin: torch.Tensor, frame_of: torch.Tensor, d: torch.Tensor, t: torch.Tensor, normal: torch.Tensor,
           albedo: torch.Tensor, object_id: torch.Tensor, focal: torch.Tensor) -> torch.Tensor:
    """Colours [R, 3]: origin [R, 3], frame_of [R] (each ray's frame), focal [R] in pixels."""
    style, cfg = world.style, world.config
    table = _padded(world.noise)
    sun = torch.tensor(style.sun_direction, dtype=torch.float32)
    horizon = torch.tensor(style.sky_horizon)
    zenith = torch.tensor(style.sky_zenith)
    sky_rows = (object_id == _SKY_ID).nonzero().squeeze(1)
    surface_rows = (object_id != _SKY_ID).nonzero().squeeze(1)
    rgb = torch.empty(d.shape[0], 3)

    # Sky: gradient by elevation (up is -y), sun disc and halo, clouds on a plane above.
    sd = d.index_select(0, sky_rows)
    elevation = (-sd[:, 1]).clamp(min=0.0)
    sky = torch.lerp(horizon, zenith, elevation.pow(0.6)[:, None])
    cos_sun = _dot(sd, sun)
    sky = sky + torch.tensor(style.sun_colour) * (0.3 * torch.exp((cos_sun - 1.0) * 25.0)
                                                  + _smoothstep(0.9985, 0.9992, cos_sun))[:, None]
    lift = (cfg.cloud_height / elevation.clamp(min=0.05))[:, None]
    cloud_xz = origin.index_select(0, sky_rows)[:, [0, 2]] + sd[:, [0, 2]] * lift
    puffs = (_value_noise(table, cloud_xz[:, 0] / 5.0 + 101.0, cloud_xz[:, 1] / 5.0 + 57.0) * 0.7
             + _value_noise(table, cloud_xz[:, 0] / 1.8 + 13.0, cloud_xz[:, 1] / 1.8 + 71.0) * 0.3)
    cover = _smoothstep(1.0 - style.cloud_cover, 1.15 - style.cloud_cover * 0.8, puffs)
    cover = cover * _smoothstep(0.03, 0.2, elevation)  # thin out towards the horizon, where they would alias
    cloud = torch.tensor([0.95, 0.95, 0.97]) * (0.75 + 0.25 * elevation[:, None])
    rgb = rgb.index_copy(0, sky_rows, torch.lerp(sky, cloud, (0.85 * cover)[:, None]))

    # Surfaces: albedo with texture, then sun and sky light. Ground and object textures are both
    # computed for every surface ray and chosen per ray (cheaper than splitting the rays again).
    take = lambda x: x.index_select(0, surface_rows)  # noqa: E731
    ts, ds, ids, n = take(t), take(d), take(object_id), take(normal)
    p = take(origin) + ts[:, None] * ds
    cos_view = _dot(n, ds).abs().clamp(min=1e-3)
    footprint = ts / (take(focal) * cos_view.sqrt())  # world units a pixel covers there
    x, y, z = p.unbind(-1)

    patch = _smoothstep(0.35, 0.65, _value_noise(table, x / 2.5, z / 2.5))
    ground = torch.lerp(torch.tensor(style.ground_a), torch.tensor(style.ground_b), patch[:, None])
    ground = ground * (1.0 + _octaves(table, x, z, footprint,
                                      ((0.7, 0.4, 17.3), (0.2, 0.6, 41.7), (0.06, 0.45, 73.1))))[:, None]
    # Specks (pebbles, flowers): sharp light and dark points give strong motion cues near the camera.
    speck_fade = _lod(0.08, footprint)
    light = _smoothstep(0.70, 0.76, _value_noise(table, x / 0.08 + 7.7, z / 0.08 + 3.1)) * speck_fade
    dark = _smoothstep(0.70, 0.76, _value_noise(table, x / 0.08 + 91.3, z / 0.08 + 37.9)) * speck_fade
    ground = torch.lerp(ground, torch.tensor([0.92, 0.88, 0.75]), (0.7 * light)[:, None]) * (1.0 - 0.5 * dark)[:, None]
    # Objects: mottling in a direction-free pair of coordinates (x + z, y): foliage, bark and stone grain.
    mottle = _octaves(table, x + 0.6 * z, y, footprint, ((0.16, 0.35, 5.7), (0.05, 0.25, 29.3)))
    thing = take(albedo) * (1.0 + mottle)[:, None]
    # Windows: dark panes on the vertical walls of houses, in a band above the ground.
    height_above = cfg.eye_height - y
    spacing = cfg.window_spacing * cfg.object_scale
    along = torch.remainder((x * n[:, 2] - z * n[:, 0]) / spacing, 1.0)  # coordinate along the wall, in windows
    windows = ((n[:, 1].abs() < 0.05) & torch.isin(ids, prims.polytope_id)
               & (height_above > cfg.window_band[0] * cfg.object_scale)
               & (height_above < cfg.window_band[1] * cfg.object_scale)
               & (along > 0.35) & (along < 0.75) & (_lod(0.1, footprint) > 0.5))
    thing = torch.where(windows[:, None], torch.tensor([0.16, 0.2, 0.28]), thing)
    base = torch.where((ids == _GROUND_ID)[:, None], ground, thing)

    lambert = _dot(n, sun).clamp(min=0.0)
    shadow = torch.ones_like(lambert)
    # Shadows only where fog leaves something to see (this also bounds the shadow bins' extent).
    lit = ((lambert > 0) & (ts < world.fog_distance)).nonzero().squeeze(1)
    if lit.numel():
        starts = p[lit] + _SHADOW_BIAS * n[lit]
        start_frame = take(frame_of)[lit]
        blocked, _, _, _ = _cast(prims, visible, starts, sun.expand(len(lit), 3),
                                 lambda mask, c, r: _sun_pairs(sun, starts, start_frame, mask, c, r), ground_y=None)
        shadow[lit] = torch.isinf(blocked).to(torch.float32)
    sky_light = torch.lerp(horizon, zenith, 0.25 - 0.25 * n[:, 1:2].clamp(-1, 1))
    light = (style.ambient * sky_light
             + (1.0 - style.ambient) * 1.25 * (lambert * shadow)[:, None] * torch.tensor(style.sun_colour))
    colour = base * light

    # Fog towards the horizon colour.
    fog = 1.0 - torch.exp(-style.fog_density * (ts - cfg.fog_start).clamp(min=0.0))
    rgb = rgb.index_copy(0, surface_rows, torch.lerp(colour, horizon.expand_as(colour), fog[:, None]))
    return rgb.clamp(0.0, 1.0)
