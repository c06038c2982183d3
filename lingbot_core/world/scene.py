"""Seeded procedural worlds: a look (sky, sun, ground, fog) and an endless field of objects.

A world is fixed by its integer seed. Its look (`WorldStyle`) is drawn once from the seed; its objects
are drawn lazily per square cell of the ground from (seed, cell row, cell column), so any region of
an unbounded world can be built on demand, in any order, and always comes out the same. The
renderer (`render.py`) asks for the objects near a camera path with `objects_near`.

Coordinates are the camera module's world frame (OpenCV: +x right, +y DOWN, +z forward at the
start pose). The session's first camera sits at the origin, so the ground is the plane
y = +eye_height, and an object of height h spans y in [eye_height - h, eye_height].

Objects are built from four primitive kinds that the ray caster intersects analytically:
ellipsoids (round tree crowns, rocks), capped vertical cylinders (trunks, pillars), vertical cones
(pine crowns) and convex polytopes given by up to `POLYTOPE_PLANES` half-spaces (house walls and
gable roofs). Each primitive carries its albedo and the id of the object it belongs to (0 is the
ground, -1 the sky, ids of objects are >= 1 and stable across frames).

Seeds: `TRAIN_SEEDS` and `HELD_OUT_SEEDS` are fixed, disjoint ranges. Evaluation and the demo's
examples use held-out worlds only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

TRAIN_SEEDS = range(0, 1_000_000)
HELD_OUT_SEEDS = range(1_000_000, 1_010_000)

OBJECT_KINDS = ("pine", "round_tree", "rock", "house", "pillar")
POLYTOPE_PLANES = 6  # a box has 6 faces; a gable roof 5 (padded with an always-true plane)

# Offsets that make cell coordinates non-negative for numpy's SeedSequence (it takes unsigned
# integers); +-2**40 cells of a few units each is far beyond any float32 pose.
_CELL_OFFSET = 2**40
# Separate random streams of one seed: the look, each cell's objects, their shapes, the start objects.
_STREAM_LOOK, _STREAM_CELL, _STREAM_SHAPE, _STREAM_START = 0, 1, 2, 3
# Object index within a cell: drawn objects use 0.._START_INDEX-1, start objects _START_INDEX and up.
_START_INDEX = 120
# No object at scale 1 is taller than 1.86 (a pillar and its cap) or has a bounding radius above that.
_MAX_EXTENT_AT_SCALE_1 = 1.86


def seed_split(seed: int) -> str:
    """'train' or 'held_out'; any other seed is refused so that a typo cannot leak across the split."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"a world seed must be an integer; got {type(seed).__name__}")
    if seed in TRAIN_SEEDS:
        return "train"
    if seed in HELD_OUT_SEEDS:
        return "held_out"
    raise ValueError(f"world seed {seed} is outside the train range [{TRAIN_SEEDS.start}, {TRAIN_SEEDS.stop}) "
                     f"and the held-out range [{HELD_OUT_SEEDS.start}, {HELD_OUT_SEEDS.stop})")


@dataclass(frozen=True)
class WorldConfig:
    """Sizes of the world in world units (the camera integrator moves 0.05 a latent frame)."""

    # A key step moves 0.05 (0.15 a block of 12 frames, 0.75 s): with the eye 0.2 above the ground that
    # is a brisk walk, so W visibly moves the picture from one block to the next.
    eye_height: float = 0.2  # camera height above the ground at the start pose
    object_scale: float = 0.65  # every object length is this times its scale-1 size (eye height 0.3)
    cell_size: float = 2.0  # objects are drawn per cell of this side
    objects_per_cell: float = 1.0  # Poisson mean (density ~0.25 per square unit before rejections)
    min_spacing: float = 0.2  # between object footprints within a cell
    spawn_clear_radius: float = 0.3  # no object footprint within this of the start position
    # A few objects placed ahead of the start pose, so every world's first frame has near parallax.
    start_objects: int = 3
    start_distance: tuple[float, float] = (0.9, 2.6)
    start_half_angle_deg: float = 28.0
    noise_size: int = 256  # side of the value-noise table (texture repeats every noise_size cells)
    cloud_height: float = 12.0  # the cloud layer, above the start height
    window_band: tuple[float, float] = (0.17, 0.33)  # house window sills and lintels above the ground, at scale 1
    window_spacing: float = 0.32  # from one window to the next along a wall, at scale 1
    # Fog: colour -> horizon colour with 1 - exp(-density * max(t - fog_start, 0)); objects beyond the
    # distance where fog reaches fog_cutoff are not intersected at all.
    fog_start: float = 2.0
    fog_density_range: tuple[float, float] = (0.15, 0.26)
    fog_cutoff: float = 0.97


