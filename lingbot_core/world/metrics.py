"""Image metrics for judging generated frames against the renderer's ground truth.

    psnr, ssim                fidelity of a frame to its ground truth (per frame)
    phase_shift               global translation between two frames (phase correlation)
    translation               the same, refined by least squares (what the motion estimators use)
    frame_motion / Motion     the image motion a key causes, one estimator per kind of key
    motion_for_key            which estimator and sign convention a key is judged by
    frame_statistics          mean, contrast and high-frequency energy (collapse check)

Frames are float tensors [..., 3, H, W] in [0, 1]. Every function is pure and deterministic, so the
same estimator measures generated frames and ground truth alike: action following is judged by
comparing the two measurements, never against an idealised camera model.

Motion estimators (all in pixels of the frame, measured from frame a to frame b; +x right, +y down,
as the camera module's image axes). Each region's translation is found in two steps (`translation`):
phase correlation (luma, Hann-windowed, the normalised cross power spectrum weighted by a Gaussian
low-pass, the peak refined by a parabola) gives the start, robust to shifts of many pixels, and a
least-squares fit of one translation (Lucas-Kanade, iterated on lightly blurred luma) gives the
figure. Phase correlation alone is not enough for decoded video: whitening the spectrum gives every
frequency the same vote, and above about 0.1 cycles a pixel a decoder's frames carry faint patterns
that stay put while the picture moves, so between consecutive frames (a pixel or two apart) the peak
sits near zero. On the shipped VAE's reconstructions of true clips (which move as the truth over a
block, end to end), phase correlation read 0.05 of the truth's lateral motion summed over a block's
frame pairs, 0.25 of its pitch and 0.76 of its turn; the least-squares fit reads 0.81-0.92 of each.
The fit weighs each pixel by its gradient, where the moving picture's structure is.
- shift_x / shift_y: the translation of the whole frame. A turn (J/L) or a pitch (I/K) moves every
  distant point by about f*tan(angle), so that is the shift.
- expansion: shift_x of the right half minus shift_x of the left half, each the translation of that
  half alone. Walking forward (W) pushes content outwards from the centre (left half
  left, right half right), so it is positive; S makes it negative; a turn moves both halves alike and
  cancels. Pixels, not a scale: for a fixed frame size it is proportional to the scale change.
- lateral: shift_x of the lower half. A sideways step (A/D) moves near content (the ground below the
  horizon) against the step while the sky stays put, so the lower half carries the signal.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

# SSIM as Wang et al. 2004 define it: 11x11 Gaussian window, sigma 1.5, K1 = 0.01, K2 = 0.03, data
# range 1, statistics over the valid region (no padding), each colour channel alone, then averaged.
SSIM_WINDOW, SSIM_SIGMA, SSIM_K1, SSIM_K2 = 11, 1.5, 0.01, 0.03
# PSNR of identical frames would be infinite; the MSE is floored so averages stay finite (100 dB).
_MIN_MSE = 1e-10
# Phase correlation: Gaussian weight exp(-(f / sigma)^2 / 2) on the cross power spectrum, f in cycles
# per pixel; 0.15 keeps the frequencies a 96x160 frame carries reliably (textures are faded out
# below two pixels by the renderer) and smooths the correlation peak to a few pixels wide.
_PHASE_SIGMA = 0.15
# Least-squares refinement: luma blurred by a Gaussian of this sigma (pixels), so that the first-order
# fit holds over a few pixels of error in the start; this many Gauss-Newton steps, each at most this
# many pixels per axis (a step on a nearly flat frame cannot throw the estimate across the frame).
_REFINE_BLUR_PX = 1.5
_REFINE_STEPS = 8
_REFINE_MAX_STEP_PX = 2.0
# Added to both diagonal terms of the fit, as a share of their sum: damps a direction the picture has no
# structure along (a frame of sky and horizon says nothing about a sideways shift).
_REFINE_RIDGE = 1e-3
_EPS = 1e-12
# BT.601 luma weights: motion is measured on brightness, as a viewer sees it.
_LUMA = (0.299, 0.587, 0.114)


# ---------------------------------------------------------------------------------------------
# Fidelity


def _check_pair(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.shape != b.shape:
        raise ValueError(f"frames must have the same shape; got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.ndim < 3 or a.shape[-3] != 3:
        raise ValueError(f"frames must be [..., 3, H, W]; got {tuple(a.shape)}")


def psnr(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Peak signal-to-noise ratio in dB per frame, data range 1: [..., 3, H, W] x2 -> [...]."""
    _check_pair(a, b)
    mse = (a.double() - b.double()).pow(2).mean(dim=(-3, -2, -1))
    return -10.0 * torch.log10(mse.clamp(min=_MIN_MSE))


