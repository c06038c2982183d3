"""Memory: what one session holds, measured once, and every figure admission and the page pool follow from.

`plan_memory` runs the one probe (`measure_footprint`: no model block, the VAE streamed on a small frame
and scaled, one prompt encoded; on CUDA also the probe's peak of transient memory) and derives from it
everything the engine admits by: the bytes a session holds between blocks at its largest plus the finished
blocks its consumer has not taken (`session_bytes`), the bytes the one running block adds
(`block_reserve`), the reserve for shared condition streams, the budget, how many sessions fit
(`capacity`) and the page pool's size (`pool_pages`). Admission and pool sizing read the same plan, so an
admitted session never runs out of pages. `held_bytes` (lingbot_core/model/held_bytes.py) is the one way bytes
are counted, for the probe, for a live session's and a VAE stream's `nbytes` and for the tests that check
accounted == held.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from lingbot_core.model.held_bytes import held_bytes
from lingbot_core.blocks.kv_cache import BlockKV, KVPagePool
from lingbot_core.model import vae_stream
from lingbot_core.boundary.video import frames_to_uint8



@dataclass(frozen=True)
class Footprint:
    """Peak bytes of one session of a pipeline, measured once on a probe rollout (see `measure_footprint`).

    `committed` is what a session holds between blocks at worst; `in_flight` is what one running block
    adds on top (its reserved pages, the pending encoder and decoder states, the block's working tensors).
    """

    page_bytes: int
    kv_pages: int  # the committed page table at its fullest: sink + recent window
    text_kv: int
    condition: int  # condition stream at its largest: encoder history + the last condition block
    decoder: int  # decoder feature cache at its largest
    rng: int  # the generator state carried between blocks
    block_pages: int  # pages a block reserves for its own K/V
    scratch: int  # a block's working tensors: noise and latents, mask + condition input, Plücker map, frames
    message: int  # one finished block handed to a consumer: uint8 pixels + latents

    @property
    def committed(self) -> int:
        return self.kv_pages + self.text_kv + self.condition + self.decoder + self.rng

    @property
    def in_flight(self) -> int:
        """A block with a prompt switch: pending pages, encoder, decoder and text K/V, plus scratch."""
        return self.block_pages + self.condition + self.decoder + self.text_kv + self.scratch


def block_scratch_bytes(config, model_dtype: torch.dtype, vae_dtype: torch.dtype) -> int:
    """Working tensors a block keeps across its stages, from the config's shapes.

    latents and the mask + condition input are float32 (the sampler's dtype); the Plücker map is in the
    model dtype, and with action guidance a second one (the camera held still) lives beside it; the
    decoded frames are in the VAE dtype. Transformer activations are transient within a
    stage and belong to the worker, not to a session.
    """
    t = config.transformer
    latent = t.num_frames_per_block * config.latent_height * config.latent_width
    fp32 = torch.empty((), dtype=torch.float32).element_size()
    latents = t.out_channels * latent * fp32  # [1, z, F, h, w]
    extra = (t.mask_channels + t.out_channels) * latent * fp32  # [1, mask + z, F, h, w]
    mask = t.mask_channels * latent * torch.empty((), dtype=vae_dtype).element_size()
    pixels = config.height * config.width
    plucker = t.num_frames_per_block * t.camera_channels * pixels * torch.empty((), dtype=model_dtype).element_size()
    plucker *= 2 if config.sampler.guided_steps else 1
    frames = 3 * config.pixel_frames_per_block * pixels * torch.empty((), dtype=vae_dtype).element_size()
    return latents + extra + mask + plucker + frames


def measure_footprint(pipeline, seed: int = 0) -> Footprint:
    """Each component's peak for one session of `pipeline`, without running a block of the model.

    The KV pages, the RNG state, a block's scratch and a finished block's size follow from the config;
    the text K/V are one real prompt encoding; the condition and decoder states come from
    `vae_stream.probe_stream_bytes` (two blocks streamed through the VAE on a small frame, scaled to the
    model's frame). Start-up used to run two whole blocks for this, 19 s on a 2-core AVX2 CPU in fp32.
    """
    config = pipeline.config
    t = config.transformer
    frames_per_block = t.num_frames_per_block
    page_bytes = KVPagePool.page_nbytes(config, pipeline.dtype)
    streams = vae_stream.probe_stream_bytes(pipeline.vae, config)
    generator_state = torch.Generator(device="cpu").manual_seed(seed).get_state()
    # What the engine hands a consumer: the frames as uint8 pixels (sized by the conversion itself) and the
    # float32 latents the sampler returns.
    pixels = frames_to_uint8(torch.zeros(1, 3, streams.pixel_frames, config.height, config.width)).nbytes
    latents = held_bytes(torch.zeros(1, t.out_channels, frames_per_block, config.latent_height, config.latent_width))
    vae_dtype = next(pipeline.vae.parameters()).dtype
    return Footprint(page_bytes=page_bytes, kv_pages=(t.sliding_window_num_frames - frames_per_block) * page_bytes,
                     text_kv=held_bytes(pipeline.encode_prompt("probe")), condition=streams.condition,
                     decoder=streams.decoder, rng=held_bytes(generator_state),
                     block_pages=frames_per_block * page_bytes,
                     scratch=block_scratch_bytes(config, pipeline.dtype, vae_dtype), message=pixels + latents)



def committed_bytes(rollout, page_bytes: int) -> dict[str, int]:
    """Bytes a session's committed rollout state holds, by component (its KV pages live in the shared pool)."""
    return {
        "kv_pages": len(rollout.kv.frame_pages) * page_bytes,
        "text_kv": held_bytes(rollout.text_kv),
        "condition": rollout.condition.nbytes(),
        "decoder": rollout.decoder.nbytes(),
        "rng": held_bytes(rollout.rng_state),
    }


def in_flight_bytes(pipeline, pool_dtype: torch.dtype, footprint: Footprint | None, state,
                    prompt_switch: bool) -> dict[str, int]:
    """Bytes a block adds while it runs: reserved pages, pending encoder/decoder/text state, scratch."""
    config = pipeline.config
    page_bytes = KVPagePool.page_nbytes(config, pool_dtype)
    if footprint is not None:
        condition, decoder, scratch = footprint.condition, footprint.decoder, footprint.scratch
    else:  # without a probe, the committed states stand in for their pending copies
        vae_dtype = next(pipeline.vae.parameters()).dtype
        condition, decoder = state.condition.nbytes(), state.decoder.nbytes()
        scratch = block_scratch_bytes(config, pool_dtype, vae_dtype)
    return {
        "pending_pages": config.transformer.num_frames_per_block * page_bytes,
        # At the fixed point the pending condition stream shares the committed condition tensor.
        "pending_condition": 0 if state.condition.fixed else condition,
        "pending_decoder": decoder,
        "pending_text_kv": held_bytes(state.text_kv) if prompt_switch else 0,
        "scratch": scratch,
    }

def available_memory_bytes(device: torch.device) -> int:
    """Free memory where the session state lives: GPU memory on CUDA, physical RAM otherwise."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        # Blocks PyTorch's caching allocator holds but no tensor uses are free to this process, though the
        # driver counts them as used (the load and the probe leave some behind).
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def total_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        _, total = torch.cuda.mem_get_info(device)
        return total
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class MemoryPlan:
    """Every figure the engine admits by, from one probe. Sessions fit while
    reserved_bytes + sessions x session_bytes <= budget and sessions <= capacity."""

    footprint: Footprint
    block_reserve: int  # the one running block: its pages, pending encoder/decoder/text state, scratch, KV window
    condition_reserve: int  # condition streams kept for pictures no session reads now
    session_bytes: int  # one session between blocks at its largest + the finished blocks its consumer may hold
    budget: int
    capacity: int
    pages_per_session: int  # pages a session holds between blocks at most: sink + recent window
    block_pages: int  # pages the one running block reserves for its own K/V

    @property
    def reserved_bytes(self) -> int:
        return self.block_reserve + self.condition_reserve

    @property
    def pool_pages(self) -> int:
        """Between blocks each session holds its window; only the one running block holds its own pages too."""
        return self.capacity * self.pages_per_session + self.block_pages

    def fits(self, sessions: int) -> bool:
        return sessions <= self.capacity and self.reserved_bytes + sessions * self.session_bytes <= self.budget


# The share of the memory free at start-up that the engine plans with, by device type, unless told
# (EngineConfig.memory_fraction). A GPU that serves the model is the engine's alone; a CPU host's memory is
# shared with the OS, the app and other processes. On an H200 with the 14B model loaded, half of what was
# free held no session: one session (21.1 GiB) plus the running block's reserve (24.7 GiB) plus the condition
# streams (4.2 GiB) exceed 46.8 GiB, so `app.py --device cuda` refused to start (benchmarks/bench_gpu.py).
DEFAULT_MEMORY_FRACTION = {"cuda": 0.9, "cpu": 0.5}


def plan_memory(pipeline, *, budget_bytes: int | None, fraction: float | None, max_sessions: int | None,
                max_lead_blocks: int, condition_cache_bytes: int | None) -> MemoryPlan:
    """The probe, then the plan. budget_bytes None: `fraction` of what the device has free now (fraction
    None: DEFAULT_MEMORY_FRACTION for the pipeline's device type).

    On CUDA the block reserve also covers transient memory, measured as the probe's peak above what the
    probe's own states hold; on the CPU only the block's named tensors are reserved. The probe streams a
    small frame, so that measure catches little of a full-size block: what checks the plan against a real
    block is `benchmarks/bench_gpu.py` (its "unplanned" figure: a peak of 1.1 GiB under the plan for the
    14B model on an H200). Raises ValueError when the budget holds no session.
    """
    device = pipeline.device
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    footprint = measure_footprint(pipeline)
    # The running block's own bytes, and the KV window its transformer stages gather (the worker's, not a
    # session's: freed after the block's commit forward, so no session's in-flight bytes include it; the
    # decode runs while it is held, and the plan reserves both at once).
    block_reserve = footprint.in_flight + BlockKV.window_nbytes(pipeline.config, pipeline.dtype)
    if cuda:
        transient = torch.cuda.max_memory_allocated(device) - base - (
            footprint.text_kv + footprint.condition + footprint.decoder)  # what the probe itself held at most
        block_reserve = max(block_reserve, transient + footprint.block_pages)
    # Sessions share one condition stream per start picture; each is still charged a stream of its own
    # (`footprint.condition`), and the streams kept for pictures no session reads have their own reserve.
    condition_reserve = 4 * footprint.condition if condition_cache_bytes is None else condition_cache_bytes
    session_bytes = footprint.committed + max_lead_blocks * footprint.message
    if budget_bytes is None:
        fraction = DEFAULT_MEMORY_FRACTION[device.type] if fraction is None else fraction
        budget_bytes = int(available_memory_bytes(device) * fraction)
    elif budget_bytes > total_memory_bytes(device):
        raise ValueError(f"memory_budget_bytes={budget_bytes} exceeds the {device.type} memory of "
                         f"{total_memory_bytes(device) / 2**30:.1f} GiB")
    capacity = max(0, (budget_bytes - block_reserve - condition_reserve) // session_bytes)
    if max_sessions is not None:
        capacity = min(capacity, max_sessions)
    if capacity < 1:
        raise ValueError(f"a memory budget of {budget_bytes / 2**20:.1f} MiB holds no session: one needs "
                         f"{session_bytes / 2**20:.1f} MiB plus {block_reserve / 2**20:.1f} MiB "
                         f"for the block being computed and {condition_reserve / 2**20:.1f} MiB for "
                         "the shared condition streams")
    return MemoryPlan(footprint, int(block_reserve), int(condition_reserve), int(session_bytes), int(budget_bytes),
                      int(capacity), footprint.kv_pages // footprint.page_bytes,
                      footprint.block_pages // footprint.page_bytes)
