"""One home for what the page (`python app.py`) and the headless protocol server (`python -m lingbot_core.serve`)
share on their command lines: the model and engine options with their defaults, the start-up line, and the
local engine those options start."""

from __future__ import annotations

import argparse
import os

from lingbot_core.blocks.model_source import choose_source, planned_config
from lingbot_core.process.allocator import keep_freed_memory
from lingbot_core.process.device import default_device
from lingbot_core.process.precision import AUTO, DTYPE_CHOICES
from lingbot_core.process.startup import StartupLog
from lingbot_core.serving.clients import ClientLimits
from lingbot_core.serving.contract import EngineConfig
from lingbot_core.serving.starting import StartingEngine

IDLE_TTL_S = 120.0  # seconds without input before a world closes
CPU_SESSIONS = 2  # worlds at once on a CPU by default: compute runs out long before memory


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """--model, --device, --dtype, --compile, --max-sessions, --memory-budget-gib, --idle-ttl, --max-per-address
    and --allow-origin, as both commands take them."""
    parser.add_argument("--model", help="embedded (default), a local diffusers folder, or a Hub id "
                                        "(downloaded); default $LINGBOT_MODEL")
    parser.add_argument("--device", help="cpu or cuda (default: $LINGBOT_DEVICE, else cuda when available)")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default=AUTO,
                        help="auto (default): bf16 on CUDA and on CPUs where it runs natively and a probe shows "
                             "it faster, else fp32")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="torch.compile the transformer blocks and the VAE decode step (default: on CUDA; on a CPU "
                             "only for a model measured to pay there, none so far, so eager; --compile builds the "
                             "graphs before the first block, seconds with a warm inductor cache, minutes cold: "
                             "LINGBOT_WARM_COMPILE=1 bash setup.sh builds them ahead; --no-compile: eager)")
    parser.add_argument("--max-sessions", type=int,
                        help=f"cap on concurrent worlds on top of the memory budget (default: {CPU_SESSIONS} on a CPU, "
                             "where compute runs out long before memory, else none)")
    parser.add_argument("--memory-budget-gib", type=float,
                        help="memory for sessions (default: 0.9 of what a GPU has free, half of a CPU host's)")
    parser.add_argument("--idle-ttl", type=float, default=IDLE_TTL_S, help="seconds without input before a world closes")
    parser.add_argument("--max-per-address", type=int, default=ClientLimits.max_per_address,
                        help="worlds, places in line and protocol connections one client IP address may hold at once")
    parser.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                        help="a browser page origin that may use the realtime protocol's WebSocket besides the "
                             "server's own pages, e.g. https://example.org; '*' for any (repeatable)")


def engine_config(args: argparse.Namespace, device: str, **fields) -> EngineConfig:
    """The engine's config from the shared options (`fields`: a command's own, e.g. max_waiting)."""
    budget = int(args.memory_budget_gib * 2**30) if args.memory_budget_gib else None
    max_sessions = args.max_sessions or (CPU_SESSIONS if device == "cpu" else None)
    return EngineConfig(memory_budget_bytes=budget, max_sessions=max_sessions, idle_ttl_s=args.idle_ttl, **fields)


def start_local_engine(args: argparse.Namespace, log: StartupLog, *, behind_page: bool = False, **fields):
    """Load the model the options name and start the local engine over it.

    behind_page: return a StartingEngine (serving/starting.py) instead, whose `load()` the caller runs once its
    page is up, where the model's config can be read from its files (the embedded model, a local folder);
    a Hub id, or a folder whose files the loader will refuse, loads here as before (the loader explains)."""
    device = args.device or os.environ.get("LINGBOT_DEVICE") or default_device()
    config = engine_config(args, device, **fields)

    def make():
        from lingbot_core.serving.factory import create_engine  # diffusers and transformers: seconds to import

        return create_engine(args.model, device=device, dtype=args.dtype, compile=args.compile, log=log,
                             engine_config=config)

    if behind_page:
        try:
            planned = planned_config(*choose_source(args.model))
        except ValueError:  # a refused test preset or checkpoint folder: the loader says why, below
            planned = None
        if planned is not None:
            return StartingEngine(planned, config, make)
    return make()


def startup_line(log: StartupLog) -> None:
    """The first start-up line: PyTorch, threads, the CPU's capability and the allocator's setting."""
    import torch

    log.note(f"starting: torch {torch.__version__}, {torch.get_num_threads()} threads, "
             f"CPU capability {torch.backends.cpu.get_cpu_capability()}; {keep_freed_memory()}")
