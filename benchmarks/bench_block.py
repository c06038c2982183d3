"""What a new user gets by default on this machine: precision, start-up, first frame, the per-block cost.

    python benchmarks/bench_block.py [--blocks 13] [--compare-blocks 3] [--precisions auto,fp32,bf16]
                                     [--app] [--compile] [--compile-background] [--threads N] [--model embedded]
                                     [--preset embedded]

Prints, in one run:
1. the CPU (PyTorch's capability and its native-bf16 flags), the allocator setting and the precision that
   `--dtype auto` chooses here, with its reason;
2. the default (auto) against each explicit precision on the same blocks (median ms a block over blocks
   0..compare-blocks-1, condition warm-up included) and whether the default is within 10% of the fastest;
3. blocks 0..blocks-1 of the default, one line each: wall ms, the stage split (condition; denoise: the
   sampler's 4 forwards and one more for each step with action guidance; commit; decode), the process's
   system CPU ms and minor page faults in that block, for a first session from examples/forest.png and
   then a second session from the same picture (the condition stream shared);
4. with --app: `python app.py` started as a user starts it: seconds to its "ready at" line, to a page that
   answers, and from pressing Start (gradio_client /start) to the first video segment;
5. with --compile: the default precision eager against torch.compile (transformer blocks and decoder step):
   median ms a block after warm-up, the seconds to build the graphs before block 0 (cold on a first run
   with an empty inductor cache, warm on the next) and how many graphs dynamo compiled then and later
   (later = recompiles the warm-up rollout missed; it should be 0);
6. with --compile-background: the default (compile=None) block by block, eager or compiled.
Sections 1-4 run eager (compile=False), so the precision figures do not include a background compile.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from lingbot_core.process.allocator import keep_freed_memory  # noqa: E402
from lingbot_core.blocks.condition_cache import ConditionCache  # noqa: E402
from lingbot_core.config import PRESETS  # noqa: E402
from lingbot_core.blocks.pipeline import load_pipeline  # noqa: E402
from lingbot_core.process.precision import AUTO, detect_cpu  # noqa: E402
from lingbot_core.boundary.requests import BlockControl  # noqa: E402

IMAGE = ROOT / "examples" / "forest.png"
PROMPT = "a forest path in spring"
STAGES = ("condition", "denoise", "commit", "decode")


def _preset_hint(args) -> dict:
    """--preset NAME: a folder (a training export, say) plays at that preset's size, camera and sampler, as
    eval_world.py loads folders; without it a folder gets the loader's default size (480x832)."""
    return {"preset_hint": PRESETS[args.preset]} if args.preset else {}


