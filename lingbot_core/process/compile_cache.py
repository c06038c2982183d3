"""Where torch.compile keeps its kernels: a project folder that outlives the process, so only the first run
compiles (99 s cold for the embedded model's blocks on an AMX CPU, 8.5 s with a warm cache).

Inductor's own default is /tmp/torchinductor_<user> (gone after a reboot). The project's is
$XDG_CACHE_HOME/lingbot/inductor, i.e. ~/.cache/lingbot/inductor; an explicit TORCHINDUCTOR_CACHE_DIR wins.
Inductor reads the variable from the environment and writes its default there the first time it looks,
which some imports (diffusers) trigger; so the package sets it when it is imported, before those imports.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

VARIABLE = "TORCHINDUCTOR_CACHE_DIR"


def project_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "lingbot" / "inductor"


def keep_compiled_kernels() -> Path:
    """Point inductor at the project cache unless the user chose a folder; returns the folder in use."""
    return Path(os.environ.setdefault(VARIABLE, str(project_cache_dir())))


# ---- whether a model's graphs are already in the cache -------------------------------------------------
# Inductor cannot be asked "would this model compile from cache?" without compiling it. The project writes
# a marker next to inductor's files after a build that finished, named by everything that changes the
# graphs: torch's version, the CPU's capability, the model config, the dtype, the device and the source of
# the model code. A marker says "warm" (seconds to rebuild); no marker says "cold" (minutes).

MARKERS = "lingbot-built"
_MODEL_SOURCES = ("model", "blocks/rollout.py", "blocks/kv_cache.py")  # the code a compiled graph is traced from


def graphs_key(config, dtype, device) -> str:
    """A digest of what the compiled graphs of `config` at `dtype` on `device` depend on."""
    import torch  # here, not at the top: the package sets the allocator before torch first loads

    digest = hashlib.sha256()
    device = torch.device(device)
    capability = torch.backends.cpu.get_cpu_capability() if device.type == "cpu" else torch.version.cuda
    for part in (torch.__version__, capability, repr(config), str(dtype), device.type):
        digest.update(str(part).encode() + b"\0")
    package = Path(__file__).resolve().parents[1]  # lingbot_core/
    for name in _MODEL_SOURCES:
        path = package / name
        for source in sorted(path.glob("*.py")) if path.is_dir() else [path]:
            digest.update(source.name.encode() + b"\0" + source.read_bytes())
    return digest.hexdigest()[:24]


def graphs_cached(key: str) -> bool:
    return (keep_compiled_kernels() / MARKERS / key).exists()


def mark_graphs_cached(key: str) -> None:
    folder = keep_compiled_kernels() / MARKERS
    folder.mkdir(parents=True, exist_ok=True)
    (folder / key).touch()
