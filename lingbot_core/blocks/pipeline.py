"""The loaded model: transformer, VAE and text encoder on one device, plus the verbs a rollout needs.

A `Pipeline` holds weights only. Every world's state lives in a `RolloutState` the caller owns, so one
pipeline serves any number of sessions.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Iterable, Iterator

from PIL import Image
import torch

from lingbot_core.process.compile_cache import graphs_cached, graphs_key, keep_compiled_kernels, mark_graphs_cached
from lingbot_core.process.compile_switch import BACKGROUND, COMPILED, EAGER, CompileSwitch, warm_blocks
from lingbot_core.blocks.condition_cache import ConditionCache
from lingbot_core.config import ModelConfig
from lingbot_core.boundary.image import image_to_tensor
from lingbot_core.blocks.kv_cache import KVPagePool
from lingbot_core.blocks.pages import PageAllocator
from lingbot_core.blocks.loading import LoadedParts, load_pipeline_parts
from lingbot_core.process.startup import StartupLog, maybe_stage
from lingbot_core.model.attention import context_frames
from lingbot_core.model.text import TextEncoder
from lingbot_core.model.vae_stream import ConditionStream, FrameDecoder, SharedCondition, compile_frame_decoder, decode_latent_frame
from lingbot_core.process.precision import AUTO, DTYPES, Precision, choose_precision
from lingbot_core.boundary.requests import StartRequest, parse_start
from lingbot_core.boundary.requests import BlockControl
from lingbot_core.blocks.rollout import BlockOutput, RolloutState, condition_pixels, new_rollout, release, step_block


@dataclass
class Pipeline:
    config: ModelConfig
    transformer: torch.nn.Module
    vae: torch.nn.Module
    text_encoder: TextEncoder
    device: torch.device
    dtype: torch.dtype
    decode_frame: FrameDecoder = decode_latent_frame  # the VAE decoder step, compiled or eager
    precision: Precision | None = None  # how the dtype was chosen (None: parts built by the caller)
    # Eager/compiled switch (lingbot_core/process/compile_switch.py); None: the path fixed at load time.
    compile_switch: CompileSwitch | None = None
    compile_mode: str = EAGER  # what load_pipeline chose (EAGER, COMPILED or BACKGROUND), for start-up lines

    @classmethod
    def from_parts(cls, parts: LoadedParts, decode_frame: FrameDecoder = decode_latent_frame,
                   precision: Precision | None = None) -> "Pipeline":
        """Wrap loaded (or seeded) parts; device and dtype are read off the transformer's weights."""
        weight = next(parts.transformer.parameters())
        return cls(parts.config, parts.transformer, parts.vae, parts.text_encoder, weight.device, weight.dtype,
                   decode_frame, precision)

    def encode_prompt(self, prompt: str) -> Any:
        """Per-layer cross-attention K/V for a prompt: computed once, reused by every forward."""
        with torch.inference_mode():
            states = self.text_encoder.encode(prompt).to(device=self.device, dtype=self.dtype)
            return self.transformer.prepare_text(states)

    def start(self, image, prompt: str, seed: int, **kwargs) -> RolloutState:
        """A new world from raw input (a path, bytes, an array; any prompt text): parsed here, at this
        boundary (lingbot_core/boundary/requests.py), then `start_request`."""
        return self.start_request(parse_start(image, prompt, seed, self.config), **kwargs)

    def start_request(self, request: StartRequest, conditions: ConditionCache | None = None,
                      **kwargs) -> RolloutState:
        """A new world from a parsed start, trusted as it is. conditions: share the picture's condition
        stream through this cache."""
        pixels = self.pixels(request.picture)
        if conditions is not None:
            kwargs["condition"] = ConditionStream.reading(self.shared_condition(pixels, conditions))
        return new_rollout(self.config, self.vae, pixels, self.encode_prompt(request.prompt), request.prompt,
                           request.seed, **kwargs)

    def pixels(self, picture) -> torch.Tensor:
        """[1, 3, H, W] in [-1, 1] of a picture already fitted to the model's size (StartRequest.picture)."""
        return image_to_tensor(picture, self.config.height, self.config.width)  # fitted: no resample

    def shared_condition(self, pixels: torch.Tensor, conditions: ConditionCache) -> SharedCondition:
        """The condition stream that sessions from these start pixels (`pixels`) share through `conditions`."""
        return conditions.stream_for(condition_pixels(self.vae, pixels))

    def encode_next_condition_block(self, shared: SharedCondition) -> None:
        """Encode one more block of a shared condition stream (nothing once it is at its fixed point)."""
        with torch.inference_mode():  # as a block's own condition encode runs (step)
            shared.block(self.vae, shared.blocks_known, self.config)

    def with_prompt(self, state: RolloutState, prompt: str) -> RolloutState:
        """A copy of `state` that uses a new prompt; `state` itself stays valid until a block commits.

        `prompt` was cleaned at the boundary (an event's parse) and is taken as it is. The text K/V are computed
        only when the text really changes (a script may repeat its prompt)."""
        if prompt == state.prompt:
            return state
        return replace(state, text_kv=self.encode_prompt(prompt), prompt=prompt)

    def prompt_notice(self, prompt: str) -> str | None:
        """What the model does not read of a cleaned prompt, in words (None: it reads all of it). Tokenizer
        work only, no PyTorch kernel: request threads may call it."""
        count, dropped = self.text_encoder.tokens_past_limit(prompt)
        if not dropped:
            return None
        keep = self.text_encoder.max_length
        return (f"the prompt is {count} tokens; the model reads its first {keep} (the rest, {dropped} tokens, is "
                f"cut as upstream cuts it)")

    def step(self, pool: KVPagePool, pages: PageAllocator, state: RolloutState, control: BlockControl,
             on_stage=None, on_frames=None) -> tuple[BlockOutput, RolloutState]:
        if self.compile_switch is not None:  # between blocks: the only place the path may change
            self.compile_switch.at_block_boundary(state.block_index)
        with torch.inference_mode():
            return step_block(self.config, self.transformer, self.vae, pool, pages, state, control, on_stage,
                              self.decode_frame, on_frames)

    def warm_rollout(self) -> None:
        """A short private rollout from a blank picture that meets every graph shape a real rollout does:
        each context window fill (one fixed shape: a masked graph while it fills, an unmasked one when full)
        and the decoder cache filling up.
        CompileSwitch.build runs it on the compiled path; it never runs the switch itself."""
        t = self.config.transformer
        blocks = warm_blocks(t.num_frames_per_block, lambda frame: len(context_frames(frame, t)))
        pool = self.new_pool()
        pages = PageAllocator(pool.num_pages)
        # A typed start of our own: nothing here is user input, so nothing is parsed.
        blank = Image.new("RGB", (self.config.width, self.config.height))
        state = self.start_request(StartRequest(blank, "warm-up", 0))
        try:
            for _ in range(blocks):
                with torch.inference_mode():
                    _, state = step_block(self.config, self.transformer, self.vae, pool, pages, state,
                                          BlockControl(), decode_frame=self.decode_frame)
        finally:
            release(pages, state)

    def new_pool(self, num_pages: int | None = None) -> KVPagePool:
        """The K/V tensors of a page pool, sized for one rollout unless told otherwise; its owner keeps the
        bookkeeping (a PageAllocator of pool.num_pages)."""
        return KVPagePool(self.config, num_pages or KVPagePool.pages_per_rollout(self.config), self.dtype,
                          self.device)

    def rollout(self, image, prompt: str, seed: int, controls: Iterable[BlockControl],
                **kwargs) -> Iterator[BlockOutput]:
        """A whole offline rollout from raw input, parsed here (bad input raises now, not on the first block)."""
        return self.rollout_request(parse_start(image, prompt, seed, self.config), controls, **kwargs)

    def rollout_request(self, request: StartRequest, controls: Iterable[BlockControl],
                        **kwargs) -> Iterator[BlockOutput]:
        """Run a whole offline rollout of a parsed start on a private pool; blocks are yielded as they are made."""
        pool = self.new_pool()
        pages = PageAllocator(pool.num_pages)
        state = self.start_request(request, **kwargs)
        try:
            for control in controls:
                if control.prompt is not None:
                    state = self.with_prompt(state, control.prompt)
                output, state = self.step(pool, pages, state, control)
                yield output
        finally:
            release(pages, state)


