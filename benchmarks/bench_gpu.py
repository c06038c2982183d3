"""The full-size model on a GPU: block time and its split, first block, memory, KV and admission.

    python benchmarks/bench_gpu.py [--sizes 1.3b,14b] [--modes eager,compiled] [--blocks 30]
                                   [--deadline-s 420] [--json OUT.json]
    python benchmarks/bench_gpu.py --sizes tiny --device cpu --dtype fp32   # a dry run of the same code

Speed does not depend on the weights, so no checkpoint is needed: each size is built exactly as its
published config shapes it, with random bf16 weights drawn directly on the GPU (nothing is downloaded
and nothing passes through host memory):
- 14b: the LingBot-World v2 14B transformer (config.LINGBOT_WORLD_V2_14B: 40 layers, 40x128 heads, ffn
  13824), the Wan 2.1 VAE (config.WAN21_VAE) and a UMT5-XXL-size text encoder (24 layers, d_model 4096,
  64 heads, d_ff 10240, a 256,384-token embedding), at 480x832;
- 1.3b: the Wan-1.3B shape (dim 1536 = 12x128 heads, 30 layers, ffn 8960), the same VAE and text encoder.
  It is an estimate of the 1.3B student's shape: its own config is not published.

Each (size, mode) runs in its own process, in the order 1.3b eager, 14b eager, 14b compiled, 1.3b
compiled, so a failure or a timeout costs only its own row, and each row's memory figures are its own.
A run: build the parts on the device; ask the engine's memory planner (serving/memory.plan_memory, the
call Engine._setup makes) how many sessions it admits, at the engine's default memory fraction and at
0.9; encode the prompt; then one rollout from examples/forest.png holding W for --blocks blocks (fewer
if the run's time share is spent). Per block: wall time to frames on the host (torch.cuda.synchronize),
the split that step_block measures with CUDA events (condition, denoise = 4 forwards, commit, decode),
and the uint8 copy to the host the engine makes. The first block carries the compile in compiled mode.
Dynamo's graph count is read after block 0, after the block that first fills the context window, and
at the end: a rollout that slides its window must add no graph.

Eager runs also time the self-attention call alone at the full window's shape, with the validity mask
the fixed window passes (kv_cache.BlockKV) and without one: SDPA takes FlashAttention only without a mask.

Prints one line per block, a table, the published anchors beside it, and a summary line last.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

IMAGE = ROOT / "examples" / "forest.png"
PROMPT = "a forest path in spring, sunlight through the trees"
ORDER = (("1.3b", "eager"), ("14b", "eager"), ("14b", "compiled"), ("1.3b", "compiled"))
STAGES = ("condition", "denoise", "commit", "decode")
# Published figures for one H200, bf16, 480x832, 4 denoise steps (issue 14).
ANCHORS = (
    ("vLLM-Omni, 14B, eager", "2992 ms a block"),
    ("vLLM-Omni, 14B, torch.compile", "2464 ms a block (first block 6.0 s)"),
    ("upstream LingBot-World change, 14B, eager", "10 blocks in 27.4-27.6 s: about 2660 ms a block after the first"),
    ("SGLang, 14B, 4x H200", "about 670 ms a block"),
)
TARGETS_MS = {"14b": 2000.0, "1.3b": 750.0}  # compiled, one H200


# ---------------------------------------------------------------------------------------------
# The parts, built on the device


def size_config(size: str):
    """(ModelConfig, TextConfig of the UMT5 stand-in, its vocabulary size) of a size."""
    import dataclasses

    from lingbot_core.config import LINGBOT_WORLD_V2_14B, TextConfig, tiny_config

    umt5_xxl = TextConfig(embedded_d_model=4096, embedded_num_layers=24, embedded_num_heads=64, embedded_d_ff=10240)
    if size == "14b":
        return LINGBOT_WORLD_V2_14B, umt5_xxl, 256384
    if size == "1.3b":
        transformer = dataclasses.replace(LINGBOT_WORLD_V2_14B.transformer, num_attention_heads=12, ffn_dim=8960,
                                          num_layers=30)
        return dataclasses.replace(LINGBOT_WORLD_V2_14B, name="wan-1.3b-shape", transformer=transformer), umt5_xxl, 256384
    if size == "tiny":  # the dry run: the test model's shapes
        config = tiny_config()
        return config, config.text, 512
    raise SystemExit(f"unknown size {size!r}: 14b, 1.3b or tiny")


def build_pipeline(size: str, device: str, dtype: torch.dtype, compiled: bool):
    """A Pipeline of random weights built on `device`; compiled as load_pipeline compiles on CUDA."""
    from transformers import UMT5EncoderModel

    from lingbot_core.blocks.loading import LoadedParts
    from lingbot_core.model.text import TextEncoder, build_embedded_tokenizer, embedded_umt5_config, init_umt5_weights
    from lingbot_core.model.transformer import CausalLingBotWorldTransformer3DModel
    from lingbot_core.model.vae_stream import build_vae, compile_frame_decoder, decode_latent_frame
    from lingbot_core.blocks.pipeline import Pipeline

    config, text_config, vocab = size_config(size)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.device("meta"):
        transformer = CausalLingBotWorldTransformer3DModel(config.transformer)
        umt5 = UMT5EncoderModel(embedded_umt5_config(text_config, vocab))
    # The dtype is set while the tensors are still meta, so no float32 copy is ever allocated.
    transformer = transformer.to(dtype).to_empty(device=device)
    transformer.init_weights(generator)  # drawn on the device: the generator is the device's
    transformer.materialize_buffers(torch.device(device))
    transformer.eval().requires_grad_(False)
    umt5 = umt5.to(dtype).to_empty(device=device)
    umt5.tie_weights()
    init_umt5_weights(umt5, generator)
    umt5.eval().requires_grad_(False)
    text = TextEncoder(tokenizer=build_embedded_tokenizer(), model=umt5, max_length=config.text.max_length)
    vae = build_vae(config, dtype, device, seed=0)  # 127M parameters: its own init on the host is seconds
    parts = LoadedParts(config, transformer, vae, text)
    decode = decode_latent_frame
    if compiled:  # what load_pipeline does on CUDA: lazy torch.compile, the graphs build on the first blocks
        transformer.compile_blocks()
        decode = compile_frame_decoder()
    return Pipeline.from_parts(parts, decode)


# ---------------------------------------------------------------------------------------------
# One (size, mode) run, in its own process


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _nbytes(module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def time_attention(pipe, repeats: int = 20) -> dict[str, float | None]:
    """ms of one self-attention call at the full window's shape (a block's queries against sink + recent +
    own keys), with the all-true key mask a full fixed window passes and with none, under SDPA's default
    choice and under each fused backend alone (None: the backend refused the call)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from lingbot_core.blocks.kv_cache import context_slots
    from lingbot_core.model.attention import attend

    config, device = pipe.config, pipe.device
    t = config.transformer
    queries = t.num_frames_per_block * config.tokens_per_frame
    keys = context_slots(config) * config.tokens_per_frame + queries
    q = torch.randn(1, queries, t.num_attention_heads, t.attention_head_dim, device=device, dtype=pipe.dtype)
    k, v = (torch.randn(1, keys, t.num_attention_heads, t.attention_head_dim, device=device, dtype=pipe.dtype)
            for _ in range(2))
    masks = {"masked": torch.ones(1, keys, dtype=torch.bool, device=device), "unmasked": None}
    backends = {"default": None, "flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION}
    out: dict[str, float | None] = {}
    for backend_name, backend in backends.items():
        for mask_name, mask in masks.items():
            name = mask_name if backend is None else f"{backend_name} {mask_name}"
            try:
                with sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext():
                    attend(q, k, v, mask)
                    _sync(device)
                    times = []
                    for _ in range(repeats):
                        started = time.perf_counter()
                        attend(q, k, v, mask)
                        _sync(device)
                        times.append(1000.0 * (time.perf_counter() - started))
                out[name] = statistics.median(times)
            except RuntimeError:  # this backend does not take this call (a mask, a dtype, the device)
                out[name] = None
    return out


def run_one(args) -> dict:
    from lingbot_core.blocks.kv_cache import context_slots
    from lingbot_core.model.attention import context_frames
    from lingbot_core.boundary.requests import BlockControl
    from lingbot_core.serving.contract import EngineConfig
    from lingbot_core.serving.memory import plan_memory
    from lingbot_core.boundary.video import frames_to_uint8

    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    compiled = args.mode == "compiled"
    result: dict = dict(size=args.size, mode=args.mode, device=args.device, dtype=args.dtype,
                        gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                        torch=torch.__version__)
    started = time.perf_counter()
    pipe = build_pipeline(args.size, args.device, dtype, compiled)
    _sync(device)
    config = pipe.config
    result.update(build_s=time.perf_counter() - started, transformer_gib=_nbytes(pipe.transformer) / 2**30,
                  text_gib=_nbytes(pipe.text_encoder.model) / 2**30, vae_gib=_nbytes(pipe.vae) / 2**30,
                  transformer_params_b=sum(p.numel() for p in pipe.transformer.parameters()) / 1e9,
                  height=config.height, width=config.width, transformer_layers=config.transformer.num_layers)
    print(f"  built in {result['build_s']:.1f} s: transformer {result['transformer_params_b']:.2f} B parameters "
          f"({result['transformer_gib']:.1f} GiB), text encoder {result['text_gib']:.1f} GiB, VAE "
          f"{result['vae_gib']:.2f} GiB", flush=True)

    # Admission, as Engine._setup plans it: at the engine's default share of free memory for this device
    # (serving/memory.DEFAULT_MEMORY_FRACTION) and, beside it, at 0.5 (the default before this benchmark).
    defaults = EngineConfig()
    plans = {}
    for name, fraction in (("default", defaults.memory_fraction), ("0.5", 0.5)):
        try:
            plans[name] = plan_memory(pipe, budget_bytes=None, fraction=fraction, max_sessions=None,
                                      max_lead_blocks=defaults.max_lead_blocks, condition_cache_bytes=None)
            result[f"sessions_{name}"] = plans[name].capacity
        except ValueError as error:  # the budget holds no session: say so, keep measuring
            result[f"sessions_{name}"] = 0
            print(f"  memory plan at fraction {name}: {error}", flush=True)
    plan = plans.get("default") or plans.get("0.5")
    if plan is not None:
        footprint = plan.footprint
        weights = sum(result[k] for k in ("transformer_gib", "text_gib", "vae_gib"))
        result.update(page_mib=footprint.page_bytes / 2**20, kv_session_gib=footprint.kv_pages / 2**30,
                      session_gib=plan.session_bytes / 2**30, block_reserve_gib=plan.block_reserve / 2**30,
                      budget_gib_default=plan.budget / 2**30,
                      # What the plan charges for the one session this run serves, weights included.
                      planned_one_session_gib=weights + (plan.session_bytes + plan.block_reserve) / 2**30)
        print(f"  memory plan: a session holds {plan.session_bytes / 2**30:.2f} GiB between blocks "
              f"(KV window {footprint.kv_pages / 2**30:.2f} GiB, a page {footprint.page_bytes / 2**20:.1f} MiB), "
              f"the running block reserves {plan.block_reserve / 2**30:.2f} GiB; sessions admitted: "
              f"{result['sessions_default']} at the default fraction, {result['sessions_0.5']} at 0.5", flush=True)

    if device.type == "cuda":  # the peak from here on: weights, the engine's figures, one session's blocks
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    pipe.encode_prompt(PROMPT)
    _sync(device)
    result["prompt_ms"] = 1000.0 * (time.perf_counter() - started)

    if not compiled:
        result["attention_ms"] = time_attention(pipe)
        print("  self-attention at the full window, ms: " + ", ".join(
            f"{name} {'refused' if ms is None else f'{ms:.2f}'}" for name, ms in result["attention_ms"].items()),
            flush=True)

    frames_per_block = config.transformer.num_frames_per_block
    # The first block whose context fills every slot of the window (kv_cache.BlockKV drops its mask there).
    full_window_block = next(b for b in itertools.count()
                             if len(context_frames(b * frames_per_block, config.transformer)) == context_slots(config))
    controls = [BlockControl(actions=(frozenset("w"),) * frames_per_block)] * args.blocks
    rows, graphs_at = [], {}
    graphs_before = _graphs()
    rollout_started = last = time.perf_counter()
    rollout = pipe.rollout(IMAGE, PROMPT, 0, controls)
    for output in rollout:
        _sync(device)
        before_host = time.perf_counter()
        frames_to_uint8(output.frames)  # the engine's copy to the host
        now = time.perf_counter()
        row = dict(output.stage_ms, block=output.block_index, wall=1000.0 * (now - last),
                   to_host=1000.0 * (now - before_host))
        rows.append(row)
        if output.block_index in (0, full_window_block):
            graphs_at[output.block_index] = _graphs() - graphs_before
        print(f"  block {row['block']:3d} {row['wall']:9.0f} ms: condition {row['condition']:7.1f}, denoise "
              f"{row['denoise']:8.1f}, commit {row['commit']:7.1f}, decode {row['decode']:7.1f}, to host "
              f"{row['to_host']:5.1f}", flush=True)
        last = now
        _summarise(result, rows, graphs_at, graphs_before, full_window_block, device)
        args.out.write_text(json.dumps(result))  # a run killed at its time limit still reports these blocks
        if now - rollout_started > args.seconds and len(rows) >= min(args.blocks, full_window_block + 3):
            print(f"  stopped after {len(rows)} blocks: this run's {args.seconds:.0f} s are spent", flush=True)
            break
    rollout.close()
    result["complete"] = True
    return result


def _summarise(result: dict, rows: list[dict], graphs_at: dict, graphs_before: int, full_window_block: int,
               device: torch.device) -> None:
    """The run's figures from the blocks so far (block 0 apart: it carries warm-up and compile)."""
    steady = rows[1:] or rows
    full = [r for r in rows if r["block"] >= max(1, full_window_block)]
    # Past the condition encoder's fixed point a block encodes nothing (vae_stream.py): the long-run cost.
    settled = [r for r in full if r["condition"] < 1.0]
    result.update(
        blocks=len(rows), first_block_ms=rows[0]["wall"],
        median_ms=statistics.median(r["wall"] for r in steady),
        full_window_ms=statistics.median(r["wall"] for r in full) if full else None,
        settled_ms=statistics.median(r["wall"] for r in settled) if settled else None,
        settled_from=settled[0]["block"] if settled else None,
        max_ms=max(r["wall"] for r in steady),
        split_ms={s: statistics.median(r[s] for r in steady) for s in (*STAGES, "to_host")},
        full_window_block=full_window_block,
        graphs_after_block0=graphs_at.get(0), graphs_after_full_window=graphs_at.get(full_window_block),
        graphs_total=_graphs() - graphs_before,
        rows=rows)
    if device.type == "cuda":
        result["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        result["device_total_gib"] = torch.cuda.mem_get_info(device)[1] / 2**30
        if "planned_one_session_gib" in result:  # > 0: the block used memory the engine's plan does not reserve
            result["unplanned_gib"] = result["peak_gib"] - result["planned_one_session_gib"]


# ---------------------------------------------------------------------------------------------
# The parent: one process per row, the table, the summary


def _fmt(value, spec: str = ".0f") -> str:
    return "-" if value is None else format(value, spec)


def print_table(results: list[dict], failures: list[str]) -> None:
    gpu = next((r["gpu"] for r in results), "?")
    print(f"\n{gpu}, torch {next((r['torch'] for r in results), torch.__version__)}, "
          f"{next((r['dtype'] for r in results), '?')}, {next((r['height'] for r in results), '?')}x"
          f"{next((r['width'] for r in results), '?')}, 4 denoise steps + 1 commit forward a block")
    header = (f"{'size':>5} {'mode':>8} {'blocks':>6} {'ms/block':>8} {'full win':>8} {'settled':>7} {'max':>6} "
              f"{'first s':>7} {'cond':>5} "
              f"{'denoise':>7} {'commit':>6} {'decode':>6} {'host':>5} {'peak GiB':>8} {'unplanned':>9} {'KV/sess GiB':>11} "
              f"{'sessions':>9} {'graphs':>9}")
    print(header)
    for r in results:
        split = r.get("split_ms", {})
        graphs = (f"{r.get('graphs_after_block0')}/{r.get('graphs_total')}" if r["mode"] == "compiled" else "-")
        print(f"{r['size']:>5} {r['mode']:>8} {r.get('blocks', 0):6d} {_fmt(r.get('median_ms')):>8} "
              f"{_fmt(r.get('full_window_ms')):>8} {_fmt(r.get('settled_ms')):>7} {_fmt(r.get('max_ms')):>6} {_fmt(r.get('first_block_ms', 0) / 1000, '.1f'):>7} "
              f"{_fmt(split.get('condition')):>5} {_fmt(split.get('denoise')):>7} {_fmt(split.get('commit')):>6} "
              f"{_fmt(split.get('decode')):>6} {_fmt(split.get('to_host')):>5} {_fmt(r.get('peak_gib'), '.1f'):>8} "
              f"{_fmt(r.get('unplanned_gib'), '.1f'):>9} {_fmt(r.get('kv_session_gib'), '.2f'):>11} "
              f"{r.get('sessions_default', '-')!s:>4}/{r.get('sessions_0.5', '-')!s:<4} {graphs:>9}")
    print("  ms/block: median of blocks 1..N-1 (wall, frames on the host); full win: of the blocks whose context "
          "window is full (the unmasked attention); settled: of those past "
          "the condition encoder's fixed point (no encoding: a long session's cost); max: the slowest after block 0; "
          "first s: block 0 "
          "(the compile, in compiled mode); cond/denoise/commit/decode: median ms of each stage (CUDA events); "
          "host: the uint8 copy; peak: GPU memory allocated at most, weights included; unplanned: the peak less "
          "what the engine's memory plan charges for one session (weights + session + running block; over 0: "
          "memory no plan reserves); sessions: admitted at the engine's default memory fraction / at 0.5; "
          "graphs: dynamo graphs after block 0 / after the whole rollout")
    for r in results:
        if "attention_ms" in r:
            print(f"  {r['size']} self-attention at the full window, ms a call (a block makes "
                  f"{r['transformer_layers']} layers x 5 forwards of them): " + ", ".join(
                      f"{name} {'refused' if ms is None else f'{ms:.2f}'}" for name, ms in r["attention_ms"].items()))
    for line in failures:
        print(f"  FAILED: {line}")
    print("anchors (one H200, bf16, 480x832, 4 steps):")
    for name, figure in ANCHORS:
        print(f"  {name}: {figure}")
    verdicts = []
    for size, target in TARGETS_MS.items():
        row = next((r for r in results if r["size"] == size and r["mode"] == "compiled"), None)
        if row is None:
            verdicts.append(f"{size} compiled not measured")
        else:
            figure = row.get("settled_ms") or row.get("full_window_ms") or row["median_ms"]
            which = ("settled" if row.get("settled_ms") else "full window" if row.get("full_window_ms")
                     else "median")
            verdicts.append(f"{size} compiled {figure:.0f} ms a block ({which}; "
                            f"{'MEETS' if figure <= target else 'MISSES'} <= {target:.0f})")
    print(f"bench_gpu summary: {gpu}: " + "; ".join(verdicts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1.3b,14b", help="comma list: 14b, 1.3b, tiny (the dry run)")
    parser.add_argument("--modes", default="eager,compiled")
    parser.add_argument("--blocks", type=int, default=30)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--deadline-s", type=float, default=420.0,
                        help="all runs together; each gets its share and stops its rollout when spent")
    parser.add_argument("--json", type=Path, default=None, help="write every result (with per-block rows) here")
    parser.add_argument("--one", nargs=2, metavar=("SIZE", "MODE"), help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, default=1e9, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.one:
        args.size, args.mode = args.one
        args.out.write_text(json.dumps(run_one(args)))
        return

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this benchmark needs a GPU (a dry run: --sizes tiny --device cpu)")
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    runs = [(s, m) for s, m in ORDER if s in sizes and m in modes] + [
        (s, m) for s in sizes for m in modes if (s, m) not in ORDER]
    # Shares of the deadline: the 14B rows take the most (build, 30 blocks of seconds each, a compile).
    weights = {("1.3b", "eager"): 1.0, ("14b", "eager"): 2.0, ("14b", "compiled"): 3.0, ("1.3b", "compiled"): 1.5}
    began = time.perf_counter()
    results, failures = [], []
    for index, (size, mode) in enumerate(runs):
        left = args.deadline_s - (time.perf_counter() - began)
        share = left * weights.get((size, mode), 1.0) / sum(weights.get(r, 1.0) for r in runs[index:])
        if left < 30:
            failures.append(f"{size} {mode}: not run, the deadline is spent")
            continue
        print(f"\n== {size} {mode}: up to {share:.0f} s ({left:.0f} s left of --deadline-s)", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "result.json"
            # The rollout (block 0 carries the compile) stops 25 s before the share ends: the build and the
            # memory plan come before it.
            command = [sys.executable, __file__, "--one", size, mode, "--blocks", str(args.blocks),
                       "--device", args.device, "--dtype", args.dtype, "--seconds", str(max(0.5 * share, share - 25)),
                       "--out", str(out)]
            try:
                code = subprocess.run(command, timeout=max(share, 30)).returncode
            except subprocess.TimeoutExpired:
                code = "timeout"
            result = json.loads(out.read_text()) if out.exists() else {}
            if result.get("blocks"):  # a complete run, or the blocks a killed one finished
                results.append(result)
                if args.json is not None:
                    args.json.write_text(json.dumps(results, indent=1))
            if code != 0:
                failures.append(f"{size} {mode}: exit {code}" + (f" after {result['blocks']} blocks (reported)"
                                                                  if result.get("blocks") else ""))
    print_table(results, failures)


if __name__ == "__main__":
    main()
