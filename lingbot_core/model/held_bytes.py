"""The one way the project counts the bytes a piece of state holds (accounted == held rests on it).

It lives beside the model and the serving wings rather than in either: the VAE streams count their caches
with it, and the engine's memory plan counts sessions and probes with it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def held_bytes(value: Any, seen: set[int] | None = None) -> int:
    """Bytes of the tensor storages and NumPy buffers reachable from `value` (containers, dataclasses,
    objects); each buffer once."""
    seen = set() if seen is None else seen
    total = 0
    stack = [value]
    visited: set[int] = set()
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        elif isinstance(item, np.ndarray):  # e.g. a block's uint8 pixels; may share memory with a tensor
            root = item
            while isinstance(root.base, np.ndarray):
                root = root.base
            pointer = root.__array_interface__["data"][0]
            if pointer not in seen:
                seen.add(pointer)
                total += root.nbytes
        elif isinstance(item, (str, bytes, int, float, bool, type(None), type, torch.nn.Module)):
            continue  # scalars hold no tensors; classes and modules (weights) are not session state
        elif id(item) in visited:
            continue
        else:
            visited.add(id(item))
            if isinstance(item, dict):
                stack.extend(item.values())
            elif isinstance(item, (list, tuple, set, frozenset)):
                stack.extend(item)
            elif hasattr(item, "__dict__"):
                stack.extend(vars(item).values())
    return total
