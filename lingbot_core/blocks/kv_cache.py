"""Paged KV cache: one shared pool of pages, one page table per rollout, one view per forward.

Storage follows [sink][recent window] while RoPE positions stay absolute (K is rotated before it is
stored), so a rollout never runs out of positions: pages whose frames leave the window go back to
the pool as soon as the block that made them obsolete commits.

A block's context is gathered once, when its `BlockKV` is made, into a fixed window of
sink_size + recent_frames frame slots for every layer, with a validity mask over the slots no frame
fills yet (the first blocks). Every forward of the block (four denoise steps, the still-camera forward of
a step with action guidance, and the commit) reads that one buffer, and its shape never changes over a
rollout, so a compiled forward has two graphs: masked while the window fills, unmasked once it is full.

The transformer sees a `BlockKV` through `context(layer)` and `context_valid` (the window and its mask)
and `store(layer, k, v)`, which writes this block's K/V into pages reserved for it. Those pages join the
page table only on `SessionKV.after_commit`; until then a failure just frees them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lingbot_core.config import ModelConfig
from lingbot_core.model.attention import context_frames


class KVPagePool:
    """The K and V tensors of every page: [layers, pages, tokens_per_frame, heads, head_dim] each."""

    def __init__(self, config: ModelConfig, num_pages: int, dtype: torch.dtype, device: torch.device | str) -> None:
        """Tensors only: which pages are in use is the bookkeeping (pages.PageAllocator) of whoever owns the
        pool, the engine for its shared one, a rollout for its private one; it is passed beside the pool."""
        t = config.transformer
        shape = (t.num_layers, num_pages, config.tokens_per_frame, t.num_attention_heads, t.attention_head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

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
        return BlockKV.gather(pool, config, [self.frame_pages[f] for f in frames], write_pages)

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
    """One block's cache: its context window, gathered once and read by every forward, and where the commit writes.

    k, v: [layers, 1, context_slots * tokens, H, D] (context_slots = sink_size + recent_frames). Slot i holds
    the block's i-th context frame (sink first, then recent); the slots past its context are zeros, and
    `context_valid` (bool [context_slots * tokens]) is False on their tokens so attention gives them no weight.
    Once the context fills every slot, `context_valid` is None: every token counts.
    """

    def __init__(self, pool: KVPagePool, k: torch.Tensor, v: torch.Tensor, context_valid: torch.Tensor | None,
                 write_pages: list[int] | None) -> None:
        self.pool, self.k, self.v, self.context_valid = pool, k, v, context_valid
        self.writes = write_pages is not None
        self._write_ids = (torch.tensor(write_pages, dtype=torch.long, device=pool.k.device)
                           if write_pages is not None else None)

    @classmethod
    def gather(cls, pool: KVPagePool, config: ModelConfig, context_pages: list[int],
               write_pages: list[int] | None = None) -> "BlockKV":
        """Copy the pages of the block's context frames (in order) into a fresh fixed window."""
        slots = context_slots(config)
        if len(context_pages) > slots:
            raise ValueError(f"{len(context_pages)} context pages exceed the window of {slots} frames")
        layers, _, tokens, heads, head_dim = pool.k.shape
        k = pool.k.new_zeros((layers, slots, tokens, heads, head_dim))  # zeros: finite values under the mask
        v = pool.v.new_zeros((layers, slots, tokens, heads, head_dim))
        # Page by page into the window: `index_select` would first build a second window-sized tensor
        # (9 GiB each for K and V at the 14B size), memory no plan reserves.
        for slot, page in enumerate(context_pages):
            k[:, slot] = pool.k[:, page]
            v[:, slot] = pool.v[:, page]
        # A full window hides nothing, so it has no mask: attention then runs unmasked, where SDPA's fastest
        # CUDA kernels apply (on an H200 a masked call takes 1.5x as long: benchmarks/bench_gpu.py). That
        # makes two compiled graphs in all, masked while the window fills and unmasked after.
        full = len(context_pages) == slots
        valid = None if full else torch.arange(slots * tokens, device=pool.k.device) < len(context_pages) * tokens
        # [layers, slots, T, H, D] -> [layers, 1, slots*T, H, D]: layer l is the [1, Lctx, H, D] attention reads.
        return cls(pool, k.flatten(1, 2).unsqueeze(1), v.flatten(1, 2).unsqueeze(1), valid, write_pages)

    def writing(self, write_pages: list[int]) -> "BlockKV":
        """The same gathered context, writing this block's K/V into `write_pages` (the commit forward)."""
        return BlockKV(self.pool, self.k, self.v, self.context_valid, write_pages)

    def context(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer], self.v[layer]  # [1, context_slots * T, H, D] each, contiguous

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + (0 if self.context_valid is None else self.context_valid.nbytes)

    @staticmethod
    def window_nbytes(config: ModelConfig, dtype: torch.dtype) -> int:
        """Bytes of one gathered window at most (context_slots pages' worth, plus its mask while the window
        fills): working memory of the running block's transformer stages, freed before it decodes; one per
        thread that runs blocks."""
        mask = context_slots(config) * config.tokens_per_frame * torch.empty((), dtype=torch.bool).element_size()
        return context_slots(config) * KVPagePool.page_nbytes(config, dtype) + mask

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        assert self._write_ids is not None, "this view does not write"
        n, (_, tokens, heads, head_dim) = self._write_ids.numel(), self.pool.k.shape[1:]
        self.pool.k[layer].index_copy_(0, self._write_ids, k.reshape(n, tokens, heads, head_dim).to(self.pool.k.dtype))
        self.pool.v[layer].index_copy_(0, self._write_ids, v.reshape(n, tokens, heads, head_dim).to(self.pool.v.dtype))


def context_slots(config: ModelConfig) -> int:
    """Frames a block's context window holds at most: the sink plus the recent frames (14B: 9 + 6 = 15)."""
    return config.transformer.sink_size + config.transformer.recent_frames
