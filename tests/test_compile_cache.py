"""torch.compile's kernels go to the project's cache folder, which outlives the process; the user's choice wins.
Checked in a subprocess that imports the package and then diffusers (whose imports make inductor settle on its
own /tmp default if nothing was set before)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROGRAM = ("import os, lingbot_core, diffusers; from torch._inductor.runtime.cache_dir_utils import cache_dir; "
           "print(cache_dir())")


def _inductor_dir(**env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    return subprocess.run([sys.executable, "-c", PROGRAM], cwd=ROOT, env={**environ, **env}, capture_output=True,
                          text=True, check=True, timeout=120).stdout.strip()


def test_inductor_uses_the_project_cache_folder_unless_told_otherwise(tmp_path):
    assert _inductor_dir(XDG_CACHE_HOME=str(tmp_path)) == str(tmp_path / "lingbot" / "inductor")
    chosen = tmp_path / "mine"
    assert _inductor_dir(XDG_CACHE_HOME=str(tmp_path), TORCHINDUCTOR_CACHE_DIR=str(chosen)) == str(chosen)