@dataclass(frozen=True)
class WorldStyle:
    """The look of one world, drawn from its seed."""

    sky_zenith: tuple[float, float, float]
    sky_horizon: tuple[float, float, float]
    sun_direction: tuple[float, float, float]  # unit vector towards the sun (world frame, y down)
    sun_colour: tuple[float, float, float]
    ambient: float
    ground_a: tuple[float, float, float]
    ground_b: tuple[float, float, float]
    cloud_cover: float  # 0: clear sky .. 1: overcast
    fog_density: float
    kind_weights: tuple[float, ...]  # probability of each OBJECT_KINDS entry


class Primitives(NamedTuple):
    """Every primitive of a set of objects, as float32 tensors grouped by kind (M_kind rows each).

    ellipsoids: centre [M,3], radii [M,3]. cylinders: centre_xz [M,2], y_top [M], y_bottom [M], radius [M]
    (y_top < y_bottom: y points down). cones: apex [M,3], height [M], radius [M] (base at apex_y + height).
    polytopes: planes [M,P,4] rows (nx, ny, nz, w), inside where n.p <= w, and a bounding sphere
    polytope_bound [M,4] (centre xyz, radius) since planes alone do not give one cheaply.
    Per kind also albedo [M,3] and object_id [M] (int64). Bounds per object for culling: bound_centre
    [N,3], bound_radius [N], shadow_reach [N] (how far beyond the bound its shadow can fall).
    """

    ellipsoid_centre: torch.Tensor
    ellipsoid_radii: torch.Tensor
    ellipsoid_albedo: torch.Tensor
    ellipsoid_id: torch.Tensor
    cylinder_centre_xz: torch.Tensor
    cylinder_y_top: torch.Tensor
    cylinder_y_bottom: torch.Tensor
    cylinder_radius: torch.Tensor
    cylinder_albedo: torch.Tensor
    cylinder_id: torch.Tensor
    cone_apex: torch.Tensor
    cone_height: torch.Tensor
    cone_radius: torch.Tensor
    cone_albedo: torch.Tensor
    cone_id: torch.Tensor
    polytope_planes: torch.Tensor
    polytope_bound: torch.Tensor
    polytope_albedo: torch.Tensor
    polytope_id: torch.Tensor
    bound_centre: torch.Tensor
    bound_radius: torch.Tensor
    bound_height: torch.Tensor
    bound_id: torch.Tensor


@dataclass(frozen=True, eq=False)
class World:
    """A seeded world: its look, its value-noise texture table, and its config.

    Objects are not stored: `objects_near` draws the cells it needs from the seed each time.
    """

    seed: int
    config: WorldConfig
    style: WorldStyle
    noise: torch.Tensor  # [noise_size, noise_size] float32 in [0, 1], read-only by convention

    @property
    def fog_distance(self) -> float:
        """Distance beyond which fog hides everything (less than 1 - fog_cutoff of a surface shows)."""
        return self.config.fog_start + math.log(1.0 / (1.0 - self.config.fog_cutoff)) / self.style.fog_density

    @property
    def object_reach(self) -> float:
        """An upper bound on any object's bounding radius plus the length of its shadow."""
        return self.config.object_scale * _MAX_EXTENT_AT_SCALE_1 * (1.0 + self.sun_slope)

    @property
    def sun_slope(self) -> float:
        """Horizontal length of the shadow of a unit of height."""
        sun = self.style.sun_direction
        return math.hypot(sun[0], sun[2]) / max(-sun[1], 1e-3)


