"""Which floating-point precision the model runs in, and why: the one place that decides it.

`--dtype auto` (the default of the app, the offline command, the examples and the benchmarks):

- CUDA: bf16 (tensor cores run it natively; half the memory of fp32).
- A CPU with native bf16 matrix units (AMX-BF16 or AVX512-BF16 in its flags): bf16 if a short probe of the
  model's own heaviest kernels (one transformer block, one VAE decoder step) confirms it beats fp32 there;
  otherwise fp32. The probe is what catches a CPU that reports bf16 but runs it slowly.
- Any other CPU (AVX2-only x86, most ARM laptops): fp32. Without those units PyTorch emulates bf16 by
  converting around fp32 arithmetic, which measured 23x slower than fp32 for a whole block on an AVX2 EPYC.

An explicit `--dtype bf16|fp32` always wins. Every choice carries a one-line reason, printed at start-up
and shown on the app's header line.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

# The one name -> dtype mapping of the project (command-line choices, replay files).
DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp32": torch.float32}
AUTO = "auto"
DTYPE_CHOICES = (AUTO, *DTYPES)
# CPU flags (as Linux lists them in /proc/cpuinfo) that mean bf16 matrix products run in hardware.
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


@dataclass(frozen=True)
class CpuInfo:
    """What the CPU offers: PyTorch's vector capability (e.g. "AVX2", "AVX512") and the bf16 flags it has."""

    capability: str
    bf16_flags: tuple[str, ...] = ()

    @property
    def native_bf16(self) -> bool:
        return bool(self.bf16_flags)

    def describe(self) -> str:
        extra = f" with {', '.join(self.bf16_flags)}" if self.bf16_flags else " without native bf16 (no AMX-BF16, no AVX512-BF16)"
        return f"{self.capability} CPU{extra}"


def detect_cpu(cpuinfo: Path = Path("/proc/cpuinfo")) -> CpuInfo:
    """PyTorch's capability plus the native-bf16 flags from /proc/cpuinfo (none found where it is absent)."""
    flags: set[str] = set()
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.partition(":")[2].split())
                break
    except OSError:  # not Linux: no flags, so auto stays at fp32, which is never slow
        pass
    return CpuInfo(torch.backends.cpu.get_cpu_capability(), tuple(f for f in NATIVE_BF16_FLAGS if f in flags))


@dataclass(frozen=True)
class Precision:
    """The chosen precision, its reason, and the probe timings behind it (seconds per dtype name), if any."""

    name: str  # a key of DTYPES
    reason: str
    probe_s: dict[str, float] = field(default_factory=dict)

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.name]

    def describe(self) -> str:
        return f"{self.name} ({self.reason})"


def check_dtype_name(name: str) -> str:
    if name != AUTO and name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not one of {', '.join(DTYPE_CHOICES)}")
    return name


def precision_before_probe(requested: str, device: torch.device | str, cpu: CpuInfo | None = None) -> Precision | None:
    """The choice when no measurement is needed; None when the probe must decide (auto on a native-bf16 CPU)."""
    check_dtype_name(requested)
    if requested != AUTO:
        return Precision(requested, "asked for with --dtype")
    if torch.device(device).type == "cuda":
        return Precision("bf16", "auto on CUDA")
    cpu = cpu or detect_cpu()
    if not cpu.native_bf16:
        return Precision("fp32", f"auto on an {cpu.describe()}: bf16 would be emulated")
    return None


def precision_from_probe(timings: dict[str, float], cpu: CpuInfo) -> Precision:
    """bf16 when the probe ran it faster than fp32 (the model then also needs half the memory), else fp32."""
    bf16, fp32 = timings["bf16"], timings["fp32"]
    measured = f"probe: bf16 {1000 * bf16:.0f} ms, fp32 {1000 * fp32:.0f} ms"
    if bf16 < fp32:
        return Precision("bf16", f"auto on an {cpu.describe()}; {measured}", dict(timings))
    return Precision("fp32", f"auto on an {cpu.describe()}, but bf16 is not faster here; {measured}", dict(timings))


# ---------------------------------------------------------------------------------------------
# The probe: the model's own heaviest kernels, at the model's own shapes


def _best_of(work: Callable[[], None], repeats: int) -> float:
    """Seconds of the fastest of `repeats` timed runs, after one untimed run (kernel set-up, allocations)."""
    work()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - started)
    return best


# The probe's work is about 15-20 ms a precision on the embedded model, and a single timed run of it is
# within noise of the other precision: on a 2-core AMX host one run chose fp32 (bf16 21.6 ms, fp32 21.0),
# while the best of 5 gave bf16 14.2 / fp32 16.8 ms in each of two probes (a whole block: bf16 about 25%
# faster). Five runs cost about 0.2 s of start-up.
PROBE_REPEATS = 5


def probe_kernels(parts, dtype: torch.dtype, repeats: int = PROBE_REPEATS) -> float:
    """Seconds for one transformer block forward and one VAE decoder step of `parts`' model, run in `dtype`
    (the best of `repeats` timed runs).

    Copies of one block and of the decoder are cast to `dtype`, so the loaded weights stay as they are.
    The inputs have the shapes of one real block (all its tokens, the text length, the camera stream);
    the values are noise: speed does not depend on them.
    """
    from lingbot_core.model.vae_stream import _new_cache, decode_latent_frame  # the VAE's own cache layout

    config = parts.config
    t = config.transformer
    block = copy.deepcopy(parts.transformer.blocks[0]).to(dtype)
    vae = copy.deepcopy(parts.vae)
    torch.nn.Module.to(vae, dtype=dtype)
    generator = torch.Generator().manual_seed(0)

    def noise(*shape: int, dt: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(shape, generator=generator).to(dt)

    frames, tokens = t.num_frames_per_block, config.tokens_per_frame
    heads, head_dim = t.num_attention_heads, t.dim // t.num_attention_heads
    x, cam = noise(1, frames, tokens, t.dim), noise(1, frames, tokens, t.dim)
    e0 = noise(1, frames, 1, 6, t.dim)
    text_k, text_v = noise(1, config.text.max_length, heads, head_dim, dt=dtype), noise(
        1, config.text.max_length, heads, head_dim, dt=dtype)
    cos, sin = noise(frames * tokens, head_dim // 2), noise(frames * tokens, head_dim // 2)
    latent = noise(1, vae.config.z_dim, 1, config.latent_height, config.latent_width, dt=dtype)

    def run() -> None:
        block(x, e0, text_k, text_v, cam, cos, sin)
        decode_latent_frame(vae, latent, _new_cache(vae.decoder), True)

    with torch.inference_mode():
        return _best_of(run, repeats)


def choose_precision(requested: str, device: torch.device | str, load: Callable[[torch.dtype], object],
                     cpu: CpuInfo | None = None,
                     probe: Callable[[object, torch.dtype], float] = probe_kernels) -> tuple[object, Precision]:
    """Load the model (`load(dtype) -> parts`) in the chosen precision; returns (parts, precision).

    Where the probe decides, the model is loaded in bf16 (the likely winner, and the smaller), both
    precisions are timed on copies of its kernels, and it is loaded again in fp32 only if fp32 won.
    """
    cpu = cpu or detect_cpu()
    precision = precision_before_probe(requested, device, cpu)
    if precision is not None:
        return load(precision.dtype), precision
    parts = load(DTYPES["bf16"])
    precision = precision_from_probe({name: probe(parts, dtype) for name, dtype in DTYPES.items()}, cpu)
    if precision.name != "bf16":
        del parts  # before loading again, so the two copies are never held together
        parts = load(precision.dtype)
    return parts, precision
