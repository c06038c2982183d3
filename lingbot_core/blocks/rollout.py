"""One world's state between blocks, and the transactional block step.

`step_block` computes a whole block from a `RolloutState` without touching it: the condition encoder
history, the decoder state, the RNG, the camera tail and the new KV pages are all *pending* until the
block has finished every stage. Only then is a new state returned (and the pages that left the window
freed). Any exception before that frees the block's reserved pages and leaves the old state exactly
as it was, so the caller can retry or carry on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Callable

import numpy as np
import torch

from lingbot_core.boundary.requests import BlockControl
from lingbot_core.config import ModelConfig
from lingbot_core.blocks.kv_cache import KVPagePool, SessionKV
from lingbot_core.model import camera, vae_stream
from lingbot_core.blocks.pages import PageAllocator
from lingbot_core.blocks.sampler import sample_block


class PoolExhausted(RuntimeError):
    """The shared KV pool has no pages for this block; admission should have prevented it."""


@dataclass
class RolloutState:
    """Everything a world carries from one block to the next. Replaced whole by each committed block."""

    block_index: int
    condition: vae_stream.ConditionStream
    decoder: vae_stream.DecoderStream
    kv: SessionKV
    rng_state: torch.Tensor  # CPU generator state; one stream of noise for the whole rollout
    camera: camera.CameraState
    text_kv: Any
    prompt: str


@dataclass
class BlockOutput:
    block_index: int
    latents: torch.Tensor  # [1, z, F, h, w] clean, normalised
    frames: torch.Tensor  # [1, 3, T, H, W] in [-1, 1]
    poses: np.ndarray  # [F, 4, 4] the camera of each latent frame
    stage_ms: dict[str, float]


# on_stage(name) is called before each stage: "condition", "denoise", "decode", "commit".
# The engine uses it for timings; tests use it to inject failures.
StageHook = Callable[[str], None]


def new_rollout(config: ModelConfig, vae, image: torch.Tensor, text_kv: Any, prompt: str, seed: int,
                start_camera: camera.CameraState | None = None,
                condition: vae_stream.ConditionStream | None = None) -> RolloutState:
    """condition: the stream to read the condition blocks from (a shared one); default a private stream."""
    generator = torch.Generator(device="cpu").manual_seed(int(seed))
    if condition is None:
        condition = vae_stream.ConditionStream.start(condition_pixels(vae, image))
    return RolloutState(
        block_index=0,
        condition=condition,
        decoder=vae_stream.DecoderStream(),
        kv=SessionKV.empty(),
        rng_state=generator.get_state(),
        camera=start_camera or camera.CameraState.initial(),
        text_kv=text_kv,
        prompt=prompt,
    )


def condition_pixels(vae, image: torch.Tensor) -> torch.Tensor:
    """The start image [1, 3, H, W] as the condition encoder reads it: on the VAE's device, in its dtype."""
    return image.to(device=_device_of(vae), dtype=_dtype_of(vae))


def release(pages: PageAllocator, state: RolloutState) -> None:
    """Return every page the rollout holds to the pool's bookkeeping."""
    pages.free(state.kv.pages())
    state.kv = SessionKV.empty()