def _usage() -> tuple[float, int]:
    """(system CPU seconds, minor page faults) of this process so far, all threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_stime, usage.ru_minflt


def run_blocks(pipe, blocks: int, conditions: ConditionCache | None = None) -> list[dict[str, float]]:
    """One rollout from the example picture holding W; a row per block with wall, stages, system CPU, faults."""
    frames_per_block = pipe.config.transformer.num_frames_per_block
    controls = [BlockControl(actions=(frozenset("w"),) * frames_per_block)] * blocks
    rows = []
    started, (sys_s, faults) = time.perf_counter(), _usage()
    for output in pipe.rollout(IMAGE, PROMPT, 0, controls, conditions=conditions):
        now, (sys_now, faults_now) = time.perf_counter(), _usage()
        rows.append(dict(output.stage_ms, block=output.block_index, wall=1000 * (now - started),
                         sys=1000 * (sys_now - sys_s), faults=faults_now - faults))
        started, sys_s, faults = now, sys_now, faults_now
    return rows


def print_rows(title: str, rows: list[dict[str, float]], denoise_forwards: int) -> None:
    print(f"\n{title}")
    denoise = f"denoise x{denoise_forwards}"
    print(f"{'block':>5} {'wall ms':>8} {'condition':>9} {denoise:>10} {'commit':>7} {'decode':>7} "
          f"{'sys ms':>7} {'faults':>7}")
    for r in rows:
        print(f"{r['block']:5d} {r['wall']:8.0f} {r['condition']:9.0f} {r['denoise']:10.0f} {r['commit']:7.0f} "
              f"{r['decode']:7.0f} {r['sys']:7.0f} {r['faults']:7d}")


def compare_precisions(args) -> None:
    """Each precision loaded once; their rollouts advance in turn, one block each, so a busy host slows them
    alike. Block 0 of each is a warm-up (first use of each kernel shape); the median is over the rest. A
    precision more than 3x slower than the fastest on a block stops there (bf16 emulated on an AVX2 CPU
    takes minutes a block; more of them would not change the verdict)."""
    blocks = max(2, args.compare_blocks)
    print(f"\n2. default against each precision, blocks taken in turn: median of blocks 1-{blocks - 1} "
          "(block 0 warms up; the condition warm-up runs in all of them)")
    pipes = {name: load_pipeline(args.model, **_preset_hint(args), dtype=name, compile=False)
             for name in args.precisions}
    frames_per_block = next(iter(pipes.values())).config.transformer.num_frames_per_block
    controls = [BlockControl(actions=(frozenset("w"),) * frames_per_block)] * blocks
    rollouts = {name: iter(pipe.rollout(IMAGE, PROMPT, 0, controls)) for name, pipe in pipes.items()}
    rows: dict[str, list] = {name: [] for name in pipes}
    running = list(pipes)
    for block in range(blocks):
        for name in running:
            started, (sys_s, faults) = time.perf_counter(), _usage()
            output = next(rollouts[name])
            sys_now, faults_now = _usage()
            if block > 0:
                rows[name].append(dict(output.stage_ms, wall=1000 * (time.perf_counter() - started),
                                       sys=1000 * (sys_now - sys_s), faults=faults_now - faults))
        if block > 0:  # a precision 3x slower than the fastest on this block is decided: it stops here
            fastest = min(rows[name][-1]["wall"] for name in running)
            running = [name for name in running if rows[name][-1]["wall"] <= 3 * fastest]
    medians = {}
    for name, pipe in pipes.items():
        medians[name] = statistics.median(r["wall"] for r in rows[name])
        split = ", ".join(f"{s} {statistics.median(r[s] for r in rows[name]):.0f}" for s in STAGES)
        print(f"  {name:>4} -> {pipe.precision.name}: {medians[name]:8.0f} ms a block over {len(rows[name])} ({split}); "
              f"sys {statistics.median(r['sys'] for r in rows[name]):.0f} ms, "
              f"{statistics.median(r['faults'] for r in rows[name]):.0f} faults a block")
    for rollout in rollouts.values():
        rollout.close()  # returns each rollout's pages
    if AUTO in medians and len(medians) > 1:
        fastest = min(medians, key=medians.get)
        ratio = medians[AUTO] / medians[fastest]
        print(f"  default / fastest ({fastest}) = {ratio:.2f}: {'within' if ratio <= 1.10 else 'NOT within'} 10%")
        chosen = pipes[AUTO].precision.name
        explicit = {name: medians[name] for name in medians if name != AUTO}
        best = min(explicit, key=explicit.get)
        if chosen == best:
            same = abs(medians[AUTO] - explicit[best]) / explicit[best]
            print(f"  the default runs {chosen}, the fastest explicit precision: identical runs, so their "
                  f"{100 * same:.0f}% difference is this host's noise")
        else:
            print(f"  the default runs {chosen} but {best} was faster here")


def app_startup(args) -> None:
    """Start app.py as a user does; time its stages, a page that answers, and Start -> first segment."""
    from gradio_client import Client, handle_file

    port = 7800 + os.getpid() % 100
    env = dict(os.environ, GRADIO_ANALYTICS_ENABLED="False")
    print(f"\n4. python app.py --port {port}")
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, str(ROOT / "app.py"), "--port", str(port)], cwd=ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = None
        for line in process.stdout:
            print(f"  | {line.rstrip()}")
            if "ready at" in line:
                url = line.split("ready at ")[1].split()[0]
                break
        ready_s = time.perf_counter() - started
        if url is None:
            raise SystemExit("the app exited before it was ready")
        urllib.request.urlopen(url, timeout=30).read()
        page_s = time.perf_counter() - started
        client = Client(url, verbose=False, download_files=False)
        pressed = time.perf_counter()
        job = client.submit(handle_file(str(IMAGE)), PROMPT, 0, api_name="/start")
        first = None
        for video, telemetry, _ in job:
            if telemetry.startswith("block "):  # the update that carries block 0's video segment
                first = time.perf_counter() - pressed
                print(f"  first block: {telemetry}")
                break
        job.cancel()
        print(f"  start-up to 'ready at': {ready_s:.1f} s; page answered at {page_s:.1f} s; "
              f"Start -> first video segment: {first:.1f} s")
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _graphs() -> int:
    """Graphs dynamo has compiled in this process so far (each recompile adds one)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def compare_compile(args) -> None:
    """Eager, then compiled (--compile: graphs built before block 0 on a warm-up rollout; the inductor cache
    is cold on a first run, warm on a second, as printed), then the default (compile=None)."""
    from lingbot_core.process.compile_cache import graphs_cached, graphs_key, keep_compiled_kernels

    print(f"\n5. {AUTO} eager against torch.compile (median of blocks {args.warmup}-"
          f"{args.warmup + args.compile_blocks - 1}, after {args.warmup} warm-up blocks); "
          f"inductor cache {keep_compiled_kernels()}")
    medians = {}
    for compile in (False, True):
        started = time.perf_counter()
        pipe = load_pipeline(args.model, **_preset_hint(args), dtype=AUTO, compile=compile)
        loaded = time.perf_counter() - started
        built = _graphs()
        rows = run_blocks(pipe, args.warmup + args.compile_blocks)
        steady = rows[args.warmup:]
        medians[compile] = statistics.median(r["wall"] for r in steady)
        split = ", ".join(f"{s} {statistics.median(r[s] for r in steady):.0f}" for s in STAGES)
        name = "compiled" if compile else "eager"
        print(f"  {name:8}: {medians[compile]:7.0f} ms a block ({split}); load {loaded:.1f} s"
              + (f" of which graph build {pipe.compile_switch.build_s:.1f} s ({built} graphs, "
                 f"{_graphs() - built} more during {len(rows)} blocks)" if compile else ""))
        del pipe
    print(f"  compiled / eager = {medians[True] / medians[False]:.2f}")