def load_pipeline(source: str = "embedded", *, dtype: torch.dtype | str = AUTO, device: str = "cpu",
                  compile: bool | None = None, allow_download: bool = False, log: StartupLog | None = None,
                  **overrides) -> Pipeline:
    """Load `embedded`, a local diffusers-format folder or (with allow_download) a Hub repo id.

    dtype: "auto" (see lingbot_core/process/precision.py: bf16 on CUDA and on CPUs where a probe shows it faster,
    else fp32), "bf16", "fp32", or a torch dtype. The choice and its reason are on `pipeline.precision`.
    compile: None compiles where it pays (see `compile_plan`), True forces it, False turns it off. On a CPU
    the graphs build on a warm-up rollout (`Pipeline.warm_rollout`): with compile=True before this returns; by
    default only for a model in CPU_COMPILE_PAYS (measured to pay; none yet), in a background thread while the
    first blocks run eager, switching to compiled between two blocks (lingbot_core/process/compile_switch.py).
    The inductor cache makes that build seconds instead of minutes.
    log: prints each stage (load, precision, compile) with its time.
    """
    if isinstance(dtype, torch.dtype):
        names = {value: name for name, value in DTYPES.items()}
        dtype = names.get(dtype, dtype)
    if isinstance(dtype, torch.dtype):  # float64: exactness tests only, no name on the command line
        parts, precision = load_pipeline_parts(source, dtype=dtype, device=device, allow_download=allow_download,
                                               **overrides), None
    else:
        with maybe_stage(log, "load the model and choose its precision") as details:
            parts, precision = choose_precision(
                dtype, device, lambda d: load_pipeline_parts(source, dtype=d, device=device,
                                                             allow_download=allow_download, **overrides))
            details.append(f"{parts.config.name}, {precision.describe()}")
    device_type = torch.device(device).type
    key = graphs_key(parts.config, next(parts.transformer.parameters()).dtype, device_type)
    mode, reason = compile_plan(compile, device_type, parts.config.name, graphs_cached(key))
    if mode == EAGER:
        if log is not None:
            log.note(f"compile: eager ({reason})")
        return Pipeline.from_parts(parts, decode_latent_frame, precision)
    keep_compiled_kernels().mkdir(parents=True, exist_ok=True)
    if device_type == "cuda":  # torch.compile is lazy: the graphs build on the first blocks
        parts.transformer.compile_blocks()
        pipe = Pipeline.from_parts(parts, compile_frame_decoder(), precision)
        pipe.compile_mode = COMPILED
        if log is not None:
            log.note(f"compile: compiled ({reason}; the graphs build on the first blocks)")
        return pipe
    switch = CompileSwitch(parts.transformer.blocks)
    pipe = Pipeline.from_parts(parts, switch.decode_frame, precision)
    pipe.compile_switch, pipe.compile_mode = switch, mode

    def build() -> None:
        pipe.warm_rollout()
        mark_graphs_cached(key)

    if mode == COMPILED:
        with maybe_stage(log, "compile") as details:
            switch.build(build)
            details.append(f"compiled ({reason})" if switch.error is None else
                           f"failed, eager: {type(switch.error).__name__}: {switch.error}")
        if switch.error is not None:
            pipe.compile_mode = EAGER
    else:
        if log is not None:
            log.note(f"compile: {BACKGROUND} ({reason})")
        switch.build_in_background(build, report=None if log is None else lambda text: log.note(f"compile: {text}"))
    return pipe


