"""The precision choice: explicit wins, CUDA and CPUs without native bf16 decide without a probe, a probe decides
the rest, and the reason says which. Capabilities and timings are injected: nothing here depends on this CPU."""

from __future__ import annotations

import pytest
import torch

from lingbot_core.config import tiny_config
from lingbot_core.blocks.loading import build_seeded_parts
from lingbot_core.process.precision import (AUTO, DTYPES, CpuInfo, choose_precision, detect_cpu, precision_before_probe,
                                    probe_kernels)

AVX2 = CpuInfo("AVX2")
AMX = CpuInfo("AVX512", ("amx_bf16", "avx512_bf16"))


class Loader:
    """Records the dtypes it was asked to load in."""

    def __init__(self) -> None:
        self.loaded: list[torch.dtype] = []

    def __call__(self, dtype: torch.dtype) -> str:
        self.loaded.append(dtype)
        return f"parts in {dtype}"


def timed(**seconds: float):
    """A probe that answers the given seconds per dtype name and counts its calls."""
    names = {dtype: name for name, dtype in DTYPES.items()}
    calls = []

    def probe(parts, dtype):
        calls.append((parts, dtype))
        return seconds[names[dtype]]

    probe.calls = calls
    return probe


def never(parts, dtype):
    raise AssertionError("no probe should run here")


@pytest.mark.parametrize("cpu", [AVX2, AMX])
@pytest.mark.parametrize("name", ["bf16", "fp32"])
def test_an_explicit_dtype_wins_without_a_probe(cpu, name):
    load = Loader()
    parts, precision = choose_precision(name, "cpu", load, cpu=cpu, probe=never)
    assert precision.name == name and precision.dtype == DTYPES[name] and "--dtype" in precision.reason
    assert load.loaded == [DTYPES[name]]


def test_auto_on_cuda_is_bf16_without_a_probe():
    load = Loader()
    _, precision = choose_precision(AUTO, "cuda", load, cpu=AVX2, probe=never)
    assert precision.name == "bf16" and "CUDA" in precision.reason and load.loaded == [torch.bfloat16]


def test_auto_on_a_cpu_without_native_bf16_is_fp32_without_a_probe():
    load = Loader()
    parts, precision = choose_precision(AUTO, "cpu", load, cpu=AVX2, probe=never)
    assert precision.name == "fp32" and load.loaded == [torch.float32]
    assert "AVX2" in precision.reason and "emulated" in precision.reason


def test_auto_on_a_native_cpu_takes_bf16_when_the_probe_finds_it_faster():
    load, probe = Loader(), timed(bf16=0.2, fp32=0.5)
    parts, precision = choose_precision(AUTO, "cpu", load, cpu=AMX, probe=probe)
    assert precision.name == "bf16" and load.loaded == [torch.bfloat16]  # loaded once
    assert {dtype for _, dtype in probe.calls} == {torch.bfloat16, torch.float32}
    assert all(p == "parts in torch.bfloat16" for p, _ in probe.calls)  # the probe times the loaded model
    assert "amx_bf16" in precision.reason and "200 ms" in precision.reason and "500 ms" in precision.reason
    assert precision.probe_s == {"bf16": 0.2, "fp32": 0.5}


@pytest.mark.parametrize("bf16", [0.5, 0.9])
def test_auto_on_a_cpu_that_reports_bf16_but_runs_it_slowly_gets_fp32(bf16):
    load = Loader()
    parts, precision = choose_precision(AUTO, "cpu", load, cpu=AMX, probe=timed(bf16=bf16, fp32=0.5))
    assert precision.name == "fp32" and parts == "parts in torch.float32"
    assert load.loaded == [torch.bfloat16, torch.float32]  # reloaded in fp32, as an explicit fp32 load is
    assert "not faster" in precision.reason


def test_unknown_dtype_names_are_refused():
    with pytest.raises(ValueError, match="auto, bf16, fp32"):
        precision_before_probe("fp16", "cpu", AVX2)


def test_detect_cpu_reads_the_bf16_flags(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_tile amx_bf16\n")
    assert detect_cpu(info).bf16_flags == ("amx_bf16", "avx512_bf16")
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 fma\n")
    assert detect_cpu(info).bf16_flags == () and not detect_cpu(info).native_bf16
    assert detect_cpu(tmp_path / "missing").bf16_flags == ()  # not Linux: no flags, fp32


def test_the_probe_runs_the_models_own_block_and_decoder_step_and_leaves_the_model_as_it_was():
    parts = build_seeded_parts(tiny_config(), seed=0, dtype=torch.float32)
    before = {name: value.clone() for name, value in parts.transformer.state_dict().items()}
    for dtype in DTYPES.values():
        assert probe_kernels(parts, dtype) > 0
    after = parts.transformer.state_dict()
    assert all(after[name].dtype == torch.float32 and torch.equal(after[name], before[name]) for name in before)
    assert next(parts.vae.parameters()).dtype == torch.float32
