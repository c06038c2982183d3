"""The loaded model: transformer, VAE and text encoder on one device, plus the verbs a rollout needs.

A `Pipeline` holds weights only. Every world's state lives in a `RolloutState` the caller owns, so one
pipeline serves any number of sessions.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Iterable, Iterator

import torch

from .compile_cache import keep_compiled_kernels
from .condition_cache import ConditionCache
from .config import ModelConfig
from .image import image_to_tensor, load_image
from .kv_cache import KVPagePool
from .loading import LoadedParts, load_pipeline_parts
from .startup import StartupLog, maybe_stage
from .model.text import TextEncoder, normalize_prompt
from .model.vae_stream import ConditionStream, FrameDecoder, compile_frame_decoder, decode_latent_frame
from .precision import AUTO, DTYPES, Precision, choose_precision
from .rollout import BlockControl, BlockOutput, RolloutState, condition_pixels, new_rollout, release, step_block


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

    @classmethod
    def from_parts(cls, parts: LoadedParts, decode_frame: FrameDecoder = decode_latent_frame,
                   precision: Precision | None = None) -> "Pipeline":
        """Wrap loaded (or seeded) parts; device and dtype are read off the transformer's weights."""
        weight = next(parts.transformer.parameters())
        return cls(parts.config, parts.transformer, parts.vae, parts.text_encoder, weight.device, weight.dtype,
                   decode_frame, precision)

    def encode_prompt(self, prompt: str) -> Any:
        """Per-layer cross-attention K/V for a prompt: computed once, reused by every forward."""
        text = normalize_prompt(prompt, self.config.text.max_prompt_chars)
        with torch.inference_mode():
            states = self.text_encoder.encode(text).to(device=self.device, dtype=self.dtype)
            return self.transformer.prepare_text(states)

    def start(self, image, prompt: str, seed: int, conditions: ConditionCache | None = None,
              **kwargs) -> RolloutState:
        """A new world. conditions: share the picture's condition stream through this cache."""
        pixels = image_to_tensor(load_image(image), self.config.height, self.config.width)
        text = normalize_prompt(prompt, self.config.text.max_prompt_chars)
        if conditions is not None:
            shared = conditions.stream_for(condition_pixels(self.vae, pixels))
            kwargs["condition"] = ConditionStream.reading(shared)
        return new_rollout(self.config, self.vae, pixels, self.encode_prompt(text), text, seed, **kwargs)

    def with_prompt(self, state: RolloutState, prompt: str) -> RolloutState:
        """A copy of `state` that uses a new prompt; `state` itself stays valid until a block commits.

        The text K/V are computed only when the text really changes (a script may repeat its prompt)."""
        text = normalize_prompt(prompt, self.config.text.max_prompt_chars)
        if text == state.prompt:
            return state
        return replace(state, text_kv=self.encode_prompt(text), prompt=text)

    def step(self, pool: KVPagePool, state: RolloutState, control: BlockControl,
             on_stage=None) -> tuple[BlockOutput, RolloutState]:
        with torch.inference_mode():
            return step_block(self.config, self.transformer, self.vae, pool, state, control, on_stage,
                              self.decode_frame)

    def new_pool(self, num_pages: int | None = None) -> KVPagePool:
        """A private page pool, sized for one rollout unless told otherwise."""
        return KVPagePool(self.config, num_pages or KVPagePool.pages_per_rollout(self.config), self.dtype,
                          self.device)

    def rollout(self, image, prompt: str, seed: int, controls: Iterable[BlockControl],
                **kwargs) -> Iterator[BlockOutput]:
        """Run a whole offline rollout on a private pool; blocks are yielded as they are made."""
        pool = self.new_pool()
        state = self.start(image, prompt, seed, **kwargs)
        try:
            for control in controls:
                if control.prompt is not None:
                    state = self.with_prompt(state, control.prompt)
                output, state = self.step(pool, state, control)
                yield output
        finally:
            release(pool, state)


def load_pipeline(source: str = "embedded", *, dtype: torch.dtype | str = AUTO, device: str = "cpu",
                  compile: bool | None = None, allow_download: bool = False, log: StartupLog | None = None,
                  **overrides) -> Pipeline:
    """Load `embedded`, a local diffusers-format folder or (with allow_download) a Hub repo id.

    dtype: "auto" (see lingbot_core/precision.py: bf16 on CUDA and on CPUs where a probe shows it faster,
    else fp32), "bf16", "fp32", or a torch dtype. The choice and its reason are on `pipeline.precision`.
    compile=None compiles where it pays off: on CUDA. On a CPU the cold compile (minutes) outweighs the
    gain for an interactive session; `benchmarks/bench_block.py` measures both.
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
    if compile is None:
        compile = torch.device(device).type == "cuda"
    decode_frame = decode_latent_frame
    if compile:  # torch.compile is lazy: the graphs build on the first blocks
        keep_compiled_kernels().mkdir(parents=True, exist_ok=True)
        parts.transformer.compile_blocks()
        decode_frame = compile_frame_decoder()
    return Pipeline.from_parts(parts, decode_frame, precision)