def _gaussian_window(size: int, sigma: float) -> torch.Tensor:
    x = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    g = torch.exp(-x * x / (2 * sigma * sigma))
    return g / g.sum()


def ssim(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Structural similarity per frame (mean over channels and the valid region): [..., 3, H, W] x2 -> [...]."""
    _check_pair(a, b)
    height, width = a.shape[-2:]
    if min(height, width) < SSIM_WINDOW:
        raise ValueError(f"frames must be at least {SSIM_WINDOW} pixels a side for SSIM; got {height}x{width}")
    lead = a.shape[:-3]
    x = a.double().reshape(-1, 1, height, width)  # every channel of every frame alone
    y = b.double().reshape(-1, 1, height, width)
    g = _gaussian_window(SSIM_WINDOW, SSIM_SIGMA)

    def blur(v: torch.Tensor) -> torch.Tensor:  # separable Gaussian, valid region
        v = F.conv2d(v, g.view(1, 1, 1, -1))
        return F.conv2d(v, g.view(1, 1, -1, 1))

    c1, c2 = SSIM_K1 ** 2, SSIM_K2 ** 2
    mx, my = blur(x), blur(y)
    vx = blur(x * x) - mx * mx
    vy = blur(y * y) - my * my
    cov = blur(x * y) - mx * my
    s = ((2 * mx * my + c1) * (2 * cov + c2)) / ((mx * mx + my * my + c1) * (vx + vy + c2))
    return s.mean(dim=(-2, -1)).reshape(*lead, 3).mean(-1)


# ---------------------------------------------------------------------------------------------
# Motion


def luma(frames: torch.Tensor) -> torch.Tensor:
    """[..., 3, H, W] -> [..., H, W] float64 brightness."""
    if frames.ndim < 3 or frames.shape[-3] != 3:
        raise ValueError(f"frames must be [..., 3, H, W]; got {tuple(frames.shape)}")
    w = torch.tensor(_LUMA, dtype=torch.float64)
    return (frames.double() * w.view(3, 1, 1)).sum(-3)


def _parabolic(left: torch.Tensor, centre: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """Offset in (-0.5, 0.5) of the vertex of the parabola through three samples around a maximum."""
    denom = left - 2 * centre + right
    offset = torch.where(denom.abs() > _EPS, 0.5 * (left - right) / torch.where(denom.abs() > _EPS, denom, 1.0),
                         torch.zeros_like(denom))
    return offset.clamp(-0.5, 0.5)


def phase_shift(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Translation (dx, dy) in pixels that best maps a onto b (b(p) ~ a(p - d)): [..., H, W] x2 -> [..., 2].

    Phase correlation with a Hann window and a Gaussian-weighted spectrum (module docstring); the
    integer peak is refined by a parabola through its neighbours along each axis. Identical frames
    give exactly (0, 0); frames with no structure (constant) give (0, 0) too.
    """
    if a.shape != b.shape or a.ndim < 2:
        raise ValueError(f"phase_shift needs two [..., H, W] arrays of one shape; got {tuple(a.shape)}, "
                         f"{tuple(b.shape)}")
    height, width = a.shape[-2:]
    # Identical frames: no motion, exactly (the parabolic fit of a symmetric peak rounds to ~1e-17).
    same = (a == b).flatten(-2).all(-1)
    window = (torch.hann_window(height, periodic=False, dtype=torch.float64)[:, None]
              * torch.hann_window(width, periodic=False, dtype=torch.float64)[None, :])
    a = (a.double() - a.double().mean(dim=(-2, -1), keepdim=True)) * window
    b = (b.double() - b.double().mean(dim=(-2, -1), keepdim=True)) * window
    cross = torch.fft.fft2(b) * torch.fft.fft2(a).conj()
    fy = torch.fft.fftfreq(height, dtype=torch.float64)[:, None]
    fx = torch.fft.fftfreq(width, dtype=torch.float64)[None, :]
    weight = torch.exp(-(fx * fx + fy * fy) / (2 * _PHASE_SIGMA ** 2))
    surface = torch.fft.ifft2(cross / (cross.abs() + _EPS) * weight).real  # [..., H, W]
    # Where both frames are flat the spectrum is zero: no evidence of motion.
    flat = cross.abs().amax(dim=(-2, -1)) <= _EPS

    lead = surface.shape[:-2]
    flat_surface = surface.reshape(-1, height, width)
    peak = flat_surface.reshape(len(flat_surface), -1).argmax(-1)
    py, px = peak // width, peak % width
    rows = torch.arange(len(flat_surface))
    at = lambda y, x: flat_surface[rows, y % height, x % width]  # noqa: E731 (wrap: the correlation is circular)
    dx = px.double() + _parabolic(at(py, px - 1), at(py, px), at(py, px + 1))
    dy = py.double() + _parabolic(at(py - 1, px), at(py, px), at(py + 1, px))
    dx = torch.where(dx > width / 2, dx - width, dx)  # circular index -> signed shift
    dy = torch.where(dy > height / 2, dy - height, dy)
    shift = torch.stack([dx, dy], -1).reshape(*lead, 2)
    return torch.where((flat | same)[..., None], torch.zeros_like(shift), shift)


def _gaussian_blur(images: torch.Tensor, sigma: float) -> torch.Tensor:
    """[N, H, W] -> [N, H, W], separable, edges extended (no dark border for the fit to lock onto)."""
    radius = max(1, int(3 * sigma + 0.5))
    g = _gaussian_window(2 * radius + 1, sigma)
    x = images[:, None]
    x = F.conv2d(F.pad(x, (radius, radius, 0, 0), mode="replicate"), g.view(1, 1, 1, -1))
    x = F.conv2d(F.pad(x, (0, 0, radius, radius), mode="replicate"), g.view(1, 1, -1, 1))
    return x[:, 0]


def translation(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Translation (dx, dy) in pixels that best maps a onto b (b(p) ~ a(p - d)): [..., H, W] x2 -> [..., 2].

    `phase_shift` gives the start; Gauss-Newton steps then minimise the Hann-weighted squared
    difference between b and a moved by d (bilinear), on luma blurred by _REFINE_BLUR_PX (module
    docstring: why phase correlation alone under-reads decoded video). Identical frames give exactly
    (0, 0); frames with no structure give (0, 0) too.
    """
    start = phase_shift(a, b)  # checks the shapes
    height, width = a.shape[-2:]
    lead = a.shape[:-2]
    same = (a == b).flatten(-2).all(-1).reshape(-1)
    a = _gaussian_blur(a.double().reshape(-1, height, width), _REFINE_BLUR_PX)
    b = _gaussian_blur(b.double().reshape(-1, height, width), _REFINE_BLUR_PX)
    window = (torch.hann_window(height, periodic=False, dtype=torch.float64)[:, None]
              * torch.hann_window(width, periodic=False, dtype=torch.float64)[None, :])
    ys, xs = torch.meshgrid(torch.arange(height, dtype=torch.float64), torch.arange(width, dtype=torch.float64),
                            indexing="ij")
    d = start.reshape(-1, 2).clone()
    for _ in range(_REFINE_STEPS):
        # a(p - d) at every pixel, as grid_sample's normalised coordinates (corners at -1 and 1).
        gx = (xs - d[:, 0, None, None]) / max(width - 1, 1) * 2 - 1
        gy = (ys - d[:, 1, None, None]) / max(height - 1, 1) * 2 - 1
        moved = F.grid_sample(a[:, None], torch.stack([gx, gy], -1), mode="bilinear", padding_mode="border",
                              align_corners=True)[:, 0]
        dmx, dmy = torch.zeros_like(moved), torch.zeros_like(moved)
        dmx[:, :, 1:-1] = (moved[:, :, 2:] - moved[:, :, :-2]) / 2
        dmy[:, 1:-1] = (moved[:, 2:] - moved[:, :-2]) / 2
        residual = b - moved  # ~ -(gradient . step): moving a further by `step` changes it by -grad.step
        sxx, sxy, syy = ((window * u * v).sum((-2, -1)) for u, v in ((dmx, dmx), (dmx, dmy), (dmy, dmy)))
        rx, ry = (window * dmx * residual).sum((-2, -1)), (window * dmy * residual).sum((-2, -1))
        ridge = _REFINE_RIDGE * (sxx + syy)  # an axis with no structure along it (sky only) does not move
        sxx, syy = sxx + ridge, syy + ridge
        det = sxx * syy - sxy * sxy
        solvable = det > _EPS
        safe = torch.where(solvable, det, torch.ones_like(det))
        step = -torch.stack([(syy * rx - sxy * ry) / safe, (sxx * ry - sxy * rx) / safe], -1)
        step = torch.where(solvable[:, None], step, torch.zeros_like(step))
        d = d + step.clamp(-_REFINE_MAX_STEP_PX, _REFINE_MAX_STEP_PX)
    d = torch.where(same[:, None], torch.zeros_like(d), d)
    return d.reshape(*lead, 2)


class Motion(NamedTuple):
    """Image motion from one frame to the next, in pixels (see the module docstring)."""

    shift_x: torch.Tensor  # whole frame, + right: J turns left, so the picture moves right
    shift_y: torch.Tensor  # whole frame, + down: I looks up, so the picture moves down
    expansion: torch.Tensor  # right half's shift_x minus the left half's: + for W (walk forward)
    lateral: torch.Tensor  # lower half's shift_x: + for A (step left)


def frame_motion(a: torch.Tensor, b: torch.Tensor) -> Motion:
    """Motion from frames a to b, [..., 3, H, W] each -> Motion of [...] tensors."""
    _check_pair(a, b)
    la, lb = luma(a), luma(b)
    height, width = la.shape[-2:]
    whole = translation(la, lb)
    half_w, half_h = width // 2, height // 2
    left = translation(la[..., :, :half_w], lb[..., :, :half_w])[..., 0]
    right = translation(la[..., :, width - half_w:], lb[..., :, width - half_w:])[..., 0]
    lower = translation(la[..., height - half_h:, :], lb[..., height - half_h:, :])[..., 0]
    return Motion(whole[..., 0], whole[..., 1], right - left, lower)


def video_motion(frames: torch.Tensor, stride: int = 1) -> Motion:
    """Motion between frames t - stride and t for every t >= stride: [T, 3, H, W] -> Motion of [T - stride]."""
    if stride < 1 or frames.ndim != 4 or len(frames) <= stride:
        raise ValueError(f"video_motion needs [T, 3, H, W] with T > stride >= 1; got {tuple(frames.shape)}, "
                         f"stride {stride}")
    return frame_motion(frames[:-stride], frames[stride:])


# Key -> (Motion field that measures it, the sign its motion has on the ground truth).
KEY_MOTION: dict[str, tuple[str, int]] = {
    "j": ("shift_x", +1), "l": ("shift_x", -1),
    "i": ("shift_y", +1), "k": ("shift_y", -1),
    "w": ("expansion", +1), "s": ("expansion", -1),
    "a": ("lateral", +1), "d": ("lateral", -1),
}


def motion_for_key(motion: Motion, key: str) -> torch.Tensor:
    """The component of `motion` by which a key is judged."""
    if key not in KEY_MOTION:
        raise ValueError(f"unknown key {key!r}; keys are {''.join(KEY_MOTION)}")
    return getattr(motion, KEY_MOTION[key][0])


# ---------------------------------------------------------------------------------------------
# Collapse


class FrameStatistics(NamedTuple):
    mean: float  # mean pixel value
    contrast: float  # standard deviation of the pixels
    high_frequency: float  # mean |Laplacian| of the luma (4-neighbour kernel)


def frame_statistics(frames: torch.Tensor) -> FrameStatistics:
    """Averages over frames [..., 3, H, W] in [0, 1]: what washes out when a rollout collapses to mush."""
    if frames.ndim < 3 or frames.shape[-3] != 3:
        raise ValueError(f"frames must be [..., 3, H, W]; got {tuple(frames.shape)}")
    x = frames.double()
    y = luma(x).reshape(-1, 1, *x.shape[-2:])
    kernel = torch.tensor([[0.0, 1.0, 0.0], [1.0, -4.0, 1.0], [0.0, 1.0, 0.0]], dtype=torch.float64)
    laplacian = F.conv2d(y, kernel.view(1, 1, 3, 3))
    contrast = x.reshape(-1, 3 * x.shape[-2] * x.shape[-1]).std(-1).mean()
    return FrameStatistics(float(x.mean()), float(contrast), float(laplacian.abs().mean()))


def yaw_shift_px(focal_px: float, degrees: float) -> float:
    """How far a distant point at the image centre moves when the camera yaws by `degrees`: f*tan(theta)."""
    return focal_px * math.tan(math.radians(degrees))
