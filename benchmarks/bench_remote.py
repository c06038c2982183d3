"""Viewers served through protocol servers in other processes vs by the in-process engine (prints figures).

    python benchmarks/bench_remote.py [--viewers 1,2] [--servers 1,2] [--blocks 12] [--rounds 3]
                                      [--model embedded] [--dtype fp32] [--threads N]

Every viewer runs the same consumer loop over an engine-like backend (admit, then drain `next_message` until
--blocks blocks came), so the only difference between the two columns is the path a block takes:

- local:  Engine (lingbot_core/serving/engine.py) in this process, the model on its worker thread;
- remote: RemoteEngine (lingbot_core/protocols/sglang/backend.py) over K servers `python -m lingbot_core.serve`, each its
  own process with its own model, one seat per server (upstream's rule); a block travels as raw frame batches
  over a local WebSocket and is reassembled here.

Per case (medians over --rounds rounds that alternate the order of the backends) it prints the aggregate throughput (blocks per second from the first block any viewer received to the
last), the median interval between a viewer's consecutive blocks after --skip warm-up blocks (the per-block
time a viewer sees), the median block time the model itself reported (Block.block_ms: the engine's, or the
server's scheduler_forward_ms), and for remote the overhead against local with the same viewers. Servers do not
pace their output here (realtime_output_pacing off), so both columns run as fast as the model allows.

With K servers on one machine the servers share its cores: the seats scale with K, the compute does not. On
this project's 2-core CPU the "seats" row is what scales; on GPUs each server has its own.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lingbot_core.blocks.pipeline import load_pipeline  # noqa: E402
from lingbot_core.protocols.sglang.backend import RemoteConfig, RemoteEngine  # noqa: E402
from lingbot_core.protocols.sglang.client import list_models  # noqa: E402
from lingbot_core.protocols.sglang.model_config import remote_model_config  # noqa: E402
from lingbot_core.boundary.requests import parse_start  # noqa: E402
from lingbot_core.serving.contract import Admission, Block, Closed, EngineConfig
from lingbot_core.serving.engine import Engine, Failed  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
IMAGE = ROOT / "examples" / "forest.png"
PROMPT = "A walk through a quiet countryside."
READY = re.compile(r"ready at (ws://\S+?)/v1/realtime_video/generate")


@dataclass
class ViewerRun:
    arrivals: list[float] = field(default_factory=list)  # when each block reached the viewer (monotonic)
    block_ms: list[float] = field(default_factory=list)
    waited_in_line: bool = False
    error: str | None = None


def run_viewer(engine, request, blocks: int, out: ViewerRun, timeout_s: float) -> None:
    """Admit, then take blocks until `blocks` arrived; the same loop for both backends."""
    try:
        ticket = engine.admit(request)
        out.waited_in_line = ticket.admission is Admission.WAITING
        deadline = time.monotonic() + timeout_s
        while len(out.arrivals) < blocks:
            if time.monotonic() > deadline:
                out.error = f"timed out after {len(out.arrivals)} blocks"
                break
            message = engine.next_message(ticket.session_id, 1.0)
            if isinstance(message, Block):
                out.arrivals.append(time.monotonic())
                out.block_ms.append(message.block_ms)
            elif isinstance(message, (Closed, Failed)):
                out.error = f"{type(message).__name__}: {getattr(message, 'reason', None) or message.text}"
                if isinstance(message, Closed):
                    break
        engine.close(ticket.session_id, "benchmark done")
    except Exception as exc:  # reported in the table, not raised: the other viewers go on
        out.error = f"{type(exc).__name__}: {exc}"


def run_case(engine, request, viewers: int, blocks: int, timeout_s: float) -> list[ViewerRun]:
    runs = [ViewerRun() for _ in range(viewers)]
    threads = [threading.Thread(target=run_viewer, args=(engine, request, blocks, run, timeout_s))
               for run in runs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return runs


def summarise(runs: list[ViewerRun], skip: int) -> dict:
    arrivals = [t for run in runs for t in run.arrivals]
    intervals = [b - a for run in runs for a, b in zip(run.arrivals[skip:], run.arrivals[skip + 1:])]
    made = [ms for run in runs for ms in run.block_ms[skip:]]
    span = max(arrivals) - min(arrivals) if len(arrivals) > 1 else float("nan")
    return {"blocks": len(arrivals), "throughput": (len(arrivals) - 1) / span if span > 0 else float("nan"),
            "interval_ms": 1000 * statistics.median(intervals) if intervals else float("nan"),
            "block_ms": statistics.median(made) if made else float("nan"),
            "errors": [run.error for run in runs if run.error], "waited": sum(run.waited_in_line for run in runs)}


class Servers:
    """K protocol servers, each `python -m lingbot_core.serve` in its own process on a free port."""

    def __init__(self, count: int, model: str, dtype: str, threads: int) -> None:
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
        self.procs = [subprocess.Popen([sys.executable, "-m", "lingbot_core.serve", "--port", "0", "--model", model,
                                        "--dtype", dtype],
                                       cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                      for _ in range(count)]
        self.urls = [self._ready_url(proc) for proc in self.procs]

    @staticmethod
    def _ready_url(proc: subprocess.Popen, timeout_s: float = 300.0) -> str:
        deadline = time.monotonic() + timeout_s
        lines = []
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError("a server exited before it was ready:\n" + "".join(lines[-20:]))
            lines.append(line)
            match = READY.search(line)
            if match:
                url = match.group(1)
                threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep its pipe drained
                list_models(url)  # answers: ready
                return url
        raise RuntimeError("a server was not ready in time:\n" + "".join(lines[-20:]))

    def close(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--viewers", default="1,2", help="comma-separated viewer counts")
    parser.add_argument("--servers", default="1,2", help="comma-separated server counts K for the remote runs")
    parser.add_argument("--blocks", type=int, default=12, help="blocks each viewer takes")
    parser.add_argument("--skip", type=int, default=2, help="warm-up blocks left out of the medians")
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="torch threads of the local engine and of each server")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a viewer may take for its blocks")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every case, alternating their order; "
                                                               "the table shows medians over the rounds")
    args = parser.parse_args()
    viewer_counts = [int(v) for v in args.viewers.split(",")]
    server_counts = [int(k) for k in args.servers.split(",")]
    torch.set_num_threads(args.threads)
    cpu = torch.backends.cpu.get_cpu_capability()
    print(f"torch {torch.__version__}, CPU capability {cpu}, {os.cpu_count()} cores, {args.threads} threads per "
          f"model; model {args.model} {args.dtype}; {args.blocks} blocks a viewer, medians after block {args.skip}")

    pipeline = load_pipeline(args.model, dtype=args.dtype)
    request = parse_start(IMAGE.read_bytes(), PROMPT, 0, pipeline.config)
    engine = Engine(pipeline, EngineConfig(max_sessions=max(viewer_counts), max_lead_blocks=1))
    model_config = remote_model_config(args.model)
    server_sets, remotes = {}, {}
    rounds: dict[tuple[str, int], list[dict]] = {}
    try:
        for k in server_counts:  # started once; idle servers cost no compute between the rounds
            server_sets[k] = Servers(k, args.model, args.dtype, args.threads)
            remotes[k] = RemoteEngine(server_sets[k].urls, model_config, EngineConfig(max_lead_blocks=1),
                                      RemoteConfig(output_pacing=False))
        # Rounds alternate the backends, so a busy spell of this shared host does not land on one of them.
        for round_index in range(args.rounds):
            for viewers in viewer_counts:
                cases = [("local", engine)] + [(f"remote K={k}", remotes[k]) for k in server_counts]
                for name, backend in (cases if round_index % 2 == 0 else cases[::-1]):
                    rounds.setdefault((name, viewers), []).append(
                        summarise(run_case(backend, request, viewers, args.blocks, args.timeout), args.skip))
    finally:
        for remote in remotes.values():
            remote.shutdown()
        for servers in server_sets.values():
            servers.close()
        engine.shutdown()
    results = {key: {"blocks": sum(r["blocks"] for r in runs),
                     **{f: statistics.median(r[f] for r in runs) for f in ("throughput", "interval_ms", "block_ms")},
                     "errors": [e for r in runs for e in r["errors"]], "waited": max(r["waited"] for r in runs)}
               for key, runs in rounds.items()}

    print(f"\n{'backend':<12} {'viewers':>7} {'seated':>6} {'blocks':>6} {'blocks/s':>8} {'interval ms':>11} "
          f"{'model ms':>8} {'vs local':>9}")
    for (backend, viewers), row in results.items():
        local = results.get(("local", viewers))
        overhead = ""
        if backend != "local" and local and local["throughput"] > 0:
            overhead = f"{100 * (local['throughput'] / row['throughput'] - 1):+.1f}%"
        print(f"{backend:<12} {viewers:>7} {viewers - row['waited']:>6} {row['blocks']:>6} {row['throughput']:>8.2f} "
              f"{row['interval_ms']:>11.0f} {row['block_ms']:>8.0f} {overhead:>9}")
        for error in row["errors"]:
            print(f"{'':<12} error: {error}")
    same = [(r, results[("local", v)]) for (b, v), r in results.items() if b != "local" and v == 1]
    if same:
        remote_row, local_row = same[0]
        added = remote_row["interval_ms"] - local_row["interval_ms"]
        print(f"SUMMARY: one viewer, one server: {added:+.0f} ms a block over the in-process engine "
              f"({100 * (local_row['throughput'] / remote_row['throughput'] - 1):+.1f}% time; target <= 10%); "
              f"CPU {cpu}")


if __name__ == "__main__":
    main()