def make_world(seed: int, config: WorldConfig = WorldConfig()) -> World:
    """The world of `seed` (which must lie in TRAIN_SEEDS or HELD_OUT_SEEDS)."""
    seed_split(seed)
    rng = np.random.default_rng([int(seed), _STREAM_LOOK])
    style = _draw_style(rng, config)
    noise = torch.from_numpy(rng.random((config.noise_size, config.noise_size), dtype=np.float32))
    return World(int(seed), config, style, noise)


# ----------------------------------------------------------------------------------------------
# The look of a world


def _mix(a, b, u: float) -> tuple[float, float, float]:
    return tuple(float((1 - u) * x + u * y) for x, y in zip(a, b))


def _jitter(rng: np.random.Generator, colour, amount: float) -> tuple[float, float, float]:
    return tuple(float(np.clip(c + rng.uniform(-amount, amount), 0.0, 1.0)) for c in colour)


# Palettes the looks are mixed from: (zenith, horizon) pairs for day, golden hour and overcast skies.
_SKIES = (
    ((0.20, 0.42, 0.80), (0.70, 0.82, 0.95)),
    ((0.25, 0.35, 0.65), (0.95, 0.72, 0.50)),
    ((0.48, 0.52, 0.58), (0.78, 0.80, 0.82)),
)
_GROUNDS = (
    ((0.30, 0.50, 0.18), (0.45, 0.55, 0.22)),  # meadow
    ((0.55, 0.50, 0.28), (0.42, 0.45, 0.20)),  # dry grass
    ((0.70, 0.62, 0.45), (0.55, 0.47, 0.33)),  # sand and earth
    ((0.35, 0.42, 0.25), (0.40, 0.33, 0.24)),  # moss and mud
)


def _draw_style(rng: np.random.Generator, config: WorldConfig) -> WorldStyle:
    sky = _SKIES[rng.integers(len(_SKIES))]
    ground = _GROUNDS[rng.integers(len(_GROUNDS))]
    elevation = math.radians(rng.uniform(25.0, 60.0))
    azimuth = rng.uniform(-math.pi, math.pi)
    # Up is -y: a sun at elevation e has y = -sin(e).
    sun = (math.cos(elevation) * math.sin(azimuth), -math.sin(elevation), math.cos(elevation) * math.cos(azimuth))
    warm = rng.uniform(0.0, 0.5)
    # Every kind keeps some weight so every world shows several silhouettes.
    weights = rng.dirichlet(np.full(len(OBJECT_KINDS), 1.5)) * 0.7 + 0.3 / len(OBJECT_KINDS)
    return WorldStyle(
        sky_zenith=_jitter(rng, sky[0], 0.05),
        sky_horizon=_jitter(rng, sky[1], 0.04),
        sun_direction=sun,
        sun_colour=_mix((1.0, 0.98, 0.92), (1.0, 0.80, 0.60), warm),
        ambient=float(rng.uniform(0.35, 0.5)),
        ground_a=_jitter(rng, ground[0], 0.05),
        ground_b=_jitter(rng, ground[1], 0.05),
        cloud_cover=float(rng.uniform(0.1, 0.7)),
        fog_density=float(rng.uniform(*config.fog_density_range)),
        kind_weights=tuple(float(w) for w in weights / weights.sum()),
    )


# ----------------------------------------------------------------------------------------------
# Objects, per cell


_FOLIAGE = ((0.16, 0.38, 0.14), (0.22, 0.45, 0.16), (0.30, 0.50, 0.12), (0.55, 0.42, 0.10), (0.62, 0.28, 0.10))
_PINE = ((0.08, 0.28, 0.14), (0.10, 0.33, 0.20), (0.14, 0.30, 0.12))
_BARK = (0.33, 0.22, 0.13)
_ROCK = ((0.50, 0.50, 0.50), (0.45, 0.42, 0.38), (0.60, 0.58, 0.54), (0.38, 0.36, 0.36))
_WALLS = ((0.90, 0.86, 0.76), (0.78, 0.45, 0.32), (0.85, 0.80, 0.55), (0.70, 0.75, 0.80))
_ROOFS = ((0.60, 0.18, 0.12), (0.30, 0.25, 0.22), (0.20, 0.30, 0.50), (0.45, 0.30, 0.15))
_PILLARS = ((0.90, 0.20, 0.15), (0.15, 0.35, 0.85), (0.95, 0.80, 0.15), (0.92, 0.92, 0.92), (0.60, 0.20, 0.70))


