"""Viewers served through protocol servers in other processes vs by the in-process engine (prints figures).

    python benchmarks/bench_remote.py [--viewers 1,2] [--servers 1,2] [--blocks 12] [--rounds 3]
                                      [--protocols sglang,vllm-omni] [--model embedded] [--dtype fp32] [--threads N]
                                      [--wire-sizes 160x96,832x480]

Every viewer runs the same consumer loop over an engine-like backend (admit, then drain `next_message` until
--blocks blocks came), so the only difference between the two columns is the path a block takes:

- local:  Engine (lingbot_core/serving/engine.py) in this process, the model on its worker thread;
- sglang K: SglangEngine (lingbot_core/protocols/sglang/backend.py) over K servers `python -m lingbot_core.serve`, each
  its own process with its own model, one seat per server (upstream's rule); a block travels as raw frame batches
  over a local WebSocket and is reassembled here;
- vllm-omni K: VllmOmniEngine (lingbot_core/protocols/vllm_omni/backend.py) over the same servers' vLLM-Omni route;
  a block travels as H.264 fMP4 (encoded by the server, decoded here).

Per case (medians over --rounds rounds that alternate the order of the backends) it prints the aggregate throughput (blocks per second from the first block any viewer received to the
last), the median interval between a viewer's consecutive blocks after --skip warm-up blocks (the per-block
time a viewer sees), the median block time the model itself reported (Block.block_ms: the engine's, or the
server's scheduler_forward_ms), and for remote the overhead against local with the same viewers. Servers do not
pace their output here (realtime_output_pacing off), so both columns run as fast as the model allows.

With K servers on one machine the servers share its cores: the seats scale with K, the compute does not. On
this project's 2-core CPU the "seats" row is what scales; on GPUs each server has its own.

Then (--wire-sizes) the bytes a second one viewer costs on each wire at 16 FPS, for a walk through the procedural
world rendered at each size (the embedded model's 160x96 and the 14B's 832x480; world-like pictures, as a model
makes them): SGLang raw rgb24 and JPEG frame batches, vLLM-Omni's fMP4 (its default encoder settings), and the
page's socket player's JPEG frames.
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

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lingbot_core.blocks.pipeline import load_pipeline  # noqa: E402
from lingbot_core.protocols.sglang.backend import RemoteConfig, SglangEngine  # noqa: E402
from lingbot_core.protocols.vllm_omni.backend import VllmOmniEngine  # noqa: E402
from lingbot_core.protocols.sglang.client import list_models  # noqa: E402
from lingbot_core.protocols.model_config import remote_model_config  # noqa: E402
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
    wire_bytes: int = 0  # what the blocks cost on the wire (remote backends: Block.source["bytes"])
    frames: int = 0
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
                out.frames += len(message.pixels)
                out.wire_bytes += (message.source or {}).get("bytes") or 0
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
            "wire_kbps": _kb_per_s(runs),
            "errors": [run.error for run in runs if run.error], "waited": sum(run.waited_in_line for run in runs)}


def _kb_per_s(runs: list[ViewerRun], fps: int = 16) -> float:
    """kB a second of video, per viewer, on the wire."""
    frames = sum(run.frames for run in runs)
    return sum(run.wire_bytes for run in runs) / 1000 / (frames / fps) if frames else float("nan")


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
    parser.add_argument("--protocols", default="sglang,vllm-omni", help="the remote backends to compare")
    parser.add_argument("--wire-sizes", default="160x96,832x480",
                        help="frame sizes for the bytes-a-second table ('' to skip it)")
    parser.add_argument("--wire-blocks", type=int, default=4, help="blocks of the walk the wire table encodes")
    args = parser.parse_args()
    viewer_counts = [int(v) for v in args.viewers.split(",")]
    protocols = [p for p in args.protocols.split(",") if p]
    backends = {"sglang": SglangEngine, "vllm-omni": VllmOmniEngine}
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
            for protocol in protocols:
                remotes[(protocol, k)] = backends[protocol](server_sets[k].urls, model_config,
                                                            EngineConfig(max_lead_blocks=1),
                                                            RemoteConfig(output_pacing=False))
        # Rounds alternate the backends, so a busy spell of this shared host does not land on one of them.
        for round_index in range(args.rounds):
            for viewers in viewer_counts:
                cases = [("local", engine)] + [(f"{p} K={k}", remotes[(p, k)]) for k in server_counts
                                               for p in protocols]
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
                     **{f: statistics.median(r[f] for r in runs)
                        for f in ("throughput", "interval_ms", "block_ms", "wire_kbps")},
                     "errors": [e for r in runs for e in r["errors"]], "waited": max(r["waited"] for r in runs)}
               for key, runs in rounds.items()}

    print(f"\n{'backend':<15} {'viewers':>7} {'seated':>6} {'blocks':>6} {'blocks/s':>8} {'interval ms':>11} "
          f"{'model ms':>8} {'vs local':>9} {'kB/s':>7}")
    for (backend, viewers), row in results.items():
        local = results.get(("local", viewers))
        overhead = ""
        if backend != "local" and local and local["throughput"] > 0:
            overhead = f"{100 * (local['throughput'] / row['throughput'] - 1):+.1f}%"
        kbps = "" if backend == "local" else f"{row['wire_kbps']:.0f}"
        print(f"{backend:<15} {viewers:>7} {viewers - row['waited']:>6} {row['blocks']:>6} {row['throughput']:>8.2f} "
              f"{row['interval_ms']:>11.0f} {row['block_ms']:>8.0f} {overhead:>9} {kbps:>7}")
        for error in row["errors"]:
            print(f"{'':<15} error: {error}")
    if args.wire_sizes:
        wire_table([tuple(int(v) for v in size.split("x")) for size in args.wire_sizes.split(",")], args.wire_blocks)
    for protocol in protocols:
        same = [(r, results[("local", v)]) for (b, v), r in results.items() if b.startswith(protocol) and v == 1]
        if same:
            remote_row, local_row = same[0]
            added = remote_row["interval_ms"] - local_row["interval_ms"]
            print(f"SUMMARY {protocol}: one viewer, one server: {added:+.0f} ms a block over the in-process engine "
                  f"({100 * (local_row['throughput'] / remote_row['throughput'] - 1):+.1f}% time; target <= 10%); "
                  f"CPU {cpu}")


def wire_table(sizes: list[tuple[int, int]], blocks: int, fps: int = 16) -> None:
    """kB a second per viewer on each wire, for a walk through world 1000000 rendered at each size."""
    from lingbot_core.boundary.fmp4 import Fmp4Writer
    from lingbot_core.model import camera
    from lingbot_core.config import CameraConfig
    from lingbot_core.protocols.sglang.batching import build_frame_batches
    from lingbot_core.serving.live_socket import encode_frames
    from lingbot_core.world.render import render, to_uint8
    from lingbot_core.world.scene import make_world

    world = make_world(1000000)
    keys = [frozenset({"w"})] * 6 + [frozenset({"w", "l"})] * 6
    frames_total = blocks * 12 - 3
    poses, _ = camera.integrate_actions(camera.CameraState.initial(), (keys * (1 + frames_total // len(keys)))
                                        [:frames_total], CameraConfig(move_step=0.0125, yaw_step_deg=1.5))
    print(f"\nbytes a second one viewer costs at {fps} FPS ({frames_total} frames of a walk, world 1000000):")
    print(f"{'size':>9} {'SGLang raw':>11} {'SGLang jpeg':>12} {'vLLM-Omni fMP4':>15} {'page socket jpeg':>17}")
    for width, height in sizes:
        intrinsics = np.array(camera.intrinsics_for(CameraConfig(), width, height))
        frames = to_uint8(render(world, poses, intrinsics, width, height, supersample=1))
        raw = sum(len(b.payload) for b in build_frame_batches(frames, request_id="r", chunk_index=0, event_id=None))
        jpeg = sum(len(b.payload) for b in build_frame_batches(frames, request_id="r", chunk_index=0, event_id=None,
                                                               output_format="jpeg"))
        writer = Fmp4Writer(width, height, fps)
        fmp4 = sum(len(writer.add(frames[i:i + 12])) for i in range(0, len(frames), 12)) + len(writer.close())
        page = sum(len(message) for message in encode_frames(frames, 0, 0, len(frames), 0))
        seconds = len(frames) / fps
        print(f"{width}x{height:<5} " + " ".join(f"{value / 1000 / seconds:>{w}.0f}" for value, w in
                                                 ((raw, 11), (jpeg, 12), (fmp4, 15), (page, 17))) + "  kB/s")


if __name__ == "__main__":
    main()
