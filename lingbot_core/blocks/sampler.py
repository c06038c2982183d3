"""Few-step DMD flow matching for one block, then the t=0 commit forward that writes its K/V.

The loop reads like the algorithm: draw noise, denoise four times (reading the cache, never writing
it; optionally guiding the first steps away from a still camera), then rerun the clean latents at t=0
so the cache holds clean context. All noise comes from one
generator whose state the caller owns and carries from block to block.
"""

from __future__ import annotations

from typing import Callable

import torch

from lingbot_core.config import SamplerConfig

# velocity(x_t, model_timestep) -> predicted flow v; the caller binds condition, text, camera and cache.
VelocityFn = Callable[[torch.Tensor, float], torch.Tensor]


def sample_block(velocity: VelocityFn, shape: tuple[int, ...], config: SamplerConfig,
                 generator: torch.Generator, device: torch.device | str,
                 still_velocity: VelocityFn | None = None) -> torch.Tensor:
    """Clean latents x0 for one block. Noise is drawn on the CPU so every device sees the same draws.

    still_velocity: the same model with the camera held still, for the config's action guidance (its
    first `guided_steps` steps use v_still + scale * (v - v_still)); needed only when guidance is on."""
    guided = config.guided_steps
    if guided and still_velocity is None:
        raise ValueError("the sampler's action guidance needs the still-camera velocity")
    sigmas = config.sigmas()
    x = torch.randn(shape, generator=generator, dtype=torch.float32).to(device)
    for step, sigma in enumerate(sigmas):
        timestep = config.num_train_timesteps * sigma
        v = velocity(x, timestep)
        if step < guided:
            still = still_velocity(x, timestep)
            v = still + config.action_guidance * (v - still)
        x0 = x - sigma * v
        if step + 1 == len(sigmas):
            return x0
        sigma_next = sigmas[step + 1]
        noise = torch.randn(shape, generator=generator, dtype=torch.float32).to(device)
        x = (1.0 - sigma_next) * x0 + sigma_next * noise
    raise ValueError("the sampler needs at least one timestep")
