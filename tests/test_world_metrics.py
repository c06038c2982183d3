"""The evaluation's metrics (lingbot_core/world/metrics.py) on the renderer's own ground truth.

Each motion estimator must read the true camera motion off exact renders (sign and size) before it
can judge a model by it; these tests need no trained model. The last test rolls out the shipped
embedded model and runs only when the preset says its weights are trained.

Renders are small (96x160) on one thread, so the file runs in seconds.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lingbot_core.config import PRESETS
from lingbot_core.model import camera
from lingbot_core.world import HELD_OUT_SEEDS, held_keys, key_path, make_world, render, to_uint8
from lingbot_core.world.metrics import (KEY_MOTION, frame_motion, frame_statistics, motion_for_key, phase_shift,
                                        psnr, ssim, translation, video_motion, yaw_shift_px)

EMBEDDED = PRESETS["embedded"]
FPB = EMBEDDED.transformer.num_frames_per_block
SEED = HELD_OUT_SEEDS.start
W, H = EMBEDDED.width, EMBEDDED.height


pytestmark = pytest.mark.usefixtures("single_thread")  # conftest.py: one intra-op thread for the module


@pytest.fixture(scope="module")
def world():
    return make_world(SEED)


def frames_for(world, poses: np.ndarray) -> torch.Tensor:
    k = np.array(camera.intrinsics_for(EMBEDDED.camera, W, H))
    return render(world, poses, k, W, H, 1)


def held(key: str, latent_frames: int) -> np.ndarray:
    """Latent poses [1 + n, 4, 4]: the start pose, then `key` held for n latent frames."""
    poses, _ = camera.integrate_actions(camera.CameraState.initial(), [[]] + [[key]] * latent_frames,
                                        EMBEDDED.camera)
    return poses


# ---------------------------------------------------------------------------------------------
# Fidelity


def test_psnr_of_a_known_error():
    a = torch.zeros(2, 3, 16, 16, dtype=torch.float64)
    b = torch.full((2, 3, 16, 16), 0.1, dtype=torch.float64)  # MSE 0.01 -> 20 dB
    assert psnr(a, b).tolist() == pytest.approx([20.0, 20.0], abs=1e-9)
    b[1, :, :8] = 0.0  # half the pixels right: MSE 0.005 -> 23.01 dB
    assert float(psnr(a, b)[1]) == pytest.approx(10 * math.log10(200), abs=1e-9)
    assert float(psnr(a, a)[0]) == pytest.approx(100.0)  # identical frames: the floored MSE, finite


def test_ssim_of_identical_frames_is_one_and_falls_with_noise(world):
    frame = frames_for(world, np.eye(4)[None])
    assert float(ssim(frame, frame)[0]) == pytest.approx(1.0, abs=1e-12)
    generator = torch.Generator().manual_seed(0)
    noisy = (frame + 0.1 * torch.randn(frame.shape, generator=generator)).clamp(0, 1)
    noisier = (frame + 0.3 * torch.randn(frame.shape, generator=generator)).clamp(0, 1)
    s1, s2 = float(ssim(frame, noisy)[0]), float(ssim(frame, noisier)[0])
    assert 0.0 < s2 < s1 < 1.0
    assert float(ssim(noisy, frame)[0]) == pytest.approx(s1, abs=1e-12)


def test_ssim_matches_the_closed_form_on_constant_frames():
    # Flat frames: variances and covariance are 0, so SSIM = (2 mx my + C1) / (mx^2 + my^2 + C1).
    a = torch.full((1, 3, 20, 20), 0.2, dtype=torch.float64)
    b = torch.full((1, 3, 20, 20), 0.6, dtype=torch.float64)
    c1 = 0.01 ** 2
    assert float(ssim(a, b)[0]) == pytest.approx((2 * 0.2 * 0.6 + c1) / (0.2 ** 2 + 0.6 ** 2 + c1), abs=1e-9)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="same shape"):
        psnr(torch.zeros(1, 3, 16, 16), torch.zeros(1, 3, 16, 15))
    with pytest.raises(ValueError, match=r"\[\.\.\., 3, H, W\]"):
        ssim(torch.zeros(1, 4, 16, 16), torch.zeros(1, 4, 16, 16))
    with pytest.raises(ValueError, match="at least 11"):
        ssim(torch.zeros(1, 3, 8, 8), torch.zeros(1, 3, 8, 8))
    with pytest.raises(ValueError, match="unknown key"):
        motion_for_key(frame_motion(torch.zeros(3, 16, 16), torch.zeros(3, 16, 16)), "x")
    with pytest.raises(ValueError, match="T > stride"):
        video_motion(torch.zeros(1, 3, 16, 16))


# ---------------------------------------------------------------------------------------------
# Motion on exact renders


def test_phase_correlation_recovers_a_circular_shift_exactly():
    generator = torch.Generator().manual_seed(1)
    image = torch.rand(H, W, generator=generator, dtype=torch.float64)
    for dx, dy in ((5, 0), (-7, 3), (0, -4)):
        moved = torch.roll(image, shifts=(dy, dx), dims=(0, 1))  # moved(p) = image(p - d)
        assert phase_shift(image, moved).tolist() == pytest.approx([dx, dy], abs=0.05)


@pytest.mark.parametrize("key, latent_frames", [("l", 1), ("j", 1), ("l", 2), ("j", 3)])
def test_a_yaw_of_theta_moves_the_picture_by_f_tan_theta(world, key, latent_frames):
    poses = held(key, latent_frames)
    frames = frames_for(world, poses[[0, -1]])
    motion = frame_motion(frames[0], frames[1])
    theta = EMBEDDED.camera.yaw_step_deg * latent_frames
    expected = yaw_shift_px(camera.intrinsics_for(EMBEDDED.camera, W, H)[0], theta)
    sign = KEY_MOTION[key][1]  # turning right (l) moves the picture left
    assert float(motion.shift_x) == pytest.approx(sign * expected, rel=0.1)
    assert abs(float(motion.shift_y)) < 0.5
    # The same figure summed over consecutive pixel frames of a rendered key path.
    path = key_path(held_keys(["", key], FPB), EMBEDDED)
    video = frames_for(world, path.pixel_poses)
    summed = float(video_motion(video).shift_x.sum())
    assert summed == pytest.approx(sign * FPB * yaw_shift_px(path.intrinsics[0], EMBEDDED.camera.yaw_step_deg),
                                   rel=0.1)


def test_a_pitch_moves_the_picture_vertically(world):
    fy = camera.intrinsics_for(EMBEDDED.camera, W, H)[1]
    for key in "ik":
        poses = held(key, 1)
        frames = frames_for(world, poses[[0, -1]])
        motion = frame_motion(frames[0], frames[1])
        expected = KEY_MOTION[key][1] * fy * math.tan(math.radians(EMBEDDED.camera.pitch_step_deg))
        assert float(motion.shift_y) == pytest.approx(expected, rel=0.15)
        assert abs(float(motion.shift_x)) < 0.5


@pytest.mark.parametrize("key", ["w", "s", "a", "d"])
def test_walking_and_stepping_have_the_keys_sign(world, key):
    path = key_path(held_keys(["", key], FPB), EMBEDDED)
    video = frames_for(world, path.pixel_poses)
    block = float(motion_for_key(video_motion(video), key).sum())
    # W expands (> 0), S contracts (< 0); A moves the ground right (> 0), D left (< 0); by at least a pixel.
    assert block * KEY_MOTION[key][1] > 1.0


def test_a_repeated_frame_has_no_motion(world):
    frame = frames_for(world, np.eye(4)[None])
    motion = video_motion(frame.expand(4, -1, -1, -1))
    for field in motion:
        assert torch.equal(field, torch.zeros(3, dtype=torch.float64))
    flat = torch.full((2, 3, H, W), 0.5)
    assert all(float(v[0]) == 0.0 for v in video_motion(flat))


def test_translation_recovers_sub_pixel_shifts_exactly():
    """Consecutive frames move by a pixel or two: the refined estimate must be sub-pixel exact (phase
    correlation's parabola alone is off by up to 0.05 px here)."""
    generator = torch.Generator().manual_seed(2)
    image = torch.nn.functional.avg_pool2d(torch.rand(1, H, W, generator=generator, dtype=torch.float64), 5,
                                           stride=1, padding=2)[0]
    fy = torch.fft.fftfreq(H, dtype=torch.float64)[:, None]
    fx = torch.fft.fftfreq(W, dtype=torch.float64)[None, :]
    for dx, dy in ((1.3, 0.0), (0.4, -0.7), (-2.6, 1.1)):
        moved = torch.fft.ifft2(torch.fft.fft2(image) * torch.exp(-2j * math.pi * (fx * dx + fy * dy))).real
        assert translation(image, moved).tolist() == pytest.approx([dx, dy], abs=0.01)


@pytest.mark.slow  # a minute or more on 2 cores: .ci/run runs it, the fast suite does not
def test_the_estimators_read_the_vaes_round_trip_of_a_true_clip_as_moving_with_the_truth(world):
    """The oracle: a perfect world model's output is the VAE's streamed round trip of the true clip, so each
    key's motion, summed over a block's consecutive frame pairs as the evaluation sums it, must read close
    to the truth's on it. Regression: whitened phase correlation alone read 0.05 of a sideways step's
    motion on these frames (faint static patterns of the decoder outvote a one-pixel shift), 0.25 of a
    pitch's and 0.76 of a turn's, though the picture moves with the truth from one block's end to the next."""
    from lingbot_core.blocks import loading
    from training.vae import stream_reconstruct

    parts = loading.load_pipeline_parts("embedded", dtype=torch.float32)
    config, vae = parts.config, parts.vae.eval()
    fpb = config.transformer.num_frames_per_block
    for key in "aijw":
        path = key_path(held_keys(["", key, key], fpb), config)
        truth = render(world, path.pixel_poses, path.intrinsics, config.width, config.height, 2)
        truth = torch.from_numpy(to_uint8(truth)).permute(0, 3, 1, 2).float() / 255.0  # as clips are stored
        with torch.inference_mode():
            clip, _ = stream_reconstruct(vae, config, truth.permute(1, 0, 2, 3) * 2.0 - 1.0)
        decoded = ((clip.permute(1, 0, 2, 3) + 1.0) / 2.0).clamp(0, 1)
        true_motion = motion_for_key(video_motion(truth), key)
        decoded_motion = motion_for_key(video_motion(decoded), key)
        for block in (1, 2):
            pairs = slice(config.pixel_frames_for_blocks(block) - 1, config.pixel_frames_for_blocks(block + 1) - 1)
            t, g = float(true_motion[pairs].sum()), float(decoded_motion[pairs].sum())
            assert t * KEY_MOTION[key][1] > 3.0  # the truth moves the key's way
            assert 0.7 <= g / t <= 1.3, f"holding {key}, block {block}: decoded {g:.2f} px, true {t:.2f} px"


def test_frame_statistics_see_a_washed_out_picture(world):
    frame = frames_for(world, np.eye(4)[None])
    sharp = frame_statistics(frame)
    blurred = frame_statistics(torch.nn.functional.avg_pool2d(frame, 5, stride=1, padding=2))
    assert blurred.mean == pytest.approx(sharp.mean, rel=0.05)
    assert blurred.high_frequency < 0.5 * sharp.high_frequency
    grey = frame_statistics(torch.full_like(frame, sharp.mean))
    assert grey.contrast == pytest.approx(0.0, abs=1e-12) and grey.high_frequency == pytest.approx(0.0, abs=1e-12)


# ---------------------------------------------------------------------------------------------
# The shipped model follows the keys


@pytest.mark.skipif(not EMBEDDED.trained, reason="the embedded preset's weights are not trained yet")
@pytest.mark.slow  # a minute or more on 2 cores: .ci/run runs it, the fast suite does not
def test_the_shipped_model_turns_with_the_keys():
    from lingbot_core.blocks.pipeline import load_pipeline
    from lingbot_core.boundary.requests import BlockControl

    pipe = load_pipeline("embedded", dtype="fp32", compile=False)
    config = pipe.config
    world = make_world(HELD_OUT_SEEDS.start + 1)
    blocks = 4
    for key in "jl":
        path = key_path(held_keys([""] + [key] * blocks, config.transformer.num_frames_per_block), config)
        truth = render(world, path.pixel_poses, path.intrinsics, config.width, config.height, 2)
        start = to_uint8(truth[:1])[0]
        actions = path.frame_actions
        fpb = config.transformer.num_frames_per_block
        controls = [BlockControl(actions=actions[b * fpb:(b + 1) * fpb]) for b in range(blocks + 1)]
        with torch.inference_mode():
            generated = torch.cat([((out.frames[0].float().permute(1, 0, 2, 3) + 1) / 2).clamp(0, 1)
                                   for out in pipe.rollout(start, "A walk through a quiet countryside.", 0, controls)])
        assert generated.shape == truth.shape
        g, t = video_motion(generated).shift_x, video_motion(truth).shift_x
        agree = 0
        for block in range(1, blocks + 1):
            pairs = slice(config.pixel_frames_for_blocks(block) - 1, config.pixel_frames_for_blocks(block + 1) - 1)
            true_motion = float(t[pairs].sum())
            assert true_motion * KEY_MOTION[key][1] > 10.0  # the truth turns (about 30 px a block)
            agree += int(math.copysign(1, float(g[pairs].sum())) == math.copysign(1, true_motion))
        assert agree >= blocks - 1, f"holding {key}: generated motion has the true sign in {agree} of {blocks} blocks"