def step_block(config: ModelConfig, transformer, vae, pool: KVPagePool, pages: PageAllocator, state: RolloutState,
               control: BlockControl, on_stage: StageHook | None = None,
               decode_frame: vae_stream.FrameDecoder = vae_stream.decode_latent_frame,
               on_frames: Callable[[torch.Tensor], None] | None = None) -> tuple[BlockOutput, RolloutState]:
    """Generate one block; returns its output and the committed state. `state` itself is never modified.

    pool holds the K/V tensors, pages their bookkeeping: the block takes its pages from `pages` and, once it
    commits, gives back the ones that left the window; a failure gives back what it took."""
    frames_per_block = config.transformer.num_frames_per_block
    start_frame = state.block_index * frames_per_block
    device, dtype = _device_of(transformer), _dtype_of(transformer)
    clock = StageClock(device)

    def enter(stage: str) -> None:
        clock.enter(stage)
        if on_stage is not None:
            on_stage(stage)

    new_pages = pages.allocate(frames_per_block)
    if new_pages is None:
        raise PoolExhausted(f"the KV pool has {pages.num_free} free pages; a block needs {frames_per_block}")
    try:
        # 1. Camera: poses for this block's latent frames, then the Plücker map anchored on the previous tail.
        poses, intrinsics, next_camera = _block_camera(config, state.camera, control)
        plucker = camera.plucker_block(state.camera.pose, poses, intrinsics, config.width, config.height,
                                       config.camera, control.translation_scale,
                                       ).unsqueeze(0).to(device=device, dtype=dtype)

        # 2. Condition block from the session's causal encoder history (pending until commit).
        enter("condition")
        condition, next_condition = vae_stream.encode_condition_block(vae, state.condition, state.block_index, config)
        mask = vae_stream.condition_mask(config, state.block_index, condition.device, condition.dtype)
        extra = torch.cat([mask, condition], dim=1).to(device=device, dtype=torch.float32)  # [1, mask + z, F, h, w]

        # 3. Denoise: four forwards that read the block's context and never write it. The context is
        #    gathered once here, into a fixed-size window, for these forwards and the commit.
        enter("denoise")
        block_kv = state.kv.view(pool, config, start_frame)

        def velocity_with(camera_map: torch.Tensor):
            def velocity(x_t: torch.Tensor, timestep: float) -> torch.Tensor:
                return transformer(torch.cat([x_t, extra], dim=1), _timestep(timestep, device), state.text_kv,
                                   camera_map, start_frame, cache=block_kv)
            return velocity

        sampler, still_velocity = config.sampler, None
        if sampler.guided_steps:  # action guidance: the same block with the camera held still
            if np.array_equal(poses, np.broadcast_to(state.camera.pose, poses.shape)):
                # No key held: the block's own map is the still one, so guidance would return v itself.
                sampler = replace(sampler, action_guidance_steps=0)
            else:
                still_velocity = velocity_with(_still_plucker(config, state.camera, intrinsics, device, dtype))
        generator = torch.Generator(device="cpu")
        generator.set_state(state.rng_state)
        latent_shape = (1, config.transformer.out_channels, frames_per_block, config.latent_height,
                        config.latent_width)
        latents = sample_block(velocity_with(plucker), latent_shape, sampler, generator, device, still_velocity)

        # 4. Streaming decode (pending decoder state), before the commit forward: the screen needs the frames,
        #    only the next block needs the K/V, and neither reads the other, so every value is as in the other
        #    order while a viewer's first frames leave a commit forward sooner. on_frames: each latent frame's
        #    pixels as soon as they are decoded (a block that fails after them still commits nothing).
        enter("decode")
        frames, next_decoder = vae_stream.decode_block(vae, state.decoder, latents, decode_frame, on_frames)

        # 5. Commit forward at t=0 on the clean latents: the same context; writes this block's K/V into its
        #    reserved pages.
        enter("commit")
        transformer(torch.cat([latents, extra], dim=1), _timestep(0.0, device), state.text_kv, plucker, start_frame,
                    cache=block_kv.writing(new_pages))
        del block_kv
        enter("done")  # closes the commit timing
        stage_ms = clock.stage_ms()
    except BaseException:
        pages.free(new_pages)
        raise

    # Commit: nothing below can fail on a valid state.
    next_kv, dropped = state.kv.after_commit(config, start_frame, new_pages)
    pages.free(dropped)
    next_state = replace(state, block_index=state.block_index + 1, condition=next_condition, decoder=next_decoder,
                         kv=next_kv, rng_state=generator.get_state(), camera=next_camera)
    return BlockOutput(state.block_index, latents, frames, poses, stage_ms), next_state


class StageClock:
    """Milliseconds per stage of one block, as the device spent them.

    On a CPU a stage's time is the wall time between two `enter` calls. On CUDA the Python side only
    queues kernels, so wall time there would be launch time (the decode stage would absorb the rest when
    its frames reach the host): each `enter` records a CUDA event on the current stream instead, and
    `stage_ms` waits for the last one once, at the end of the block, without a sync between stages.
    """

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._marks: list[tuple[str, Any]] = []  # (stage, when it began: perf_counter seconds or a CUDA event)

    def enter(self, stage: str) -> None:
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append((stage, event))
        else:
            self._marks.append((stage, time.perf_counter()))

    def stage_ms(self) -> dict[str, float]:
        """{stage: ms} for every stage entered and left (the last mark only closes the one before it)."""
        if self._cuda and self._marks:
            self._marks[-1][1].synchronize()
        out: dict[str, float] = {}
        for (stage, began), (_, ended) in zip(self._marks, self._marks[1:]):
            out[stage] = began.elapsed_time(ended) if self._cuda else 1000.0 * (ended - began)
        return out


def _block_camera(config: ModelConfig, camera_state: camera.CameraState, control: BlockControl):
    frames_per_block = config.transformer.num_frames_per_block
    if control.poses is not None:
        poses = np.asarray(control.poses, dtype=np.float64)
        intrinsics = np.asarray(control.intrinsics, dtype=np.float64)
        if poses.shape != (frames_per_block, 4, 4) or intrinsics.shape != (frames_per_block, 4):
            raise ValueError(f"a block needs poses [{frames_per_block},4,4] and intrinsics [{frames_per_block},4]")
        return poses, intrinsics, camera.CameraState(poses[-1])
    actions = control.actions if control.actions is not None else (frozenset(),) * frames_per_block
    poses, next_camera = camera.integrate_actions(camera_state, actions, config.camera)
    return poses, camera.reference_intrinsics(config.camera, frames_per_block, config.width, config.height), next_camera


def _still_plucker(config: ModelConfig, camera_state: camera.CameraState, intrinsics: np.ndarray, device,
                   dtype) -> torch.Tensor:
    """[1, F, 6, H, W]: the Plücker map of this block with the camera held where the last block left it
    (what a block without keys gives), for the sampler's action guidance."""
    still = np.repeat(camera_state.pose[None], len(intrinsics), axis=0)
    return camera.plucker_block(camera_state.pose, still, intrinsics, config.width, config.height,
                                config.camera).unsqueeze(0).to(device=device, dtype=dtype)


def _timestep(value: float, device) -> torch.Tensor:
    return torch.full((1,), float(value), dtype=torch.float32, device=device)


def _device_of(module) -> torch.device:
    return next(module.parameters()).device


def _dtype_of(module) -> torch.dtype:
    return next(module.parameters()).dtype