class _Builder:
    """Collects primitives (as Python lists) while the cells are drawn; `finish` makes tensors."""

    def __init__(self) -> None:
        self.ellipsoids: list[tuple] = []
        self.cylinders: list[tuple] = []
        self.cones: list[tuple] = []
        self.polytopes: list[tuple] = []
        self.bounds: list[tuple] = []

    def finish(self) -> Primitives:
        def cols(rows, widths):
            # Split row tuples into float32 columns of the given widths (1 = a vector).
            if not rows:
                return [torch.zeros((0, w) if w > 1 else (0,), dtype=torch.float32) for w in widths]
            flat = torch.tensor([[v for part in row for v in (part if isinstance(part, tuple) else (part,))]
                                 for row in rows], dtype=torch.float64)
            out, start = [], 0
            for w in widths:
                column = flat[:, start:start + w]
                out.append((column if w > 1 else column[:, 0]).to(torch.float32))
                start += w
            return out

        def ids(rows):
            return torch.tensor([row[-1] for row in rows], dtype=torch.int64)

        e = cols([r[:-1] for r in self.ellipsoids], (3, 3, 3))
        c = cols([r[:-1] for r in self.cylinders], (2, 1, 1, 1, 3))
        k = cols([r[:-1] for r in self.cones], (3, 1, 1, 3))
        planes = (torch.tensor(np.array([r[0] for r in self.polytopes]), dtype=torch.float32)
                  if self.polytopes else torch.zeros((0, POLYTOPE_PLANES, 4)))
        p_bound, p_albedo = cols([(r[1], r[2]) for r in self.polytopes], (4, 3))
        b = cols([r[:-1] for r in self.bounds], (3, 1, 1))
        return Primitives(*e, ids(self.ellipsoids), *c, ids(self.cylinders), *k, ids(self.cones),
                          planes, p_bound, p_albedo, ids(self.polytopes), *b, ids(self.bounds))


def _object_id(i: int, j: int, index: int) -> int:
    # Stable across frames and culling: the cell and the object's index in it (< 2**7 per cell).
    assert 0 <= index < 2**7
    return 1 + ((((i + 2**20) & (2**21 - 1)) << 28) | (((j + 2**20) & (2**21 - 1)) << 7) | index)


