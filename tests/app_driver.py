"""Running app.py on the tiny test model and driving it with gradio_client: shared by the app tests.

`running_app` serves the app in this process on 127.0.0.1 (so a test can look at the engine and at
Gradio's own state); `Viewer` is one gradio_client session whose stream is read in the background,
the "healthy session" that must keep receiving blocks while an attack runs.
"""

from __future__ import annotations

import contextlib
import socket
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import app as lingbot_app  # noqa: E402
from gradio_client import Client, handle_file  # noqa: E402
from lingbot_core.serving.contract import EngineConfig  # noqa: E402
from lingbot_core.serving.factory import create_engine  # noqa: E402
from lingbot_core.serving.streaming import StreamConfig  # noqa: E402

FOREST = ROOT / "examples" / "forest.png"
VILLAGE = ROOT / "examples" / "village.png"
WAIT_S = 120  # generous bound on waits for blocks; never asserted as a timing


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_app(engine_config: EngineConfig, stream_config: StreamConfig, workdir: Path, **build):
    """The app on the tiny model, served on a free port: yields (url, engine, DemoApp)."""
    engine = create_engine(preset="tiny", engine_config=engine_config)
    try:
        app = lingbot_app.build_demo(engine, stream_config=stream_config, workdir=workdir, **build)
        _, url, _ = app.launch(server_name="127.0.0.1", server_port=free_port(), prevent_thread_lock=True,
                               quiet=True)
        try:
            yield url, engine, app
        finally:
            app.close()
    finally:
        engine.shutdown()


def wait_until(predicate, what: str, timeout_s: float = WAIT_S):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.05)


def stream_outputs(job):
    """Yields (video, telemetry, session_id) as the server sends them."""
    seen = 0
    while True:
        outputs = job.outputs()
        while seen < len(outputs):
            yield outputs[seen]
            seen += 1
        if job.done():
            outputs = job.outputs()
            yield from outputs[seen:]
            return
        time.sleep(0.02)


class Viewer:
    """One API client playing a world; its stream is read on a background thread.

    `blocks` counts the video segments received; `wait_for_blocks(n)` waits until n more have come.
    """

    def __init__(self, url: str, seed: int = 0, image: Path = FOREST) -> None:
        self.client = Client(url, verbose=False, download_files=False)
        self.job = self.client.submit(handle_file(str(image)), "a forest path", seed, api_name="/start")
        self.session_id: str | None = None
        self.blocks = 0
        self.telemetry: list[str] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        wait_until(lambda: self.blocks >= 1 or self.job.done(), "the viewer's first block")
        assert self.blocks >= 1, f"the viewer got no block: {self.telemetry[-3:]}"

    def _read(self) -> None:
        for video, text, sid in stream_outputs(self.job):
            self.session_id = sid or self.session_id
            self.telemetry.append(text)
            if isinstance(video, dict) and video.get("url"):
                self.blocks += 1

    def wait_for_blocks(self, more: int, what: str = "more blocks") -> None:
        target = self.blocks + more
        wait_until(lambda: self.blocks >= target or self.job.done(), what)
        assert self.blocks >= target, f"the stream ended: {self.telemetry[-3:]}"

    def act(self, event_id: int, keys: list[str]) -> str:
        import json
        return self.client.predict(self.session_id, json.dumps({"event_id": event_id, "keys": keys}),
                                   api_name="/act")

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.client.predict(self.session_id, api_name="/stop")
        wait_until(self.job.done, "the stream to end")
        self._thread.join(timeout=WAIT_S)
        self.client.close()
