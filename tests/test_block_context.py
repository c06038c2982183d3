"""A block's context is one fixed window gathered once: exact against the one-shot forward, one compiled graph.

The tiny fp64 model of conftest.WINDOW_CONFIG (sink 3, window 9: a block sees at most 6 context frames)
has context lengths 0, 3, 6, 6, ... frames, and frames leave the window from block 3 on.
"""

from __future__ import annotations

import copy
import dataclasses
import os

import pytest
import torch

from conftest import WINDOW_CONFIG
from lingbot_core.blocks.kv_cache import BlockKV, KVPagePool, SessionKV, context_slots
from lingbot_core.model.attention import block_causal_mask, context_frames
from lingbot_core.blocks.pages import PageAllocator
from lingbot_core.boundary.requests import BlockControl
from lingbot_core.blocks.rollout import release
from training.world import ReadKV, RecordKV, _CommitKV

pytestmark = pytest.mark.usefixtures("single_thread")

CFG = WINDOW_CONFIG.transformer
BLOCK = CFG.num_frames_per_block
TOKENS = WINDOW_CONFIG.tokens_per_frame
SLOTS = context_slots(WINDOW_CONFIG)
NUM_BLOCKS = 5
NOISY_T = 625.0


def _inputs(blocks: int, seed: int = 1):
    """Latents [1, in_channels, frames, h, w], Plücker maps [1, frames, 6, H, W], prompt states [1, 5, text_dim]."""
    gen = torch.Generator().manual_seed(seed)
    frames = blocks * BLOCK
    latents = torch.randn(1, CFG.in_channels, frames, WINDOW_CONFIG.latent_height, WINDOW_CONFIG.latent_width,
                          generator=gen, dtype=torch.float64)
    plucker = torch.randn(1, frames, CFG.camera_channels, WINDOW_CONFIG.height, WINDOW_CONFIG.width, generator=gen,
                          dtype=torch.float64)
    return latents, plucker, torch.randn(1, 5, CFG.text_dim, generator=gen, dtype=torch.float64)


def test_a_block_view_is_one_fixed_window_with_its_frames_first_and_the_rest_masked():
    pool = KVPagePool(WINDOW_CONFIG, CFG.sliding_window_num_frames, torch.float64, "cpu")
    page_ids = PageAllocator(pool.num_pages)
    for page in range(pool.num_pages):  # every page holds its own id + 1 (never zero)
        pool.k[:, page], pool.v[:, page] = page + 1.0, -(page + 1.0)
    table, shapes = SessionKV.empty(), set()
    for block in range(NUM_BLOCKS):
        start = block * BLOCK
        view = table.view(pool, WINDOW_CONFIG, start)
        frames = context_frames(start, CFG)
        shapes.add(view.context(0)[0].shape)
        if len(frames) == SLOTS:  # a full window hides nothing: no mask, so attention may run unmasked
            assert view.context_valid is None
        else:
            assert view.context_valid.tolist() == [s < len(frames) for s in range(SLOTS) for _ in range(TOKENS)]
        for layer in range(CFG.num_layers):
            k, v = (t[0].unflatten(0, (SLOTS, TOKENS)) for t in view.context(layer))  # [slots, T, H, D]
            for slot, frame in enumerate(frames):
                assert torch.equal(k[slot], pool.k[layer, table.frame_pages[frame]])
                assert torch.equal(v[slot], pool.v[layer, table.frame_pages[frame]])
            assert not k[len(frames):].any() and not v[len(frames):].any()  # padding is zeros
        assert not view.writes
        mask_bytes = 0 if view.context_valid is None else SLOTS * TOKENS  # bool
        assert view.nbytes == view.k.nbytes + view.v.nbytes + mask_bytes
        assert view.nbytes <= BlockKV.window_nbytes(WINDOW_CONFIG, torch.float64)  # what a memory plan reserves
        assert (view.nbytes == BlockKV.window_nbytes(WINDOW_CONFIG, torch.float64)) == (mask_bytes > 0)
        pages = page_ids.allocate(BLOCK)
        writer = view.writing(pages)
        assert writer.writes and writer.k is view.k  # the commit reads the buffer the denoise steps read
        table, dropped = table.after_commit(WINDOW_CONFIG, start, pages)
        page_ids.free(dropped)
    assert shapes == {torch.Size([1, SLOTS * TOKENS, CFG.num_attention_heads, CFG.attention_head_dim])}
    with pytest.raises(RuntimeError, match="not in the page table"):
        SessionKV.empty().view(pool, WINDOW_CONFIG, BLOCK)


