"""Page bookkeeping for a KV pool: ids, a free list and a usage gauge. No torch here: the pool's tensors are
lingbot_core/blocks/kv_cache.py's; the engine owns the allocator of its shared pool and admits by it.

A page holds one latent frame of K/V for every layer. Running out is a return value (None), not an
exception, so admission can answer "later"; freeing a page that is not in use is a bug and raises.
"""

from __future__ import annotations

from collections import deque


class PageError(RuntimeError):
    """A page was freed twice, or an id outside the pool was used."""


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"a page pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._in_use: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_in_use(self) -> int:
        return len(self._in_use)

    @property
    def usage(self) -> float:
        return self.num_in_use / self.num_pages

    def can_allocate(self, count: int) -> bool:
        return 0 <= count <= len(self._free)

    def allocate(self, count: int) -> list[int] | None:
        """`count` page ids, or None when the pool cannot supply them all (nothing is taken then)."""
        if count < 0:
            raise ValueError(f"cannot allocate {count} pages")
        if count > len(self._free):
            return None
        ids = [self._free.popleft() for _ in range(count)]
        self._in_use.update(ids)
        return ids

    def free(self, ids: list[int]) -> None:
        bad = [i for i in ids if i not in self._in_use]
        if bad or len(set(ids)) != len(ids):
            raise PageError(f"freeing pages that are not in use (double free?): {sorted(set(bad) or ids)}")
        for i in ids:
            self._in_use.remove(i)
            self._free.append(i)