def _add_object(builder: _Builder, rng: np.random.Generator, kind: str, x: float, z: float, ground: float,
                object_id: int, scale: float) -> None:
    """Append one object's primitives (shapes and colours drawn from `rng`) and its bounding sphere.

    Sizes below are for scale 1 (eye height 0.3); every length is multiplied by `scale`.
    """
    pick = lambda palette: palette[rng.integers(len(palette))]  # noqa: E731
    size = lambda lo, hi: scale * rng.uniform(lo, hi)  # noqa: E731
    if kind == "pine":
        trunk_h, trunk_r = size(0.12, 0.22), size(0.035, 0.05)
        crown_h, crown_r = size(0.7, 1.3), size(0.22, 0.36)
        base = ground - trunk_h
        builder.cylinders.append(((x, z), base - 0.02 * scale, ground, trunk_r, _BARK, object_id))
        builder.cones.append(((x, base - crown_h, z), crown_h, crown_r, _jitter(rng, pick(_PINE), 0.03), object_id))
        height, reach = trunk_h + crown_h, crown_r
    elif kind == "round_tree":
        trunk_h, trunk_r = size(0.25, 0.45), size(0.04, 0.06)
        crown = (size(0.25, 0.42), size(0.25, 0.4), size(0.25, 0.42))
        builder.cylinders.append(((x, z), ground - trunk_h - 0.1 * scale, ground, trunk_r, _BARK, object_id))
        centre_y = ground - trunk_h - 0.8 * crown[1]
        builder.ellipsoids.append(((x, centre_y, z), crown, _jitter(rng, pick(_FOLIAGE), 0.04), object_id))
        height, reach = ground - centre_y + crown[1], max(crown[0], crown[2])
    elif kind == "rock":
        radii = (size(0.12, 0.38), size(0.08, 0.25), size(0.12, 0.38))
        centre_y = ground - 0.4 * radii[1]  # partly buried
        builder.ellipsoids.append(((x, centre_y, z), radii, _jitter(rng, pick(_ROCK), 0.04), object_id))
        height, reach = 1.4 * radii[1], max(radii[0], radii[2])
    elif kind == "house":
        half_w, half_d = size(0.35, 0.7), size(0.35, 0.6)
        wall_h, roof_h = size(0.45, 0.75), size(0.25, 0.45)
        overhang = 0.07 * scale
        yaw = rng.uniform(0, math.pi)
        u = np.array([math.cos(yaw), 0.0, -math.sin(yaw)])  # local width axis
        v = np.array([math.sin(yaw), 0.0, math.cos(yaw)])  # local depth axis
        down = np.array([0.0, 1.0, 0.0])
        centre = np.array([x, 0.0, z])
        top = ground - wall_h

        def plane(normal: np.ndarray, point: np.ndarray) -> list[float]:
            normal = normal / np.linalg.norm(normal)
            return [*normal, float(normal @ point)]

        walls = [plane(u, centre + half_w * u), plane(-u, centre - half_w * u),
                 plane(v, centre + half_d * v), plane(-v, centre - half_d * v),
                 plane(down, np.array([0.0, ground, 0.0])), plane(-down, np.array([0.0, top, 0.0]))]
        eave = half_d + overhang
        ridge = np.array([x, top - roof_h, z])
        slope = roof_h / eave
        roof = [plane(u, centre + (half_w + overhang) * u), plane(-u, centre - (half_w + overhang) * u),
                plane(down, np.array([0.0, top, 0.0])),
                plane(-down + slope * v, ridge), plane(-down - slope * v, ridge),
                [0.0, 0.0, 0.0, 1.0]]  # padding: 0 <= 1 always holds
        wall_bound = (x, ground - wall_h / 2, z, math.sqrt(half_w**2 + half_d**2 + (wall_h / 2) ** 2))
        roof_bound = (x, top - roof_h / 2, z, math.sqrt((half_w + overhang) ** 2 + eave**2 + (roof_h / 2) ** 2))
        builder.polytopes.append((np.array(walls), wall_bound, _jitter(rng, pick(_WALLS), 0.04), object_id))
        builder.polytopes.append((np.array(roof), roof_bound, _jitter(rng, pick(_ROOFS), 0.04), object_id))
        height, reach = wall_h + roof_h, math.hypot(half_w + overhang, eave)
    elif kind == "pillar":
        radius, height = size(0.06, 0.12), size(0.9, 1.8)
        builder.cylinders.append(((x, z), ground - height, ground, radius, _jitter(rng, pick(_PILLARS), 0.03),
                                  object_id))
        # A wider cap makes the silhouette read as a pillar rather than a pole.
        cap = 0.06 * scale
        builder.cylinders.append(((x, z), ground - height - cap, ground - height + cap / 3, radius * 1.6,
                                  (0.85, 0.85, 0.80), object_id))
        height, reach = height + cap, radius * 1.6
    else:  # pragma: no cover - OBJECT_KINDS is closed
        raise ValueError(kind)
    half_h = height / 2
    builder.bounds.append(((x, ground - half_h, z), math.hypot(half_h, reach), height, object_id))


def _footprint(kind: str, scale: float) -> float:
    """A generous footprint radius per kind, for spacing and the clear spawn circle."""
    return scale * {"pine": 0.36, "round_tree": 0.42, "rock": 0.38, "house": 0.95, "pillar": 0.2}[kind]


