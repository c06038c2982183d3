"""Build the embedded model's compiled graphs into the inductor cache, so the first `python app.py` finds
them warm and runs compiled from its first block (a cold build takes minutes on a CPU; see README).

    python -m lingbot_core.warm_compile [--model embedded] [--dtype auto] [--device cpu]

Loads the model as the app does with --compile, which runs the warm-up rollout on the compiled path
(lingbot_core/process/compile_switch.py), prints each stage with its time and where the cache lives. Run again,
it rebuilds from the cache in seconds. `LINGBOT_WARM_COMPILE=1 bash setup.sh` runs it.
"""

from __future__ import annotations

import argparse
import sys

from lingbot_core.process.precision import AUTO, DTYPE_CHOICES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="embedded", help="embedded, a local diffusers folder, or a Hub id")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default=AUTO, help="the precision the app will choose")
    parser.add_argument("--device", default="cpu", help="cpu (on CUDA the graphs build on the first blocks)")
    args = parser.parse_args(argv)
    if args.device != "cpu":
        parser.error("only the CPU build is warmed ahead: on CUDA the graphs build on the app's first blocks")

    import torch  # heavy imports after argument errors

    from lingbot_core.process.compile_cache import keep_compiled_kernels
    from lingbot_core.process.compile_switch import EAGER
    from lingbot_core.blocks.pipeline import load_pipeline
    from lingbot_core.process.startup import StartupLog

    log = StartupLog()
    log.note(f"warming torch.compile's cache in {keep_compiled_kernels()}: torch {torch.__version__}, "
             f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    pipe = load_pipeline(args.model, dtype=args.dtype, device=args.device, compile=True, log=log)
    if pipe.compile_mode == EAGER:
        print("compiling failed (see above); the app will run eager", file=sys.stderr)
        return 1
    log.note("done: the app and the offline command will run compiled from their first block")
    return 0


if __name__ == "__main__":
    sys.exit(main())
