"""The realtime video protocols served headless over the local engine (the page serves them too: app.py):
SGLang's `/v1/realtime_video/generate` and vLLM-Omni's `/v1/realtime/video`, on one port.

    python -m lingbot_core.serve --port 30000 [--host H] [--model embedded] [--dtype auto] [--max-sessions N]
                                 [--idle-ttl S] [--max-waiting N] [--max-per-address N] [--allow-origin ORIGIN]

The protocols' servers are lingbot_core/protocols/sglang/server.py and lingbot_core/protocols/vllm_omni/server.py,
sharing the engine and the per-address limits; this command loads the model, starts the
engine and serves it with uvicorn until Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time

from lingbot_core.boundary.image import MAX_IMAGE_BYTES
from lingbot_core.protocols.sglang.protocol import GENERATE_PATH
from lingbot_core.protocols.server_base import SHUTDOWN_GRACE_S, ServeConfig
from lingbot_core.protocols.sglang.server import RealtimeServer
from lingbot_core.protocols.vllm_omni import messages as video_wire
from lingbot_core.protocols.vllm_omni.server import VideoStreamServer
from lingbot_core.serving.clients import ClientGate, ClientLimits


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from lingbot_core.process.startup import StartupLog
    from lingbot_core.serving.contract import EngineConfig
    from lingbot_core.serving.launch import add_engine_arguments, start_local_engine, startup_line

    parser = argparse.ArgumentParser(description="SGLang's and vLLM-Omni's realtime video protocols over the local engine, headless")
    parser.add_argument("--port", type=int, default=30000, help="0: a free port (the ready line names it)")
    parser.add_argument("--host", default="127.0.0.1")
    add_engine_arguments(parser)
    parser.add_argument("--max-waiting", type=int, default=EngineConfig.max_waiting,
                        help="connections that wait in line for a seat; 0 refuses at once (1008 CAPACITY_EXHAUSTED), "
                             "as upstream refuses a second session, so a pool of these servers sees busy seats")
    args = parser.parse_args(argv)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    log_startup = StartupLog()
    startup_line(log_startup)
    engine = start_local_engine(args, log_startup, max_waiting=args.max_waiting)
    serve_config = ServeConfig(allowed_origins=tuple(args.allow_origin))
    gate = ClientGate(ClientLimits(max_per_address=args.max_per_address))
    server = RealtimeServer(engine, serve_config, gate=gate)
    video = VideoStreamServer(engine, serve_config, model_id=server.model_id, gate=gate)
    # No per-message deflate: frames do not shrink and a raw chunk is megabytes. An init carries the picture,
    # so incoming messages may be as large as the largest picture accepted.
    from starlette.applications import Starlette

    app = Starlette(routes=[*server.routes(), *video.routes()])
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                            ws_per_message_deflate=False, ws_max_size=max(MAX_IMAGE_BYTES, 4 * video_wire.START_MAX_CHARS) + 2**20,
                            timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
    uvicorn_server = uvicorn.Server(config)

    def announce() -> None:
        while not uvicorn_server.started:
            if uvicorn_server.should_exit:
                return
            time.sleep(0.05)
        host, port = uvicorn_server.servers[0].sockets[0].getsockname()[:2]
        print(f"ready at ws://{host}:{port}{GENERATE_PATH} and ws://{host}:{port}{video_wire.PATH} "
              f"(model {server.model_id}, {engine.capacity} sessions at once)", flush=True)

    threading.Thread(target=announce, name="lingbot-serve-ready", daemon=True).start()
    # uvicorn stops gracefully on SIGINT or SIGTERM, then raises the signal again; as KeyboardInterrupt
    # (SIGTERM too, as app.py does) it ends here, after the shutdown, and the process exits 0.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        uvicorn_server.run()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
        video.close()
        engine.shutdown()


if __name__ == "__main__":
    sys.exit(main())