def _start_objects(world: World) -> list[tuple[str, float, float, int]]:
    """(kind, x, z, index) of the objects placed ahead of the start pose (+z), from the seed alone."""
    cfg = world.config
    rng = np.random.default_rng([world.seed, _STREAM_START])
    placed: list[tuple[str, float, float, int]] = []
    for index in range(cfg.start_objects):
        kind = OBJECT_KINDS[rng.choice(len(OBJECT_KINDS), p=world.style.kind_weights)]
        distance = rng.uniform(*cfg.start_distance)
        angle = math.radians(rng.uniform(-cfg.start_half_angle_deg, cfg.start_half_angle_deg))
        x, z = distance * math.sin(angle), distance * math.cos(angle)
        radius = _footprint(kind, cfg.object_scale)
        if math.hypot(x, z) < cfg.spawn_clear_radius + radius:
            continue
        if any(math.hypot(x - px, z - pz) < cfg.min_spacing + radius + _footprint(pk, cfg.object_scale)
               for pk, px, pz, _ in placed):
            continue
        placed.append((kind, x, z, _START_INDEX + index))
    return placed


def _cell_objects(world: World, i: int, j: int,
                  start: list[tuple[str, float, float, int]]) -> list[tuple[str, float, float, int]]:
    """(kind, x, z, id) of the objects of cell (i, j), drawn from (seed, i, j) alone, plus the start
    objects that fall in it (cell objects that would overlap them are dropped)."""
    cfg = world.config
    size = cfg.cell_size
    placed = [(kind, x, z, _object_id(i, j, index)) for kind, x, z, index in start
              if math.floor(x / size) == i and math.floor(z / size) == j]
    rng = np.random.default_rng([world.seed, _STREAM_CELL, i + _CELL_OFFSET, j + _CELL_OFFSET])
    count = int(rng.poisson(cfg.objects_per_cell))
    for index in range(min(count, _START_INDEX)):
        kind = OBJECT_KINDS[rng.choice(len(OBJECT_KINDS), p=world.style.kind_weights)]
        x = (i + rng.random()) * size
        z = (j + rng.random()) * size
        radius = _footprint(kind, cfg.object_scale)
        if math.hypot(x, z) < cfg.spawn_clear_radius + radius:
            continue
        # Start objects may sit in a neighbouring cell: keep clear of all of them, not only this cell's.
        neighbours = placed + [(k, sx, sz, 0) for k, sx, sz, _ in start]
        if any(math.hypot(x - px, z - pz) < cfg.min_spacing + radius + _footprint(pk, cfg.object_scale)
               for pk, px, pz, _ in neighbours):
            continue
        placed.append((kind, x, z, _object_id(i, j, index)))
    return placed


def objects_near(world: World, points_xz: np.ndarray, radius: float) -> Primitives:
    """Primitives of every object in the cells within `radius` of any of the [N, 2] (x, z) points."""
    cfg = world.config
    points_xz = np.asarray(points_xz, dtype=np.float64).reshape(-1, 2)
    cells: set[tuple[int, int]] = set()
    span = int(math.ceil(radius / cfg.cell_size))
    for px, pz in points_xz:
        ci, cj = math.floor(px / cfg.cell_size), math.floor(pz / cfg.cell_size)
        for i in range(ci - span, ci + span + 1):
            for j in range(cj - span, cj + span + 1):
                # Distance from the point to the cell's square.
                dx = max(i * cfg.cell_size - px, 0.0, px - (i + 1) * cfg.cell_size)
                dz = max(j * cfg.cell_size - pz, 0.0, pz - (j + 1) * cfg.cell_size)
                if math.hypot(dx, dz) <= radius:
                    cells.add((i, j))
    builder = _Builder()
    start = _start_objects(world)
    for i, j in sorted(cells):  # sorted: the primitive order (and so tie-breaking) is deterministic
        rng = np.random.default_rng([world.seed, _STREAM_SHAPE, i + _CELL_OFFSET, j + _CELL_OFFSET])
        for kind, x, z, object_id in _cell_objects(world, i, j, start):
            _add_object(builder, rng, kind, x, z, cfg.eye_height, object_id, cfg.object_scale)
    return builder.finish()
