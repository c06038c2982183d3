"""The transformer's share of a block: the fixed context window (one gather, masked) against a gather per forward.

    python benchmarks/bench_context.py [--model embedded] [--blocks 12] [--dtype fp32] [--threads N]

A block runs four denoise forwards and a commit forward over the same context. kv_cache.BlockKV gathers
that context once into a fixed window of sink_size + recent_frames frames and masks the unused slots (one
shape for a whole rollout: one compiled graph). The design before it gathered exactly the block's context
frames in every forward (a shape per context length, no mask): `GatherPerForward` below reproduces it.
Both run on the same model, pool and inputs, block by block in turn (A then B, then B then A, --repeats
times, the fastest of each counts), so a busy host slows them alike. Prints, per block, the context length
and the ms of the five forwards both ways,
then medians over all blocks and over the blocks with a full window. Eager only; no VAE, no sampler.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from lingbot_core.blocks.kv_cache import BlockKV, KVPagePool, SessionKV, context_slots  # noqa: E402
from lingbot_core.blocks.pages import PageAllocator  # noqa: E402
from lingbot_core.model.attention import context_frames  # noqa: E402
from lingbot_core.blocks.pipeline import load_pipeline  # noqa: E402

DENOISE_STEPS = 4


class GatherPerForward:
    """The previous cache view: each forward's `context(layer)` gathers exactly the context frames, unmasked."""

    context_valid = None

    def __init__(self, pool: KVPagePool, context_pages: list[int], write_pages: list[int] | None) -> None:
        self.pool = pool
        self.ids = torch.tensor(context_pages, dtype=torch.long, device=pool.k.device)
        self.writes = write_pages is not None
        self.write_ids = torch.tensor(write_pages or [], dtype=torch.long, device=pool.k.device)

    def context(self, layer: int):
        if self.ids.numel() == 0:
            return None
        k = self.pool.k[layer].index_select(0, self.ids)
        v = self.pool.v[layer].index_select(0, self.ids)
        return k.flatten(0, 1).unsqueeze(0), v.flatten(0, 1).unsqueeze(0)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        shape = (self.write_ids.numel(), *self.pool.k.shape[2:])
        self.pool.k[layer].index_copy_(0, self.write_ids, k.reshape(shape).to(self.pool.k.dtype))
        self.pool.v[layer].index_copy_(0, self.write_ids, v.reshape(shape).to(self.pool.v.dtype))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each way per block; the fastest counts")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    pipe = load_pipeline(args.model, dtype=args.dtype, compile=False)
    config, t = pipe.config, pipe.config.transformer
    frames = t.num_frames_per_block
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, t.in_channels, frames, config.latent_height, config.latent_width, generator=gen)
    plucker = torch.randn(1, frames, t.camera_channels, config.height, config.width, generator=gen)
    hidden, plucker = hidden.to(pipe.dtype), plucker.to(pipe.dtype)
    text_kv = pipe.encode_prompt("a forest path in spring")
    pool = pipe.new_pool()
    page_ids = PageAllocator(pool.num_pages)
    table = SessionKV.empty()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.model} {pipe.precision.name}: "
          f"{config.tokens_per_frame} tokens a frame, context window {context_slots(config)} frames")
    print(f"{'block':>5} {'context':>7} {'fixed window ms':>15} {'gather per forward ms':>21}")
    rows = []

    def five_forwards(make_views, start: int, context_pages: list[int], pages: list[int]) -> float:
        """Four read-only forwards and the writing commit, each with its view from make_views."""
        started = time.perf_counter()
        for step, view in enumerate(make_views(start, context_pages, pages)):
            timestep = 1000.0 * (1 - step / DENOISE_STEPS) if step < DENOISE_STEPS else 0.0
            pipe.transformer(hidden, torch.full((1,), timestep), text_kv, plucker, start, cache=view)
        return 1000 * (time.perf_counter() - started)

    def fixed_window(start: int, context_pages: list[int], pages: list[int]) -> list:
        view = BlockKV.gather(pool, config, context_pages)  # the block's one gather, as step_block makes it
        return [view] * DENOISE_STEPS + [view.writing(pages)]

    def per_forward(start: int, context_pages: list[int], pages: list[int]) -> list:
        return [GatherPerForward(pool, context_pages, None)] * DENOISE_STEPS + [
            GatherPerForward(pool, context_pages, pages)]

    with torch.inference_mode():
        for block in range(args.blocks):
            start = block * frames
            context_pages = [table.frame_pages[f] for f in context_frames(start, t)]
            pages = page_ids.allocate(frames)
            timed = {"fixed": [], "per forward": []}
            for repeat in range(args.repeats):  # A B, B A, ...: the best of each, so noise rarely picks a side
                order = [("fixed", fixed_window), ("per forward", per_forward)]
                for name, make in order if repeat % 2 == 0 else order[::-1]:
                    timed[name].append(five_forwards(make, start, context_pages, pages))
            timed = {name: min(times) for name, times in timed.items()}
            rows.append((len(context_pages), timed["fixed"], timed["per forward"]))
            print(f"{block:5d} {len(context_pages):7d} {timed['fixed']:15.0f} {timed['per forward']:21.0f}")
            table, dropped = table.after_commit(config, start, pages)
            page_ids.free(dropped)

    full = context_slots(config)
    for title, chosen in (("all blocks", rows), ("full window", [r for r in rows if r[0] == full])):
        if chosen:
            a, b = statistics.median(r[1] for r in chosen), statistics.median(r[2] for r in chosen)
            print(f"median over {title} ({len(chosen)}): fixed window {a:.0f} ms, gather per forward {b:.0f} ms "
                  f"(fixed / per forward = {a / b:.2f})")


if __name__ == "__main__":
    main()
