"""LingBot-World v2 in the browser: upload an image, press Start, walk around with W A S D / I J K L.

    python app.py [--model embedded|OWNER/NAME|FOLDER] [--max-sessions N] [--port P]
    python app.py --backend sglang --sglang-url ws://h1:30000 --sglang-url ws://h2:30000   # no local model
    python app.py --backend vllm-omni --vllm-omni-url ws://h1:8000 --vllm-omni-url ws://h2:8000

Gradio widgets and wiring only. The world lives in the engine (lingbot_core/serving/engine.py); each
viewer's stream, pacing, actions and downloads live in lingbot_core/serving/streaming.py. Named API
endpoints, usable from gradio_client (see examples/client.py):

    /start(image, prompt, seed)          -> streamed (video segment, telemetry, session_id)
    /play(image, prompt, seed, ground_truth) -> streamed (video segment, ground-truth segment, telemetry,
                                         session_id): /start with the true world beside it (the page's Start)
    /new_world()                         -> (start picture of a fresh held-out world, note); embedded model only
    /act(session_id, events)             -> status;  events: {"event_id": 1, "keys": ["w"]} or a list
    /stop(session_id)                    -> status
    /reset(session_id, image, prompt, seed) -> status
    /download(session_id)                -> (rollout MP4, replay JSON)
    /generate(image, prompt, seed, script, script_file, poses, intrinsics, example_files) -> (MP4, message)
                                         example_files: an official example folder's files, dropped together

The same port also serves the realtime video protocols over the same engine: SGLang's
(lingbot_core/protocols/sglang/server.py: WebSocket /v1/realtime_video/generate and GET /v1/models) and vLLM-Omni's
(lingbot_core/protocols/vllm_omni/server.py: WebSocket /v1/realtime/video), so either's clients can play this model.

Environment: LINGBOT_MODEL (same as --model), LINGBOT_BACKEND (same as --backend), LINGBOT_SGLANG_URLS and
LINGBOT_VLLM_OMNI_URLS (comma separated, same as --sglang-url and --vllm-omni-url),
GRADIO_SERVER_NAME / GRADIO_SERVER_PORT (read by Gradio),
LINGBOT_TEST_PRESET=tiny (tests only: a 32x64 model with random weights, for fast CPU checks).
"""

from __future__ import annotations

import spaces  # noqa: F401  (first: on ZeroGPU it must be imported before anything initialises CUDA)

import _thread
import argparse
import asyncio
import atexit
import contextlib
import os
import random
import shutil
import signal
import tempfile
import threading
import time
import urllib.parse
import uuid
from dataclasses import dataclass
from pathlib import Path

import gradio as gr
from PIL import Image
from gradio.utils import get_upload_folder

from lingbot_core.config import EMBEDDED
from lingbot_core.boundary.example_folder import ExampleFolderError, example_from_files
from lingbot_core.boundary.offline import parse_render
from lingbot_core.protocols.sglang.backend import create_remote_engine
from lingbot_core.protocols.vllm_omni.backend import create_vllm_omni_engine
from lingbot_core.protocols.vllm_omni.messages import PATH as VIDEO_PATH
from lingbot_core.process.startup import StartupLog
from lingbot_core.serving.contract import Backend, EngineConfig, RenderFailedError, RenderRefused
from lingbot_core.serving.launch import add_engine_arguments, start_local_engine, startup_line
from lingbot_core.serving.starting import StartingEngine
from lingbot_core.boundary.requests import parse_start
from lingbot_core.protocols.sglang.protocol import GENERATE_PATH
from lingbot_core.protocols.server_base import ServeConfig
from lingbot_core.protocols.sglang.server import RealtimeServer
from lingbot_core.protocols.vllm_omni.server import VideoStreamServer
from lingbot_core.serving.live_socket import LiveSocket
from lingbot_core.serving.streaming import LiveService, StreamConfig, StreamError
from lingbot_core.boundary.video import Recording
from lingbot_core.process.workdir import WorkFolder
from lingbot_core.world.examples import EXAMPLE_SEEDS, StartPictures, example_name
from lingbot_core.world.ground_truth import GroundTruthRenderer, GroundTruthView, beside
from lingbot_core.world.scene import HELD_OUT_SEEDS, seed_split

HERE = Path(__file__).resolve().parent
EXAMPLES = HERE / "examples"
PAGE = HERE / "page"  # the page's script and styles
OFFLINE_KEEP_S = 600.0  # an offline MP4 is removed from the work folder this long after it was made
WORLD_PROMPT = "a procedural world"  # the embedded model's text conditioning is trivial; any prompt works
PHOTO_EXAMPLES = (("forest.png", "a forest path in spring, sunlight"), ("village.png", "a quiet village street at dusk"))
# Two groups of four (move, look), each drawn as an inverted T: the first key above the other three.
KEYS = (("w", "forward"), ("a", "left"), ("s", "back"), ("d", "right"),
        ("i", "look up"), ("j", "turn left"), ("k", "look down"), ("l", "turn right"))