def default_background(args) -> None:
    """The default (compile=None) on this process: with a cold cache the first blocks run eager while the
    graphs build on a second thread; one line a block says which path ran it."""
    started = time.perf_counter()
    pipe = load_pipeline(args.model, **_preset_hint(args), dtype=AUTO)
    print(f"\n6. the default: {pipe.compile_mode} (load {time.perf_counter() - started:.1f} s)")
    switch = pipe.compile_switch
    frames_per_block = pipe.config.transformer.num_frames_per_block
    controls = [BlockControl(actions=(frozenset("w"),) * frames_per_block)] * args.background_blocks
    began = time.perf_counter()
    for output in pipe.rollout(IMAGE, PROMPT, 0, controls):
        path = "compiled" if switch is not None and switch.compiled else "eager"
        print(f"  block {output.block_index:2d} {path:8} {sum(output.stage_ms.values()):7.0f} ms, "
              f"at {time.perf_counter() - began:6.1f} s")
    if switch is not None:
        print(f"  graph build {switch.build_s or float('nan'):.1f} s; first compiled block: "
              f"{switch.switched_before_block}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="with a folder --model: play it at this preset's size, camera and sampler "
                             "(--preset embedded times a retrained embedded model at 96x160)")
    parser.add_argument("--blocks", type=int, default=13, help="blocks of the default shown one by one")
    parser.add_argument("--compare-blocks", type=int, default=3, help="blocks per precision (the first warms up)")
    parser.add_argument("--precisions", default="auto,fp32,bf16",
                        type=lambda text: [name.strip() for name in text.split(",") if name.strip()])
    parser.add_argument("--app", action="store_true", help="also time python app.py start-up and first frame")
    parser.add_argument("--compile", action="store_true", help="also compare eager with torch.compile")
    parser.add_argument("--warmup", type=int, default=13, help="--compile: blocks before the median")
    parser.add_argument("--compile-blocks", type=int, default=6, help="--compile: blocks in the median")
    parser.add_argument("--compile-background", action="store_true",
                        help="the default's rollout, eager until a background build switches it (run it with "
                             "a cold inductor cache, e.g. TORCHINDUCTOR_CACHE_DIR=/tmp/empty, to see the switch)")
    parser.add_argument("--background-blocks", type=int, default=30, help="--compile-background: blocks")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    cpu = detect_cpu()
    print(f"1. torch {torch.__version__}, {torch.get_num_threads()} threads, CPU capability {cpu.capability}, "
          f"native bf16 flags: {', '.join(cpu.bf16_flags) or 'none'}; {keep_freed_memory()}")
    started = time.perf_counter()
    pipe = load_pipeline(args.model, **_preset_hint(args), dtype=AUTO, compile=False)
    print(f"   {args.model}: --dtype auto chose {pipe.precision.describe()} (load {time.perf_counter() - started:.1f} s)")

    if args.precisions:
        compare_precisions(args)

    if args.blocks:
        conditions = ConditionCache(max_bytes=1 << 30)
        print(f"\n3. the default ({pipe.precision.name}), blocks 0-{args.blocks - 1} one by one")
        sampler = pipe.config.sampler  # four steps, and a still-camera forward on each guided one
        forwards = len(sampler.timesteps) + sampler.guided_steps
        print_rows("first session from examples/forest.png (pays the condition warm-up)",
                   run_blocks(pipe, args.blocks, conditions), forwards)
        print_rows("second session from the same picture (condition stream shared)",
                   run_blocks(pipe, args.blocks, conditions), forwards)
    del pipe

    if args.app:
        app_startup(args)
    if args.compile:
        compare_compile(args)
    if args.compile_background:
        default_background(args)


if __name__ == "__main__":
    main()
