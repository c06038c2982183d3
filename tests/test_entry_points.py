"""Every command of the project still starts: each `python -m` entry point, each benchmark and example script
answers `--help` (so a command cannot rot unseen after a module moves). In-process through runpy, so the suite
pays for PyTorch's import once, not once a command."""

from __future__ import annotations

import contextlib
import io
import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULES = ["lingbot_core.generate", "lingbot_core.serve", "lingbot_core.warm_compile", "lingbot_core.world.examples",
           "training.data",
           "training.vae", "training.world", "training.export", "training.render_samples"]
SCRIPTS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "benchmarks").glob("*.py")) + \
    ["examples/client.py", "examples/realtime.py"]


def _help(run, name: str, monkeypatch) -> str:
    monkeypatch.setattr(sys, "argv", [name, "--help"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as caught:
        run()
    assert caught.value.code in (0, None), f"{name} --help exited with {caught.value.code}"
    return out.getvalue()


@pytest.mark.parametrize("module", MODULES)
def test_every_module_command_answers_help(module, monkeypatch):
    text = _help(lambda: runpy.run_module(module, run_name="__main__", alter_sys=False), module, monkeypatch)
    assert "usage:" in text


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_benchmark_and_example_answers_help(script, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / Path(script).parent))
    text = _help(lambda: runpy.run_path(str(ROOT / script), run_name="__main__"), script, monkeypatch)
    assert "usage:" in text


def test_the_list_covers_every_benchmark():
    on_disk = {p.name for p in (ROOT / "benchmarks").glob("*.py")}
    assert on_disk == {Path(s).name for s in SCRIPTS if s.startswith("benchmarks/")}
    assert (ROOT / "benchmarks" / "run_gpu_checks.sh").exists()