# Keyboard and key-button capture, and the player's clock (page/controls.js).
def _page_script(name: str) -> str:
    """One of page/'s scripts as the function it holds (Gradio evaluates it: no header comment before it)."""
    lines = (PAGE / name).read_text(encoding="utf-8").splitlines(keepends=True)
    return "".join(line for line in lines if not line.startswith("//"))


# The page's scripts, run once when it loads: the keys and the player clock, then the socket player.
PAGE_JS = f"() => {{ ({_page_script('controls.js')})(); ({_page_script('player.js')})(); }}"
# Run before the hidden buttons' handlers: hand over the queued events (dropped without a session) / the playhead.
TAKE_EVENTS_JS = ("(sid, events) => { const e = window.lingbotControls ? window.lingbotControls.take() : '[]'; "
                  "return [sid, sid ? e : '[]']; }")
READ_PLAYHEAD_JS = "(sid, t) => [sid, window.lingbotControls ? window.lingbotControls.playhead() : '']"

PAGE_CSS = (PAGE / "page.css").read_text(encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# Offline generation (one MP4 from a script or a trajectory)


def generate_offline(engine: Backend, image, prompt, seed, script_text, script_file, poses_file, intrinsics_file,
                     out_dir: Path, trusted_root: Path, max_blocks: int, example_files=None, owner: str | None = None,
                     progress=None) -> tuple[str, str]:
    """An action script (JSONL text or file), a poses/intrinsics pair, or an official example folder's files
    dropped together -> one MP4. Raises StreamError.

    A folder's image.jpg and prompt.txt replace the image and prompt fields (dropping the folder is the
    later, explicit choice); a folder without them uses the fields. The inputs are parsed once, whole, before
    any block (lingbot_core/boundary/offline.py, the command's parser): a script past max_blocks is refused, a
    trajectory is cut to max_blocks as upstream cuts one to the requested video, and the message says so.
    The blocks are made on the engine's model between live blocks (owner: the client's address, one render
    each); `progress` hears the render's place in line and its blocks.
    """
    config = engine.model_config
    has_script = bool(script_file) or bool(script_text and script_text.strip())
    if has_script + (bool(poses_file) or bool(intrinsics_file)) + bool(example_files) != 1:
        raise StreamError("give one of: an action script (text or .jsonl file), a poses.npy + intrinsics.npy pair, "
                          "or an example folder's files, not both")
    try:
        if example_files:
            folder = example_from_files(example_files)
            poses_file, intrinsics_file = folder.poses, folder.intrinsics
            image = folder.image if folder.image is not None else image
            prompt = folder.prompt if folder.prompt is not None else prompt
        if image is None:
            raise StreamError("upload a start image first")
        request = parse_render(config, image, prompt, seed, script_text=None if script_file else script_text,
                               script_path=script_file or None, poses_path=poses_file or None,
                               intrinsics_path=intrinsics_file or None, trusted_root=trusted_root,
                               max_blocks=max_blocks)
    except (ExampleFolderError, ValueError) as exc:  # EventError, ImageError, PromptError, TrajectoryError, ...
        raise StreamError(str(exc)) from None
    out_dir.mkdir(parents=True, exist_ok=True)
    # Gradio copies a returned video into its own cache at once, so an older output here is never read again.
    for old in out_dir.glob("lingbot-offline-*.mp4"):
        with contextlib.suppress(OSError):
            if time.time() - old.stat().st_mtime > OFFLINE_KEEP_S:
                old.unlink()
    handle, name = tempfile.mkstemp(suffix=".mp4", prefix="lingbot-offline-", dir=out_dir)
    os.close(handle)  # the writer opens the file by name
    out = Path(name)
    try:
        blocks = engine.render(request, out, owner=owner, progress=progress)
    except (RenderRefused, RenderFailedError) as exc:  # a clear message, no file left
        raise StreamError(str(exc)) from None
    frames = config.pixel_frames_for_blocks(blocks)
    note = f"; {request.note}" if request.note else ""
    return str(out), f"{blocks} blocks, {frames} frames at {config.fps} FPS ({frames / config.fps:.2f} s){note}"


# ---------------------------------------------------------------------------------------------
# The Blocks


@dataclass
class DemoApp:
    demo: gr.Blocks
    service: LiveService
    workdir: WorkFolder | None = None  # removed on close when the app owns it
    renderer: GroundTruthRenderer | None = None  # the world render process (embedded model only)
    realtime: RealtimeServer | None = None  # SGLang's realtime protocol over the same engine (lingbot_core/protocols/sglang/server.py)
    live: LiveSocket | None = None  # the page's socket player's route (lingbot_core/serving/live_socket.py)
    video: VideoStreamServer | None = None  # vLLM-Omni's realtime protocol (lingbot_core/protocols/vllm_omni/server.py)

    def launch(self, **kwargs):
        """demo.launch with the page's key capture script and styles, and the realtime protocol's routes on the
        same port: Gradio hands app_kwargs to its FastAPI app, whose `routes` come before Gradio's own."""
        kwargs.setdefault("show_error", True)
        kwargs.setdefault("max_file_size", "50mb")
        routes = [*(self.live.routes() if self.live is not None else ()),
                  *(self.realtime.routes() if self.realtime is not None else ()),
                  *(self.video.routes() if self.video is not None else ())]
        if routes:
            app_kwargs = dict(kwargs.pop("app_kwargs", None) or {})
            app_kwargs["routes"] = [*app_kwargs.get("routes", ()), *routes]
            kwargs["app_kwargs"] = app_kwargs
        return self.demo.launch(js=PAGE_JS, css=PAGE_CSS, **kwargs)

    def close(self) -> None:
        """Stop the server and every stream; the engine stays with its owner."""
        with contextlib.suppress(Exception):
            self.demo.close()  # with delete_cache set, Gradio also deletes every file it cached
        self.service.shutdown()
        if self.realtime is not None:
            self.realtime.close()
        if self.video is not None:
            self.video.close()
        if self.live is not None:
            self.live.close()
        if self.renderer is not None:
            self.renderer.close()
        if self.workdir is not None:
            self.workdir.remove()


def start_image(**kwargs) -> gr.Image:
    """A gr.Image that hands over the uploaded file as it is, for lingbot_core/boundary/image.py to judge.

    image_mode=None with type="filepath": Gradio only reads the header and passes the path on (its default
    image_mode="RGB" decodes and converts every upload, a 12000x12000 1-bit PNG included, before any
    check of ours). Inline data: URLs would be decoded whole by Gradio, so they are refused. Unreadable
    uploads fail with a plain message rather than a preprocessing report. The instance's preprocess is
    wrapped (a subclass would make Gradio write an app.pyi stub).
    """
    component = gr.Image(type="filepath", image_mode=None, sources=["upload"], **kwargs)
    preprocess = component.preprocess

    def checked(payload):
        if payload is not None and str(getattr(payload, "url", None) or "").startswith("data:"):
            raise gr.Error("send the image as an uploaded file, not as an inline data: URL", print_exception=False)
        try:
            return preprocess(payload)
        except gr.Error:
            raise
        except Image.DecompressionBombError:
            raise gr.Error("the image is too large to open safely; use one under 40 megapixels",
                           print_exception=False) from None
        except Exception:  # PIL cannot even identify the file
            raise gr.Error("the upload is not a readable image (PNG, JPEG, WebP, ...)", print_exception=False) from None

    component.preprocess = checked
    return component


def _user_error(exc: StreamError) -> gr.Error:
    return gr.Error(str(exc), print_exception=False)


def unread_updates(demo: gr.Blocks, session_hash: str) -> int:
    """Messages Gradio holds for a session that no client has fetched yet (0 once a reader drains them).

    Reads Gradio's queue (a private attribute, checked by tests/test_hardening.py): a fire-and-forget
    POST /call/start never fetches its results, and only this count tells the app so.
    """
    messages = demo._queue.pending_messages_per_session.get(session_hash)
    return messages.qsize() if messages is not None else 0


def release_ended_streams(demo: gr.Blocks, session_hash: str) -> int:
    """Drop Gradio's finished video streams of one session; returns how many runs were dropped.

    Gradio keeps every HLS segment of a stream in memory so the playlist can be fetched after the run,
    and frees them only when a page's heartbeat connection closes; API clients have none. A run whose
    streams have all ended is dropped here, some time after its world closed (StreamConfig.keep_ended_stream_s).
    """
    runs = demo.pending_streams.get(session_hash)
    if not runs:
        return 0
    ended = [run for run, streams in runs.items() if all(stream.ended for stream in streams.values())]
    for run in ended:
        del runs[run]
    if not runs:
        demo.pending_streams.pop(session_hash, None)
    return len(ended)


def player_of(request: gr.Request | None) -> str:
    """Which player the caller's page plays: the socket player on a page in a browser (its address, sent as the
    Referer of its calls, holds no `player=hls`), Gradio's HLS video for API clients and `?player=hls` pages."""
    headers = getattr(request, "headers", None) or {}
    page = headers.get("referer") or ""
    if not page or "player=hls" in urllib.parse.urlsplit(page).query:
        return "hls"
    return "socket"


def _viewer(request: gr.Request) -> str | None:
    """Who is calling: the Gradio session hash, the same for a page and for one gradio_client.Client."""
    return request.session_hash if request is not None else None


def is_world_model(config) -> bool:
    """The embedded model at any size (its test presets included): trained, or to be trained, on the
    procedural world (lingbot_core/world/), so world pictures, New world and Ground truth apply to it."""
    return config.name == EMBEDDED.name or config.weights_seed is not None


def picture_note(seed: int | None, picture_given: bool) -> str:
    """What the page says under the start picture for the embedded model."""
    if seed is not None:
        where = "held out from training" if seed_split(seed) == "held_out" else "a training world"
        return (f"World **{seed}** ({where}): a render of the procedural world the embedded model learned. "
                "Tick **Ground truth** to see the true world beside the stream.")
    if not picture_given:
        return ""
    return ("⚠️ This picture is not a render of the procedural world. The embedded model learned only that "
            "world, so the picture is **out of distribution** and the stream will not look like it. Pick an "
            "example or press **New world**; for photographs run the real checkpoint with `--model`.")


def world_examples() -> list[list[str]]:
    """The held-out world pictures in examples/ (python -m lingbot_core.world.examples writes them)."""
    paths = [EXAMPLES / example_name(seed) for seed in EXAMPLE_SEEDS]
    return [[str(path), WORLD_PROMPT] for path in paths if path.is_file()]


def warm_examples(engine: Backend, examples: list[list[str]]) -> None:
    """Have the idle model encode the examples' condition streams (Engine.prewarm), so a world started from
    one plays at full speed from its first block. A picture that cannot be read is left out here; its Start
    says why."""
    pictures = []
    for path, prompt in examples:
        with contextlib.suppress(ValueError, OSError):
            pictures.append(parse_start(path, prompt, 0, engine.model_config).picture)
    engine.prewarm(pictures)


def sweep_old_files(folder: Path, pattern: str, older_than_s: float) -> None:
    """Remove files of `folder` matching `pattern` last written more than `older_than_s` ago."""
    for old in folder.glob(pattern):
        with contextlib.suppress(OSError):
            if time.time() - old.stat().st_mtime > older_than_s:
                old.unlink()


def build_demo(engine: Backend, *, stream_config: StreamConfig = StreamConfig(),
               workdir: Path | WorkFolder | None = None, offline_max_blocks: int = 64,
               delete_cache: tuple[int, int] = (600, 3600), serve_config: ServeConfig = ServeConfig()) -> DemoApp:
    """The page and API over one engine.

    workdir: where recordings and offline MP4s go. A WorkFolder (or None: a new one) belongs to the app
    and is removed by DemoApp.close; a plain path stays the caller's. delete_cache: Gradio's (every,
    older than) seconds for removing its cached uploads and downloads.
    """
    config = engine.model_config
    owned = workdir if isinstance(workdir, WorkFolder) else (WorkFolder.create() if workdir is None else None)
    workdir = owned.path if owned is not None else Path(workdir)
    service = LiveService(engine, workdir / "recordings", stream_config)
    # The procedural world (embedded model only): start pictures and ground truth, rendered in one
    # one-thread process so that they never take the model's threads (lingbot_core/world/ground_truth.py).
    world_model = is_world_model(config)
    renderer = GroundTruthRenderer() if world_model else None
    pictures = StartPictures(config, renderer.render) if renderer is not None else None
    if pictures is not None:
        for path, _ in world_examples():
            pictures.know(path)
    draw = random.Random()  # New world's seeds (fresh per app; the global RNG stays the caller's)
    # Streams showing ground truth, by session id: (their viewer, their view), so Reset can switch worlds.
    truth_views: dict[str, tuple[str | None, GroundTruthView]] = {}

    def recognise(image) -> int | None:
        return pictures.recognise(image) if pictures is not None else None

    async def play(image, prompt, seed, ground_truth, request: gr.Request):
        """Start a world and stream it; with ground_truth, the true world beside it (world pictures only)."""
        viewer = _viewer(request)
        address = getattr(request.client, "host", None) if request is not None else None
        view = None
        if ground_truth and renderer is not None:  # recognising a world's picture starts the render process
            view = GroundTruthView(renderer, config, await asyncio.to_thread(recognise, image))
        stream = service.stream(image, prompt, seed, viewer, address,
                                unread=(lambda: unread_updates(demo, viewer)) if viewer else None,
                                player=player_of(request))
        truth = Recording(workdir / "ground-truth" / uuid.uuid4().hex) if view is not None else None
        session_id, line = None, ""
        try:
            async with contextlib.aclosing(stream) as updates:
                if view is None:
                    async for update in updates:
                        yield (str(update.segment) if update.segment else gr.skip(), gr.skip(), update.telemetry,
                               update.session_id or "")
                    return
                async with contextlib.aclosing(beside(updates, view)) as merged:
                    async for update, comparison in merged:
                        if update is None:  # a block's ground truth is ready (or failed: then words only)
                            segment = (await asyncio.to_thread(truth.add, comparison.truth, config.fps)
                                       if comparison.error is None else None)
                            yield (gr.skip(), str(segment) if segment else gr.skip(),
                                   f"{line} · {comparison.describe()}", session_id or "")
                            continue
                        if update.session_id and session_id is None:
                            session_id = update.session_id
                            truth_views[session_id] = (viewer, view)
                        note = view.submit(update.block) if update.block is not None else ""
                        line = update.telemetry + (f" · {note}" if note else "")
                        yield (str(update.segment) if update.segment else gr.skip(), gr.skip(), line,
                               update.session_id or "")
        except StreamError as exc:
            raise _user_error(exc) from None
        finally:
            if session_id is not None:
                truth_views.pop(session_id, None)
            if truth is not None:  # Gradio has read every segment yielded (each before the next is asked for)
                shutil.rmtree(truth.root, ignore_errors=True)
            if viewer:  # Gradio ends this run's video stream after we return; free its segments later
                with contextlib.suppress(RuntimeError):  # no running loop: the server is gone anyway
                    asyncio.get_running_loop().call_later(stream_config.keep_ended_stream_s,
                                                          release_ended_streams, demo, viewer)

    async def start(image, prompt, seed, request: gr.Request):
        """Start a world and stream it: (video segment, telemetry, session id) per block."""
        async with contextlib.aclosing(play(image, prompt, seed, False, request)) as updates:
            async for segment, _, telemetry, session_id in updates:
                yield segment, telemetry, session_id

    def new_world():
        """A fresh held-out world's start picture (held out, so Ground truth compares on unseen worlds)."""
        if pictures is None:
            raise gr.Error("New world needs the embedded model: the real checkpoint was not trained on the "
                           "procedural world", print_exception=False)
        folder = workdir / "worlds"
        folder.mkdir(parents=True, exist_ok=True)
        sweep_old_files(folder, "world_*.png", OFFLINE_KEEP_S)  # Gradio copied each into its cache already
        seed = draw.randrange(HELD_OUT_SEEDS.start, HELD_OUT_SEEDS.stop)
        return str(pictures.write(seed, folder)), picture_note(seed, True)

    def describe_picture(image):
        return picture_note(recognise(image), image is not None) if world_model else ""

    def prewarm_picture(image):
        """A chosen picture's condition stream is encoded while the model is idle, before Start: its first
        blocks then play at full speed instead of each paying an encode (Engine.prewarm; decoded in the page's
        decode slots, a picture that cannot be read is left to Start to refuse)."""
        if image is None:
            return
        with contextlib.suppress(ValueError, OSError):
            engine.prewarm([service.gate.decode(parse_start, image, WORLD_PROMPT, 0, config).picture])

    def act_from_page(session_id, events, request: gr.Request):
        """The page's key events: problems become a toast, not an error state."""
        if session_id and events not in (None, "", "[]"):
            try:
                service.act(session_id, events, _viewer(request))
            except StreamError as exc:
                gr.Warning(str(exc))
        return gr.skip()

    def issue_ticket(session_id, request: gr.Request):
        """The page's socket player's ticket for its new session (none for the HLS player or no session)."""
        if not session_id or player_of(request) != "socket":
            return ""
        try:
            return service.ticket(session_id, _viewer(request))
        except StreamError:
            return ""

    def playhead_from_page(session_id, report, request: gr.Request):
        if session_id and report:  # "seconds stalls" (lingbotControls.playhead)
            seconds, _, stalls = str(report).partition(" ")
            with contextlib.suppress(StreamError):  # a report for a session that just ended
                service.report_playhead(session_id, seconds, _viewer(request), stalls or None)
        return gr.skip()

    def act(session_id: str, events: str, request: gr.Request) -> str:
        """Post one event or a JSON list of events, e.g. {"event_id": 1, "keys": ["w"]} (held keys) or
        {"event_id": 2, "frames": [["w"], ["w", "j"], []]} (one block). Ids must increase."""
        try:
            return service.act(session_id, events, _viewer(request))
        except StreamError as exc:
            raise _user_error(exc) from None

    def stop(session_id: str, request: gr.Request) -> str:
        """Stop a session (its rollout stays downloadable)."""
        try:
            return service.stop(session_id, _viewer(request))
        except StreamError as exc:
            raise _user_error(exc) from None

    def stop_from_page(session_id, request: gr.Request):
        """Stop, and offer the rollout for download at once."""
        try:
            message = service.stop(session_id, _viewer(request))
            mp4, replay = service.download(session_id, _viewer(request))
        except StreamError as exc:
            return (str(exc) if session_id else "stopped"), None, None
        return message, str(mp4), str(replay)

    def reset(session_id, image, prompt, seed, request: gr.Request):
        owner, view = truth_views.get(session_id.strip(), (None, None)) if isinstance(session_id, str) else (None, None)
        if view is not None and owner == _viewer(request):  # before the reset: its block 0 may follow at once
            view.switch_world(recognise(image))
        try:
            return service.reset(session_id, image, prompt, seed, _viewer(request))
        except StreamError as exc:
            raise _user_error(exc) from None

    def download(session_id, request: gr.Request):
        try:
            mp4, replay = service.download(session_id, _viewer(request))
        except StreamError as exc:
            raise _user_error(exc) from None
        return str(mp4), str(replay)

    # The render's blocks are made on the engine's model between live blocks (engine.render). On ZeroGPU the
    # decorated call runs in a forked GPU worker, where the engine has no worker thread and renders in the
    # calling thread.
    @spaces.GPU(duration=300)
    def generate_on_gpu(image, prompt, seed, script_text, script_file, poses_file, intrinsics_file, example_files,
                        owner, progress):
        return generate_offline(engine, image, prompt, seed, script_text, script_file, poses_file,
                                intrinsics_file, workdir / "offline", Path(get_upload_folder()), offline_max_blocks,
                                example_files, owner, progress)

    def generate(image, prompt, seed, script_text, script_file, poses_file, intrinsics_file, example_files=None,
                 request: gr.Request = None, progress=gr.Progress()):
        owner = getattr(request.client, "host", None) if request is not None else None

        def tell(state):  # the visitor's place in line, then each block made
            if state.position:
                progress(0.0, desc=state.describe())
            else:
                progress((state.blocks_done, state.blocks_total), desc=state.describe(), unit="blocks")

        try:
            return generate_on_gpu(image, prompt, seed, script_text, script_file, poses_file, intrinsics_file,
                                   example_files, owner, tell)
        except StreamError as exc:
            raise _user_error(exc) from None

    def close_tab(request: gr.Request):
        service.close_viewer(request.session_hash)

    examples = world_examples() if world_model else []
    examples = examples or [[str(EXAMPLES / name), text] for name, text in PHOTO_EXAMPLES]
    warm_examples(engine, examples)
    with gr.Blocks(title="LingBot-World v2", delete_cache=delete_cache) as demo:
        header = gr.Markdown(_header(config, engine))
        with gr.Tab("Play"):
            with gr.Row():
                with gr.Column(scale=2):
                    image = start_image(label="Start image", height=260)
                    picture_info = gr.Markdown(elem_id="lingbot-picture-note")
                    if world_model:
                        new_world_button = gr.Button("New world", size="sm", elem_id="lingbot-new-world")
                    prompt = gr.Textbox(label="Prompt", value=examples[0][1], max_lines=3)
                    # No rounding (precision=None): parse_seed refuses 1.5 instead of playing seed 2.
                    seed = gr.Number(label="Seed", value=0)
                    gr.Examples(examples, inputs=[image, prompt],
                                label="Examples: held-out worlds" if world_model else "Examples")
                    truth_box = gr.Checkbox(label="Ground truth", value=False, visible=world_model,
                                            info="render the true world along the same camera path beside the "
                                                 "stream, with PSNR (world pictures only)")
                    with gr.Row():
                        start_button = gr.Button("Start", variant="primary", min_width=80)
                        stop_button = gr.Button("Stop", variant="stop", min_width=80)
                        reset_button = gr.Button("Reset", min_width=80)
                with gr.Column(scale=3):
                    with gr.Row():
                        video = gr.Video(label="World", streaming=True, autoplay=True, interactive=False,
                                         elem_id="lingbot-video", height=360)
                        # The socket player's canvas (page/player.js); the page shows it or the video above.
                        gr.HTML(f'<div id="lingbot-canvas-box" style="display:none"><canvas id="lingbot-canvas" '
                                f'width="{config.width}" height="{config.height}" style="width:100%;max-height:360px;'
                                f'object-fit:contain;image-rendering:auto;background:#000"></canvas></div>')
                        truth_video = gr.Video(label="Ground truth", streaming=True, autoplay=True,
                                               interactive=False, elem_id="lingbot-truth", height=360,
                                               visible=False)
                    telemetry = gr.Markdown("press Start", elem_id="lingbot-telemetry")
                    with gr.Row(elem_id="lingbot-keys"):
                        for group in (KEYS[:4], KEYS[4:]):
                            with gr.Column(min_width=200):
                                for row in ((None, group[0], None), group[1:]):  # an inverted T: W over A S D
                                    with gr.Row():
                                        for cell in row:
                                            if cell is None:  # a blank beside the top key
                                                gr.HTML("", min_width=60)
                                                continue
                                            key, action = cell
                                            gr.Button(f"{key.upper()}\n{action}", elem_id=f"lingbot-key-{key}",
                                                      size="sm", min_width=60)
                    gr.Markdown("Hold keys on the keyboard (outside text fields) or press the buttons: "
                                "**W A S D** move, **I J K L** look. Keys act from the next block on.")
                    session_box = gr.Textbox(label="Session", interactive=False, elem_id="lingbot-session",
                                             max_lines=1)
                    with gr.Row(equal_height=True):
                        download_button = gr.Button("Prepare download", size="sm", min_width=120)
                        mp4_file = gr.DownloadButton("Rollout MP4", size="sm", min_width=120, elem_id="lingbot-mp4")
                        replay_file = gr.DownloadButton("Replay JSON", size="sm", min_width=120,
                                                        elem_id="lingbot-replay")
            events_box = gr.Textbox(visible="hidden", elem_id="lingbot-events")
            send_button = gr.Button("send", visible="hidden", elem_id="lingbot-send")
            playhead_box = gr.Textbox(visible="hidden", elem_id="lingbot-playhead")
            ticket_box = gr.Textbox(visible="hidden", elem_id="lingbot-ticket")
            clock_button = gr.Button("clock", visible="hidden", elem_id="lingbot-clock")
            api_start_button = gr.Button("start-api", visible="hidden")  # /start: API clients only
        with gr.Tab("Offline generation"):
            with gr.Row():
                with gr.Column():
                    off_image = start_image(label="Start image", height=200, value=examples[0][0])
                    off_prompt = gr.Textbox(label="Prompt", value=examples[0][1])
                    off_seed = gr.Number(label="Seed", value=0)  # unrounded: parse_seed refuses 1.5
                    script = gr.Code(label="Action script (JSONL: one event per block)", language=None,
                                     value=(EXAMPLES / "walk.jsonl").read_text())
                    script_file = gr.File(label="…or a .jsonl script file", file_types=[".jsonl", ".txt", ".json"])
                    with gr.Row():
                        poses = gr.File(label="…or poses.npy [F,4,4]", file_types=[".npy"])
                        intrinsics = gr.File(label="+ intrinsics.npy [F,4]", file_types=[".npy"])
                    # The official repository's examples/00/ etc.: its image and prompt replace the fields above.
                    example_files = gr.File(label="…or an official example folder: drop its files together "
                                                  "(image.jpg, prompt.txt, poses.npy, intrinsics.npy)",
                                            file_count="multiple", file_types=[".npy", ".jpg", ".jpeg", ".png", ".txt"])
                    generate_button = gr.Button("Generate", variant="primary")
                with gr.Column():
                    off_video = gr.Video(label="Result", interactive=False)
                    off_message = gr.Markdown()

        start_event = start_button.click(play, [image, prompt, seed, truth_box],
                                         [video, truth_video, telemetry, session_box], api_name="play",
                                         concurrency_limit=None, show_progress="hidden")
        api_start_event = api_start_button.click(start, [image, prompt, seed], [video, telemetry, session_box],
                                                 api_name="start", concurrency_limit=None, show_progress="hidden")
        image.change(describe_picture, [image], [picture_info], api_visibility="private", show_progress="hidden")
        image.change(prewarm_picture, [image], None, api_visibility="private", show_progress="hidden")
        truth_box.change(lambda on: gr.update(visible=bool(on)), [truth_box], [truth_video],
                         api_visibility="private", show_progress="hidden")
        if renderer is not None:  # ticking the box starts the render process, so Start does not wait for it
            truth_box.change(lambda on: renderer.warm() if on else None, [truth_box], None,
                             api_visibility="private", show_progress="hidden")
        if world_model:
            new_world_button.click(new_world, None, [image, picture_info], api_name="new_world")
        send_button.click(act_from_page, [session_box, events_box], [events_box], js=TAKE_EVENTS_JS,
                          trigger_mode="multiple", concurrency_limit=1, concurrency_id="act",
                          api_visibility="private", show_progress="hidden")
        session_box.change(issue_ticket, [session_box], [ticket_box], api_visibility="private", show_progress="hidden",
                           queue=False)
        if isinstance(engine, StartingEngine):  # the header the page was served with may say "loading"
            def loaded_header() -> str:
                engine.engine()  # waits for the model
                return _header(config, engine)

            demo.load(loaded_header, None, [header], api_visibility="private", show_progress="hidden")
        ticket_box.change(None, [ticket_box], None, js="(t) => { if (window.lingbotPlayer) window.lingbotPlayer.connect(t); }",
                          api_visibility="private", show_progress="hidden", queue=False)
        clock_button.click(playhead_from_page, [session_box, playhead_box], [playhead_box], js=READ_PLAYHEAD_JS,
                           trigger_mode="always_last", api_visibility="private", show_progress="hidden", queue=False)
        stop_button.click(stop_from_page, [session_box], [telemetry, mp4_file, replay_file],
                          cancels=[start_event, api_start_event],
                          api_visibility="private", show_progress="hidden")
        reset_button.click(reset, [session_box, image, prompt, seed], [telemetry], api_name="reset",
                           show_progress="hidden")
        download_button.click(download, [session_box], [mp4_file, replay_file], api_name="download")
        generate_button.click(generate, [off_image, off_prompt, off_seed, script, script_file, poses, intrinsics,
                                         example_files],
                              [off_video, off_message], api_name="generate",
                              concurrency_limit=engine.config.renders.max_renders)  # the render line bounds and orders them
        gr.api(act, api_name="act", concurrency_limit=1, concurrency_id="act")
        gr.api(stop, api_name="stop")
        demo.unload(close_tab)
    # The protocol is served over a local engine only: with remote servers, their own endpoints serve it.
    realtime = RealtimeServer(engine, serve_config, gate=service.gate)
    video = VideoStreamServer(engine, serve_config, gate=service.gate)
    live = LiveSocket(service, serve_config.allowed_origins)
    return DemoApp(demo, service, owned, renderer, realtime, live, video)


def _header(config, engine: Backend) -> str:
    """The page's header; while the model loads behind the page (StartingEngine), it says so."""
    where = ("The model is loading; Start waits for it." if isinstance(engine, StartingEngine) and not engine.loaded
             else f"Up to {engine.capacity} worlds at once. {engine.describe()}")
    text = (f"# LingBot-World v2 — realtime world model\n"
            f"Model **{config.name}**, {config.width}×{config.height} at {config.fps} FPS, "
            f"{config.pixel_frames_per_block} frames per block. {where}").rstrip()
    if not config.trained:
        text += ("\n\n> ⚠️ **These weights are random (untrained).** The embedded model shows the machinery — "
                 "streaming, controls, sessions — not a meaningful world. Run with `--model` pointing at the real "
                 "checkpoint for real pictures.")
    elif is_world_model(config):
        text += ("\n\n> The embedded model is a **small model trained on a procedural 3D world** (seeded skies, "
                 "ground, trees, rocks, houses and pillars; `lingbot_core/world/`), never on real footage. This is "
                 "an undertrained checkpoint: it draws a blurred version of the start picture and moves it with the "
                 "keys, about as far as the true camera at first and less far over long holds (its model card in "
                 "`lingbot_core/embedded_model/` has the figures). Start "
                 "from one of its worlds (an example or **New world**) and tick **Ground truth** to see the true "
                 "world beside it. For real pictures run the real checkpoint with `--model`.")
    return text


# ---------------------------------------------------------------------------------------------
# Command line


BACKENDS = ("local", "sglang", "vllm-omni")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=BACKENDS, default=os.environ.get("LINGBOT_BACKEND") or "local",
                        help="local (default): run the model here; sglang / vllm-omni: play every world on a pool "
                             "of SGLang / vLLM-Omni realtime servers (one world per server) and load no model; "
                             "default $LINGBOT_BACKEND (a Space sets it there, having no command line)")
    parser.add_argument("--sglang-url", action="append", default=[], metavar="URL",
                        help="a realtime server, ws://host:port (repeat for each; default $LINGBOT_SGLANG_URLS, "
                             "comma separated); with --backend sglang")
    parser.add_argument("--vllm-omni-url", action="append", default=[], metavar="URL",
                        help="a vLLM-Omni realtime server, ws://host:port (repeat for each; default "
                             "$LINGBOT_VLLM_OMNI_URLS, comma separated); with --backend vllm-omni")
    add_engine_arguments(parser)
    parser.add_argument("--offline-max-blocks", type=int, default=64)
    parser.add_argument("--host", help="default $GRADIO_SERVER_NAME or 127.0.0.1")
    parser.add_argument("--port", type=int, help="default $GRADIO_SERVER_PORT or 7860")
    args = parser.parse_args(argv)
    if args.backend not in BACKENDS:  # argparse checks a given value, not a default from the environment
        parser.error(f"LINGBOT_BACKEND must be one of {', '.join(BACKENDS)}, got {args.backend!r}")

    # Everything this process writes, Gradio's cache included (unless GRADIO_TEMP_DIR is set), goes in one
    # work folder that is removed on exit; folders left by dead processes are removed first. SIGTERM
    # stops the server as Ctrl-C does, so the cleanup runs.
    workdir = WorkFolder.create()
    atexit.register(workdir.remove)
    os.environ.setdefault("GRADIO_TEMP_DIR", str(workdir.path / "gradio"))
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    log = StartupLog()
    if workdir.swept:
        log.note(f"removed {len(workdir.swept)} work folder(s) left by ended processes")
    startup_line(log)
    if args.sglang_url and args.backend != "sglang":
        parser.error("--sglang-url needs --backend sglang")
    if args.vllm_omni_url and args.backend != "vllm-omni":
        parser.error("--vllm-omni-url needs --backend vllm-omni")
    if args.backend != "local":  # no model here: the servers hold it (lingbot_core/protocols/*/backend.py)
        create, urls = {"sglang": (create_remote_engine, args.sglang_url),
                        "vllm-omni": (create_vllm_omni_engine, args.vllm_omni_url)}[args.backend]
        try:
            engine = create(urls, args.model, EngineConfig(idle_ttl_s=args.idle_ttl))
        except ValueError as exc:
            parser.error(str(exc))
        log.note(f"remote backend: {engine.capacity} {engine.protocol} realtime server(s), model config "
                 f"{engine.model_config.name} ({engine.model_config.width}x{engine.model_config.height})")
    else:
        # The page first: the model's config comes from its files, and the model loads once the page is up.
        engine = start_local_engine(args, log, behind_page=True)
    with log.stage("build the page"):
        app = build_demo(engine, stream_config=StreamConfig(max_streams_per_address=args.max_per_address),
                         offline_max_blocks=args.offline_max_blocks, workdir=workdir,
                         serve_config=ServeConfig(allowed_origins=tuple(args.allow_origin)))
    try:
        _, url, _ = app.launch(server_name=args.host, server_port=args.port, prevent_thread_lock=True)
        base = url.replace('http', 'ws', 1).rstrip('/')
        protocol = f"; realtime protocols at {base}{GENERATE_PATH} (SGLang) and {base}{VIDEO_PATH} (vLLM-Omni)"
        if isinstance(engine, StartingEngine):
            log.note(f"ready at {url}; the model loads behind the page{protocol}")
            threading.Thread(target=_load_behind_page, args=(engine, log), name="lingbot-model-load",
                             daemon=True).start()
        else:
            log.note(f"ready at {url} ({engine.capacity} worlds at once){protocol}")
        app.demo.block_thread()  # returns on Ctrl-C, SIGTERM, or a model that failed to load behind the page
    except KeyboardInterrupt:  # before the server blocked
        if not (isinstance(engine, StartingEngine) and engine.error is not None):
            raise
    finally:
        app.close()
        engine.shutdown()
    if isinstance(engine, StartingEngine) and engine.error is not None:
        raise SystemExit(f"error: the model failed to load: {engine.error}")


def _load_behind_page(engine: StartingEngine, log: StartupLog) -> None:
    """Load the model behind the served page; a failure stops the app (main says why)."""
    try:
        engine.load()
    except BaseException:  # noqa: BLE001  (main reports it as it exits)
        # As the SIGTERM main installed a handler for, not SIGINT: a process started with SIGINT ignored (a
        # background job of a script, nohup) keeps it ignored, and interrupt_main() of an ignored signal
        # does nothing, which left the page up with no model behind it.
        _thread.interrupt_main(signal.SIGTERM)
        return
    log.note(f"the model is ready: {engine.capacity} worlds at once")


if __name__ == "__main__":
    main()
