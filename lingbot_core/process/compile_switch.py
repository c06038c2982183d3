"""Compiled where it pays, without making the first blocks wait for the compiler.

A cold `torch.compile` of the embedded model takes minutes on a CPU, and the compiled block is faster
only once its graphs exist. A `CompileSwitch` keeps both paths for the transformer blocks and the VAE
decoder step: the model thread runs eager while a build (in this thread or a background one) runs a short
warm-up rollout on the compiled path, which makes dynamo trace and inductor build every graph a rollout
will need: one for the transformer block (a block reads its attention context from a fixed-size window
with a validity mask, kv_cache.py, so the shape never changes as the window fills and slides) and one
per decoder-cache fill. The model thread calls `at_block_boundary()` before each block;
the first call after the build finished switches it to compiled, so no block ever mixes the two paths.

The compiled path of a block is what `nn.Module.compile` installs (`torch.compile(block._call_impl)` as
the block's `_compiled_call_impl`), with a dispatcher in between that picks eager or compiled per call:
the parameter names, the state dict and `block(...)` in the transformer's forward are unchanged. The
dispatcher is per thread while building (only the warm-up thread takes the compiled path) and per switch
afterwards. dynamo's frame hook, grad mode and dispatch modes are thread-local, so the eager thread does
not see the tracing next to it.

If the build fails (no C++ compiler, an unsupported op), the switch stays eager and says why.

The VAE's convolutions call `torch.mkldnn_convolution` on a CPU (lingbot_core/model/cpu_kernels.py), an op
PyTorch ships without a meta kernel; under compile they go through the custom op `lingbot::onednn_conv`
(a fake kernel, fixed contiguous layout), so the compiled graph calls the same oneDNN kernel as eager,
where a fallback to `conv3d` inside the graph would get PyTorch's slow im2col kernel.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Sequence

import torch

from lingbot_core.model.vae_stream import decode_latent_frame, standardise_cache_strides

# The three ways a pipeline runs, as the start-up line names them.
EAGER = "eager"
COMPILED = "compiled"
BACKGROUND = "eager now, compiling in background"

CompileFn = Callable[..., Callable[..., Any]]  # torch.compile's signature; tests inject a fake


class CompileSwitch:
    """Eager or compiled transformer blocks and decoder step, switched only between blocks."""

    def __init__(self, blocks: Sequence[torch.nn.Module], compile_fn: CompileFn = torch.compile,
                 **compile_options: Any) -> None:
        compile_options.setdefault("dynamic", False)  # static shapes: the context window has a fixed size
        self._eager_blocks = [block._call_impl for block in blocks]
        self._compiled_blocks = [compile_fn(block._call_impl, **compile_options) for block in blocks]
        self._compiled_decode = compile_fn(decode_latent_frame, **compile_options)
        self._warming = threading.local()  # .on: this thread builds the graphs (takes the compiled path)
        self._built = threading.Event()
        self._active = False  # read by every call; written only by at_block_boundary (the model thread)
        # Inductor bakes the OpenMP thread count of the thread that compiles into its kernels; a new
        # thread starts at the machine default, so the build adopts the creator's setting.
        self._threads = torch.get_num_threads()
        self.error: BaseException | None = None
        self.build_s: float | None = None
        self.switched_before_block: int | None = None  # which block first ran compiled (for logs and tests)
        for layer, block in enumerate(blocks):
            block._compiled_call_impl = _BlockDispatch(self, layer)

    # ---- the two paths ---------------------------------------------------------------------------------

    def _compiled_here(self) -> bool:
        return self._active or getattr(self._warming, "on", False)

    def call_block(self, layer: int, *args: Any, **kwargs: Any) -> Any:
        path = self._compiled_blocks if self._compiled_here() else self._eager_blocks
        return path[layer](*args, **kwargs)

    def decode_frame(self, vae, x: torch.Tensor, cache, first_chunk: bool) -> torch.Tensor:
        """The `FrameDecoder` a pipeline passes to every block: compiled or eager by the same switch."""
        if not self._compiled_here():
            return decode_latent_frame(vae, x, cache, first_chunk)
        standardise_cache_strides(cache)
        return self._compiled_decode(vae, x, cache, first_chunk)

    # ---- building ----------------------------------------------------------------------------------------

    def build(self, warm_rollout: Callable[[], None], report: Callable[[str], None] | None = None) -> None:
        """Run `warm_rollout` in this thread on the compiled path, which builds every graph it needs.

        Never raises: a failure is kept on `error` and the switch stays eager. report: told the outcome."""
        torch.set_num_threads(self._threads)
        started = time.perf_counter()
        self._warming.on = True
        try:
            warm_rollout()
        except Exception as exc:  # noqa: BLE001 - compiling is an optimisation; eager keeps serving
            self.error = exc
        finally:
            self._warming.on = False
            self.build_s = time.perf_counter() - started
            self._built.set()
        if report is not None:
            if self.error is None:
                report(f"compiled graphs built in {self.build_s:.1f} s; compiled from the next block on")
            else:
                report(f"compiling failed after {self.build_s:.1f} s, staying eager: "
                             f"{type(self.error).__name__}: {self.error}")

    def build_in_background(self, warm_rollout: Callable[[], None],
                            report: Callable[[str], None] | None = None) -> threading.Thread:
        """Start `build` on a daemon thread (a process that ends mid-compile does not wait for it)."""
        thread = threading.Thread(target=self.build, args=(warm_rollout, report), name="lingbot-compile",
                                  daemon=True)
        thread.start()
        return thread

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the build finished (either way); returns whether it has."""
        return self._built.wait(timeout)

    # ---- switching ------------------------------------------------------------------------------------

    def at_block_boundary(self, block_index: int | None = None) -> bool:
        """Called by the model thread before each block and nowhere else: switches to compiled once the
        build succeeded. Returns whether the coming block runs compiled."""
        if not self._active and self._built.is_set() and self.error is None:
            self._active = True
            self.switched_before_block = block_index
        return self._active

    @property
    def compiled(self) -> bool:
        """Whether the model thread's blocks run compiled now."""
        return self._active


class _BlockDispatch:
    """What a block's `__call__` runs in place of `torch.compile(block._call_impl)`: the switch's choice."""

    def __init__(self, switch: CompileSwitch, layer: int) -> None:
        self.switch, self.layer = switch, layer

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.switch.call_block(self.layer, *args, **kwargs)


def warm_blocks(num_frames_per_block: int, context_lengths: Callable[[int], int]) -> int:
    """Blocks a warm-up rollout runs: until the context length (frames before the block that it attends
    to, i.e. the window's validity mask) stops changing, and at least two (the decoder cache fills during
    block 0). The window's shape is fixed, so this meets both graphs (masked while the window fills, unmasked
    once it is full) and every mask pattern a rollout meets."""
    block = 0
    while context_lengths((block + 1) * num_frames_per_block) != context_lengths(block * num_frames_per_block):
        block += 1
    return max(2, block + 1)