# Models whose compiled block `benchmarks/bench_block.py --compile` measured faster than eager on a CPU,
# on both kinds of CPU (README "Speed"). None at present: the compiled-faster figures came from the old
# 128x224 preset before cpu_kernels.py, the 96x160 preset was not re-measured, and on a 2-core machine
# a background build (minutes when the cache is cold) takes a core from the eager blocks it serves.
# Others on a CPU stay eager unless asked (--compile).
CPU_COMPILE_PAYS: frozenset[str] = frozenset()


def compile_plan(compile: bool | None, device_type: str, model_name: str, cached: bool) -> tuple[str, str]:
    """(EAGER, COMPILED or BACKGROUND, the reason in words) for the flag, the device and the cache state."""
    cache = "inductor cache warm" if cached else "inductor cache cold"
    if compile is False:
        return EAGER, "--no-compile"
    if device_type == "cuda":
        return COMPILED, "--compile" if compile else "default on CUDA"
    if compile:
        return COMPILED, f"--compile, {cache}"
    if model_name not in CPU_COMPILE_PAYS:
        return EAGER, f"compiling {model_name!r} on a CPU is not measured to pay; --compile forces it"
    # Even a warm cache takes seconds to load and trace every graph; serving eager meanwhile keeps
    # start-up to "ready" short. The first blocks are eager either way.
    return BACKGROUND, (f"default for {model_name!r} on a CPU; {cache}: "
                        + ("seconds to build" if cached else "minutes to build"))
