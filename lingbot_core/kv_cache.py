"""Paged KV cache: one shared pool of pages, one page table per rollout, one view per forward.

Storage follows [sink][recent window] while RoPE positions stay absolute (K is rotated before it is
stored), so a rollout never runs out of positions: pages whose frames leave the window go back to
the pool as soon as the block that made them obsolete commits.

The transformer sees a `BlockKV` through two verbs: `context(layer)` gathers the frames this block
attends to, and `store(layer, k, v)` writes this block's K/V into pages reserved for it. Those pages
join the page table only on `SessionKV.commit`; until then a failure just frees them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import ModelConfig
from .model.attention import context_frames
from .serving.pages import PageAllocator


class KVPagePool:
    """The K and V tensors of every page: [layers, pages, tokens_per_frame, heads, head_dim] each."""

    def __init__(self, config: ModelConfig, num_pages: int, dtype: torch.dtype, device: torch.device | str) -> None:
        t = config.transformer
        shape = (t.num_layers, num_pages, config.tokens_per_frame, t.num_attention_heads, t.attention_head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.allocator = PageAllocator(num_pages)

    @staticmethod
    def page_nbytes(config: ModelConfig, dtype: torch.dtype) -> int:
        t = config.transformer
        per_layer = config.tokens_per_frame * t.num_attention_heads * t.attention_head_dim
        return 2 * t.num_layers * per_layer * torch.empty((), dtype=dtype).element_size()

    @staticmethod
    def pages_per_rollout(config: ModelConfig) -> int:
        """Peak pages one rollout holds: its whole window, including the block being written."""
        return config.transformer.sliding_window_num_frames

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


@dataclass
class SessionKV:
    """A rollout's page table: absolute latent frame index -> page id (sink frames + the recent ring)."""

    frame_pages: dict[int, int]

    @classmethod
    def empty(cls) -> "SessionKV":
        return cls(frame_pages={})

    def view(self, pool: KVPagePool, config: ModelConfig, start_frame: int,
             write_pages: list[int] | None = None) -> "BlockKV":
        frames = context_frames(start_frame, config.transformer)
        missing = [f for f in frames if f not in self.frame_pages]
        if missing:
            raise RuntimeError(f"KV pages for frames {missing} are not in the page table")
        ids = torch.tensor([self.frame_pages[f] for f in frames], dtype=torch.long, device=pool.k.device)
        return BlockKV(pool, ids, write_pages)

    def after_commit(self, config: ModelConfig, start_frame: int, new_pages: list[int]) -> tuple["SessionKV", list[int]]:
        """The page table once the block at start_frame committed, and the pages that left the window."""
        table = dict(self.frame_pages)
        for offset, page in enumerate(new_pages):
            table[start_frame + offset] = page
        keep = set(context_frames(start_frame + len(new_pages), config.transformer))
        dropped = [table.pop(f) for f in sorted(table) if f not in keep]
        return SessionKV(frame_pages=table), dropped

    def pages(self) -> list[int]:
        return list(self.frame_pages.values())


class BlockKV:
    """What one forward reads (context pages) and, for the commit forward, where it writes."""

    def __init__(self, pool: KVPagePool, context_ids: torch.Tensor, write_pages: list[int] | None) -> None:
        self.pool = pool
        self.context_ids = context_ids
        self.writes = write_pages is not None
        self._write_ids = (torch.tensor(write_pages, dtype=torch.long, device=pool.k.device)
                           if write_pages is not None else None)

    def context(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.context_ids.numel() == 0:
            return None
        k = self.pool.k[layer].index_select(0, self.context_ids)  # [n, T, H, D], a fresh contiguous tensor
        v = self.pool.v[layer].index_select(0, self.context_ids)
        return k.flatten(0, 1).unsqueeze(0), v.flatten(0, 1).unsqueeze(0)  # [1, n*T, H, D]

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        assert self._write_ids is not None, "this view does not write"
        n, (_, tokens, heads, head_dim) = self._write_ids.numel(), self.pool.k.shape[1:]
        self.pool.k[layer].index_copy_(0, self._write_ids, k.reshape(n, tokens, heads, head_dim).to(self.pool.k.dtype))
        self.pool.v[layer].index_copy_(0, self._write_ids, v.reshape(n, tokens, heads, head_dim).to(self.pool.v.dtype))
