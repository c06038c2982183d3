"""Where torch.compile keeps its kernels: a project folder that outlives the process, so only the first run
compiles (99 s cold for the embedded model's blocks on an AMX CPU, 8.5 s with a warm cache).

Inductor's own default is /tmp/torchinductor_<user> (gone after a reboot). The project's is
$XDG_CACHE_HOME/lingbot/inductor, i.e. ~/.cache/lingbot/inductor; an explicit TORCHINDUCTOR_CACHE_DIR wins.
Inductor reads the variable from the environment and writes its default there the first time it looks,
which some imports (diffusers) trigger; so the package sets it when it is imported, before those imports.
"""

from __future__ import annotations

import os
from pathlib import Path

VARIABLE = "TORCHINDUCTOR_CACHE_DIR"


def project_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "lingbot" / "inductor"


def keep_compiled_kernels() -> Path:
    """Point inductor at the project cache unless the user chose a folder; returns the folder in use."""
    return Path(os.environ.setdefault(VARIABLE, str(project_cache_dir())))
