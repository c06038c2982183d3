"""Shared condition streams, one per start picture, so a picture's encoder warm-up is paid once per process.

Keyed by the decoded pixels the model sees (after the resize and crop, in the VAE's dtype), so the same
picture uploaded twice, under any file name or format, finds the same stream. Two kinds of reference keep
an entry alive: the sessions reading it (through their rollout state), and this cache, which keeps the
most recently used entries while their bytes stay within `max_bytes` and forgets the oldest beyond that.
An entry a session still reads stays reachable here (weakly) until the last such session lets go, so two
live sessions from one picture never encode it twice. `nbytes` counts every live entry once; the engine
adds it to what it accounts, and reserves `max_bytes` for it in its budget.
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from collections import OrderedDict

import torch

from lingbot_core.model.vae_stream import SharedCondition


def pixels_key(pixels: torch.Tensor) -> str:
    """sha256 of a picture's pixel values, shape and dtype."""
    digest = hashlib.sha256(f"{tuple(pixels.shape)} {pixels.dtype}".encode())
    digest.update(pixels.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class ConditionCache:
    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be at least 0, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self._kept: OrderedDict[str, SharedCondition] = OrderedDict()  # most recently used last
        self._live: weakref.WeakValueDictionary[str, SharedCondition] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()

    def stream_for(self, pixels: torch.Tensor) -> SharedCondition:
        """The shared stream of this picture ([1, 3, H, W] in [-1, 1]), new if no one holds one."""
        key = pixels_key(pixels)
        with self._lock:
            entry = self._live.get(key)
            if entry is None:
                entry = SharedCondition(pixels)
                self._live[key] = entry
            self._kept[key] = entry
            self._kept.move_to_end(key)
            self._trim_locked()
            return entry

    def trim(self) -> None:
        """Forget the least recently used entries while the kept ones exceed max_bytes (entries grow as they
        encode, so the engine calls this after each block)."""
        with self._lock:
            self._trim_locked()

    def _trim_locked(self) -> None:
        total = sum(entry.nbytes() for entry in self._kept.values())
        while self._kept and total > self.max_bytes:
            _, entry = self._kept.popitem(last=False)
            total -= entry.nbytes()

    def nbytes(self) -> int:
        """Bytes of every live entry, kept here or read by a session, each once."""
        with self._lock:
            return sum(entry.nbytes() for entry in list(self._live.values()))

    def __len__(self) -> int:
        with self._lock:
            return len(self._live)