@torch.no_grad()
def test_fixed_window_forwards_equal_the_one_shot_masked_forward_from_the_empty_to_the_sliding_window(tiny_pipeline):
    """Each block's noisy read-only forward over the paged window == the masked forward over all frames so far
    (the last block noisy), the empty-context block 0 == a forward with no cache, and the commits agree."""
    model = tiny_pipeline.transformer
    latents, plucker, text = _inputs(NUM_BLOCKS)
    text_kv = model.prepare_text(text)
    pool = KVPagePool(WINDOW_CONFIG, CFG.sliding_window_num_frames, torch.float64, "cpu")
    page_ids = PageAllocator(pool.num_pages)
    table, record = SessionKV.empty(), RecordKV()
    noisy_x = torch.randn(latents.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    for block in range(NUM_BLOCKS):
        start, end = block * BLOCK, (block + 1) * BLOCK
        own = slice(start, end)
        view = table.view(pool, WINDOW_CONFIG, start)
        t_noisy = torch.full((1,), NOISY_T, dtype=torch.float64)
        got = model(noisy_x[:, :, own], t_noisy, text_kv, plucker[:, own], start, cache=view)

        # The one-shot oracle: frames 0..end, clean before this block and noisy in it, one masked forward.
        x = torch.cat([latents[:, :, :start], noisy_x[:, :, own]], 2)
        t = torch.zeros(1, end, dtype=torch.float64)
        t[:, start:] = NOISY_T
        full = model(x, t, text_kv, plucker[:, :end], 0, attn_mask=block_causal_mask(end, TOKENS, CFG))
        assert (got - full[:, :, own]).abs().max().item() <= 1e-10, f"block {block}"
        # The training stand-in reads exactly the context frames (variable length, no mask): the same result.
        exact = model(noisy_x[:, :, own], t_noisy, text_kv, plucker[:, own], start,
                      cache=ReadKV(record, context_frames(start, CFG), TOKENS))
        assert (got - exact).abs().max().item() <= 1e-10, f"block {block}"
        if block == 0:  # every slot is padding: the forward is the context-free one
            assert not view.context_valid.any()
            alone = model(noisy_x[:, :, own], t_noisy, text_kv, plucker[:, own], 0)
            assert (got - alone).abs().max().item() <= 1e-12

        pages = page_ids.allocate(BLOCK)
        clean = model(latents[:, :, own], torch.zeros(1, dtype=torch.float64), text_kv, plucker[:, own], start,
                      cache=view.writing(pages))
        commit = _CommitKV(record, context_frames(start, CFG), TOKENS)
        model(latents[:, :, own], torch.zeros(1, dtype=torch.float64), text_kv, plucker[:, own], start, cache=commit)
        record.append(commit)
        clean_full = model(latents[:, :, :end], torch.zeros(1, dtype=torch.float64), text_kv, plucker[:, :end], 0,
                           attn_mask=block_causal_mask(end, TOKENS, CFG))
        assert (clean - clean_full[:, :, own]).abs().max().item() <= 1e-10, f"commit {block}"
        table, dropped = table.after_commit(WINDOW_CONFIG, start, pages)
        page_ids.free(dropped)
    assert min(table.frame_pages) == 0 and max(table.frame_pages) == NUM_BLOCKS * BLOCK - 1
    assert len(table.frame_pages) == SLOTS < NUM_BLOCKS * BLOCK  # the window slid: frames 3..8 left it


@torch.no_grad()
def test_a_compiled_forward_sees_two_graphs_across_a_rollout_that_fills_and_slides_the_window(
        tiny_pipeline, start_image):
    """Blocks compiled with a backend that counts the graphs dynamo hands it (no inductor: cheap), driven by
    the real block step: denoise and commit forwards at context lengths 0, 3, 6, 6, 6 frames, two graphs:
    the masked one while the window fills (lengths 0 and 3 share it) and the unmasked one once it is full."""
    graphs = []

    def counting_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    compiled = copy.deepcopy(tiny_pipeline.transformer)
    torch._dynamo.reset()
    compiled.compile_blocks(backend=counting_backend)
    pipes = {"eager": tiny_pipeline, "compiled": dataclasses.replace(tiny_pipeline, transformer=compiled)}
    outputs = {}
    try:
        for name, pipe in pipes.items():
            pool = pipe.new_pool()
            page_ids = PageAllocator(pool.num_pages)
            state = pipe.start(start_image, "a quiet street", 3)
            outputs[name] = []
            for block in range(NUM_BLOCKS):
                output, state = pipe.step(pool, page_ids, state, BlockControl(actions=(frozenset("w"),) * BLOCK))
                outputs[name].append(output.latents)
            assert len(state.kv.frame_pages) == SLOTS and min(state.kv.frame_pages) == 0  # filled, and slid
            release(page_ids, state)
        lengths = {len(context_frames(b * BLOCK, CFG)) for b in range(NUM_BLOCKS)}
        assert lengths == {0, 3, 6}
        assert len(graphs) == 2, f"{len(graphs)} graphs for context lengths {sorted(lengths)}"
        for got, want in zip(outputs["compiled"], outputs["eager"]):
            assert (got - want).abs().max().item() <= 1e-12

        # Sensitivity: a context of exactly the block's frames (the training stand-in's) is one graph per length.
        latents, plucker, text = _inputs(NUM_BLOCKS)
        text_kv = compiled.prepare_text(text)
        record = RecordKV()
        for block in range(NUM_BLOCKS):
            own = slice(block * BLOCK, (block + 1) * BLOCK)
            commit = _CommitKV(record, context_frames(block * BLOCK, CFG), TOKENS)
            compiled(latents[:, :, own], torch.zeros(1, dtype=torch.float64), text_kv, plucker[:, own],
                     block * BLOCK, cache=commit)
            record.append(commit)
        assert len(graphs) == 2 + len(lengths)
    finally:
        torch._dynamo.reset()


@pytest.mark.compile
@pytest.mark.skipif(os.environ.get("LINGBOT_TEST_COMPILE") != "1",
                    reason="a real inductor compile; set LINGBOT_TEST_COMPILE=1")
@torch.no_grad()
def test_inductor_builds_one_graph_for_the_masked_window_and_matches_eager(tiny_pipeline):
    """The real compiler on the fixed window: paged denoise and commit forwards from the empty to the sliding
    window, fp32, two graphs (masked while it fills, unmasked when full), the compiled outputs equal eager's
    to float32 rounding."""
    from torch._dynamo.utils import counters

    eager = copy.deepcopy(tiny_pipeline.transformer).float()
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    graphs_before = counters["stats"]["unique_graphs"]
    compiled.compile_blocks()
    latents, plucker, text = (t.float() for t in _inputs(NUM_BLOCKS))
    text_kv = eager.prepare_text(text)
    pools = {name: KVPagePool(WINDOW_CONFIG, CFG.sliding_window_num_frames, torch.float32, "cpu")
             for name in ("eager", "compiled")}
    tables = {name: SessionKV.empty() for name in pools}
    page_sets = {name: PageAllocator(pool.num_pages) for name, pool in pools.items()}
    try:
        for block in range(NUM_BLOCKS):
            start, own = block * BLOCK, slice(block * BLOCK, (block + 1) * BLOCK)
            outs = {}
            for name, model in (("eager", eager), ("compiled", compiled)):
                pool, view = pools[name], tables[name].view(pools[name], WINDOW_CONFIG, start)
                noisy = model(latents[:, :, own], torch.full((1,), NOISY_T), text_kv, plucker[:, own], start,
                              cache=view)
                pages = page_sets[name].allocate(BLOCK)
                clean = model(latents[:, :, own], torch.zeros(1), text_kv, plucker[:, own], start,
                              cache=view.writing(pages))
                tables[name], dropped = tables[name].after_commit(WINDOW_CONFIG, start, pages)
                page_sets[name].free(dropped)
                outs[name] = (noisy, clean)
            for got, want in zip(outs["compiled"], outs["eager"]):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert counters["stats"]["unique_graphs"] - graphs_before == 2
    finally:
        torch._dynamo.reset()
