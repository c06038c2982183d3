"""The attacks of issue 10, each replayed against the running app (tiny model, gradio_client and raw HTTP).

Each app-level test keeps a healthy viewer streaming while the attack runs and checks that it goes on
receiving blocks. The attacks: image bombs (a 260-byte 60000x1 PNG, a 17 KB 12000x12000 1-bit PNG) and
image work on the model thread; an event that poisons every later block; a second client driving a
world by its displayed id; ten fire-and-forget requests that fill every seat and place in line; files
that are never removed (the app is restarted, killed and counted); Gradio streams of API sessions
that are never freed; and the small ones (a 10 MB id echoed back, a rounded seed, raw Python errors,
non-rigid or 1e308-scaled poses, an object repr in a message).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image, ImageFile

sys.path.insert(0, str(Path(__file__).resolve().parent))

from app_driver import FOREST, ROOT, VILLAGE, Viewer, free_port, wait_until  # noqa: E402
from gradio_client import Client, handle_file  # noqa: E402
from gradio_client.exceptions import AppError  # noqa: E402
from lingbot_core.boundary.events import EventError, parse_actions, parse_event_line  # noqa: E402
from lingbot_core.boundary.image import MAX_ASPECT_RATIO, MAX_IMAGE_PIXELS, ImageError, fit_image, load_image  # noqa: E402
from lingbot_core.model.camera import TrajectoryError, validate_trajectory  # noqa: E402
from lingbot_core.serving.contract import EngineConfig, Failed
from lingbot_core.serving.engine import Engine, NewWorld  # noqa: E402
from lingbot_core.boundary.requests import RequestError, parse_seed, parse_start  # noqa: E402
from lingbot_core.serving.streaming import StreamConfig, StreamError  # noqa: E402
from lingbot_core.boundary.user_text import quote  # noqa: E402
from lingbot_core.process.workdir import PREFIX, WorkFolder, remove_stale  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:::gradio.queueing")

ATTACKER = "127.0.0.2"  # another client address on the loopback (the server listens on 127.0.0.1)
UNREAD_S = 3.0


# The `server` fixture (conftest.py): two seats and eight places in line; an address may hold two streams;
# unread streams end after 3 s; idle_ttl_s: the healthy viewer lives through the slowest test.
APP_SERVER = dict(engine=EngineConfig(max_sessions=2, max_waiting=8, idle_ttl_s=1800),
                  stream=StreamConfig(unread_timeout_s=UNREAD_S, max_streams_per_address=2, keep_ended_stream_s=0.5),
                  build=dict(offline_max_blocks=4))


@pytest.fixture
def healthy(server):
    """A viewer playing throughout the test; at the end it must still be receiving blocks."""
    viewer = Viewer(server[0])
    yield viewer
    viewer.wait_for_blocks(2, "the healthy session to keep streaming after the attack")
    viewer.stop()


def raw_http(url: str, address: str = ATTACKER) -> httpx.Client:
    """An HTTP client whose connections come from `address` (any 127.x.y.z is this machine)."""
    return httpx.Client(base_url=url, timeout=60, transport=httpx.HTTPTransport(local_address=address))


def upload(http: httpx.Client, path: Path) -> dict:
    with path.open("rb") as f:
        paths = http.post("gradio_api/upload", files={"files": (path.name, f, "image/png")}).json()
    return {"path": paths[0], "orig_name": path.name, "meta": {"_type": "gradio.FileData"}}


def sse_events(http: httpx.Client, api: str, event_id: str, on_event=None, timeout_s: float = 60):
    """(event, data) pairs of a /call result stream, read to its end; on_event(event, data) sees each."""
    seen = []
    with http.stream("GET", f"gradio_api/call/{api}/{event_id}", timeout=timeout_s) as response:
        event = None
        for line in response.iter_lines():
            if line.startswith("event:"):
                event = line.split(":", 1)[1].strip()
            elif line.startswith("data:"):
                seen.append((event, json.loads(line.split(":", 1)[1])))
                if on_event is not None:
                    on_event(*seen[-1])
    return seen


# ---------------------------------------------------------------------------------------------
# 1. Image bombs and image work on the model thread


def test_image_bombs_are_refused_from_the_header_without_decoding(server, healthy, tmp_path, monkeypatch):
    url, engine, _ = server
    strip = tmp_path / "strip.png"
    Image.new("RGB", (60000, 1)).save(strip)
    bitmap = tmp_path / "bitmap.png"
    Image.new("1", (12000, 12000)).save(bitmap)
    assert strip.stat().st_size < 1000 and bitmap.stat().st_size < 20_000

    decoded = []  # every image whose pixels anything in this process decodes while the attack runs
    load = ImageFile.ImageFile.load

    def recording_load(self):
        decoded.append(self.size)
        return load(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", recording_load)
    attacker = Client(url, verbose=False, download_files=False)
    with pytest.raises(AppError, match="aspect ratio of 60000:1"):
        attacker.predict(handle_file(str(strip)), "a forest", 0, api_name="/start")
    with pytest.raises(AppError, match=f"at most {MAX_IMAGE_PIXELS} pixels"):
        attacker.predict(handle_file(str(bitmap)), "a forest", 0, api_name="/start")
    with pytest.raises(AppError, match="aspect ratio"):  # a reset of one's own world is checked the same way
        healthy.client.predict(healthy.session_id, handle_file(str(strip)), "a forest", 1, api_name="/reset")
    oversized = [(w, h) for w, h in decoded if w * h > MAX_IMAGE_PIXELS or max(w, h) / min(w, h) > MAX_ASPECT_RATIO]
    assert oversized == [], f"decoded before being refused: {oversized}"
    assert healthy.session_id in engine.session_ids()
    attacker.close()


def test_image_decoding_and_resizing_never_run_on_the_model_thread(server, healthy, tmp_path, monkeypatch):
    url, engine, _ = server
    large = tmp_path / "large.png"
    Image.open(FOREST).resize((2400, 1600)).save(large)
    threads = []
    resize, load = Image.Image.resize, ImageFile.ImageFile.load

    def recording_resize(self, *args, **kwargs):
        threads.append(threading.current_thread().name)
        return resize(self, *args, **kwargs)

    def recording_load(self):
        threads.append(threading.current_thread().name)
        return load(self)

    monkeypatch.setattr(Image.Image, "resize", recording_resize)
    monkeypatch.setattr(ImageFile.ImageFile, "load", recording_load)
    viewer = Viewer(url, image=large)  # admission
    try:
        message = viewer.client.predict(viewer.session_id, handle_file(str(VILLAGE)), "a village", 3, api_name="/reset")
        assert message == "reset: a new world from seed 3"
        viewer.wait_for_blocks(2)
    finally:
        viewer.stop()
    assert threads, "no image was decoded or resized: the test saw nothing"
    assert engine._worker.name not in threads, f"image work ran on the model thread: {threads}"


def test_load_image_refuses_from_the_header_before_any_pixel_is_decoded(tmp_path, monkeypatch):
    def no_decoding(self):
        raise AssertionError(f"decoded a {self.size} image")

    cases = {"strip.png": (Image.new("RGB", (60000, 1)), "aspect ratio"),
             "tall.png": (Image.new("L", (100, 900)), "aspect ratio of 9:1"),
             "bitmap.png": (Image.new("1", (12000, 12000)), "at most 40000000 pixels"),
             "wide-pixels.tiff": (Image.new("I", (64, 64)), "pixel mode 'I'")}
    for name, (image, _) in cases.items():
        image.save(tmp_path / name)
    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decoding)
    for name, (_, message) in cases.items():
        with pytest.raises(ImageError, match=message):
            load_image(tmp_path / name)
        with pytest.raises(ImageError, match=message):
            load_image((tmp_path / name).read_bytes())


def test_fit_image_is_the_centre_crop_resampled_to_the_frame():
    rng = np.random.default_rng(0)
    # Scale 1: exactly the centre crop.
    tall = Image.fromarray(rng.integers(0, 256, (200, 224, 3), dtype=np.uint8))
    np.testing.assert_array_equal(np.asarray(fit_image(tall, 128, 224)), np.asarray(tall)[36:164])
    # Scale 2: the centre 112x64 upsampled. Resampling inside the source, the box also reads the pixels
    # around the crop, so only the frame's border (the filter's reach) may differ from crop-then-resize.
    wide = Image.fromarray(rng.integers(0, 256, (64, 224, 3), dtype=np.uint8))
    reference = np.asarray(wide.crop((56, 0, 168, 64)).resize((224, 128), Image.Resampling.BICUBIC))
    np.testing.assert_array_equal(np.asarray(fit_image(wide, 128, 224))[4:-4, 4:-4], reference[4:-4, 4:-4])
    same = Image.fromarray(rng.integers(0, 256, (128, 224, 3), dtype=np.uint8))
    np.testing.assert_array_equal(np.asarray(fit_image(same, 128, 224)), np.asarray(same))


def test_unreadable_images_are_named_without_object_reprs(tmp_path):
    for name, data in [("notes.png", b"these are not pixels " * 20), ("drawing.svg", b"<svg garbage")]:
        (tmp_path / name).write_bytes(data)
        for source in (tmp_path / name, data):
            with pytest.raises(ImageError, match="not a readable image") as caught:
                load_image(source)
            assert "0x" not in str(caught.value) and "BytesIO" not in str(caught.value)
    truncated = tmp_path / "truncated.png"
    truncated.write_bytes(FOREST.read_bytes()[:2000])
    with pytest.raises(ImageError, match="truncated or corrupt"):
        load_image(truncated)


# ---------------------------------------------------------------------------------------------
# 2. One event must not brick a session


def test_a_prompt_that_is_not_unicode_text_is_refused_at_the_boundary(server, healthy):
    _, engine, _ = server
    poisoned = '{"event_id": 1, "keys": [], "prompt": "a\\ud800b"}'  # legal JSON: a lone surrogate
    with pytest.raises(AppError, match="not valid Unicode text"):
        healthy.client.predict(healthy.session_id, poisoned, api_name="/act")
    assert healthy.act(2, ["w"]) == "queued 1 event(s)"
    healthy.wait_for_blocks(3)
    assert engine.session_status(healthy.session_id)["status"] == "active"
    with pytest.raises(ValueError, match="not valid Unicode text"):
        parse_start(FOREST, "a\ud800b", 0, engine.pipeline.config)


def _poison_prompt_switches(pipeline, monkeypatch) -> None:
    """Make switching to the prompt "poison" raise inside the block step, as a broken event would."""
    pipeline_type = type(pipeline)
    with_prompt = pipeline_type.with_prompt

    def failing_with_prompt(self, state, prompt):
        if prompt == "poison":
            raise RuntimeError("this prompt cannot be applied")
        return with_prompt(self, state, prompt)

    monkeypatch.setattr(pipeline_type, "with_prompt", failing_with_prompt)


def test_an_event_whose_application_fails_is_dropped_and_the_world_goes_on(server, healthy, monkeypatch):
    _, engine, _ = server
    _poison_prompt_switches(engine.pipeline, monkeypatch)
    victim = Viewer(server[0], seed=4)
    try:
        assert victim.act(1, ["w"]) == "queued 1 event(s)"
        victim.wait_for_blocks(2)  # event 1 applied on its own: the poisoned event is the next block's only input
        victim.client.predict(victim.session_id, json.dumps({"event_id": 2, "keys": [], "prompt": "poison"}),
                              api_name="/act")
        wait_until(lambda: any("event 2 could not be applied and was dropped" in t for t in victim.telemetry),
                   "the viewer to be told its event was dropped")
        note = next(t for t in victim.telemetry if "was dropped" in t)
        assert "this prompt cannot be applied" in note and note.endswith("the world goes on")
        victim.wait_for_blocks(3, "blocks after the dropped event, with no new input")  # it used to stop here
        replay = engine.replay(victim.session_id)
        assert all(2 not in block["event_ids"] for block in replay.blocks)
        assert engine.session_status(victim.session_id)["status"] == "active"
    finally:
        victim.stop()


def test_engine_drops_the_failing_events_and_runs_on_without_new_input(tiny_pipeline, start_image, monkeypatch,
                                                                      single_thread):
    """The same guarantee at the engine, block by block: the victim's next block runs without the event, the
    other session is untouched, and the dropped event never reaches the replay."""
    engine = Engine(tiny_pipeline, EngineConfig(memory_budget_bytes=1 << 32, max_sessions=2), start_worker=False)
    try:
        victim = engine.admit(parse_start(start_image, "a forest", 0, tiny_pipeline.config)).session_id
        other = engine.admit(parse_start(start_image, "a forest", 1, tiny_pipeline.config)).session_id
        _poison_prompt_switches(tiny_pipeline, monkeypatch)
        engine.post_event(victim, {"event_id": 1, "keys": ["w"], "prompt": "poison"})
        received = {victim: [], other: []}
        for _ in range(8):
            engine.run_once()
            for session_id, messages in received.items():
                message = engine.next_message(session_id, timeout=0)
                if message is not None and not isinstance(message, NewWorld):
                    messages.append(message)
        error, *blocks = received[victim]
        assert isinstance(error, Failed) and not error.waiting_for_input
        assert error.text == "event 1 could not be applied and was dropped: RuntimeError: this prompt cannot be applied"
        assert [b.block_index for b in blocks] == [0, 1, 2] and all(b.event_ids == () for b in blocks)
        assert [b.block_index for b in received[other]] == [0, 1, 2, 3]
        replay = engine.replay(victim)
        assert replay.prompt == "a forest" and all(frame == [] for b in replay.blocks for frame in b["frames"])
        assert engine.session_status(victim)["status"] == "active"
    finally:
        engine.shutdown()


# ---------------------------------------------------------------------------------------------
# 3. A world obeys only the client that started it


def test_another_client_cannot_drive_stop_reset_or_download_a_world(server, healthy):
    url, engine, _ = server
    session_id = healthy.session_id
    intruder = Client(url, verbose=False, download_files=False)
    attempts = [((session_id, '{"event_id": 50, "keys": ["w"]}'), "/act"),
                ((session_id, handle_file(str(VILLAGE)), "another world", 9), "/reset"),
                ((session_id,), "/download"),
                ((session_id,), "/stop")]
    for args, api in attempts:
        with pytest.raises(AppError, match="belongs to the page or API client that started it"):
            intruder.predict(*args, api_name=api)
    intruder.close()
    healthy.wait_for_blocks(2)
    assert session_id in engine.session_ids()
    replay = engine.replay(session_id)
    assert replay.seed == 0 and all(50 not in block["event_ids"] for block in replay.blocks)
    assert healthy.act(51, ["d"]) == "queued 1 event(s)"  # its owner still drives it


# ---------------------------------------------------------------------------------------------
# 4. Anonymous requests cannot lock everyone out


def test_pictures_are_decoded_after_the_claim_and_a_few_at_a_time(tiny_pipeline, start_image, tmp_path, monkeypatch):
    """Many simultaneous uploads cannot make the server decode them all at once: a client over its limit is
    refused before its picture is decoded, and at most `decode_slots` pictures are decoded together."""
    import asyncio

    from lingbot_core.boundary import requests
    from lingbot_core.serving import streaming

    active, peak, calls = [0], [0], []
    lock = threading.Lock()
    real_check = requests.parse_start

    def slow_check(image, prompt, seed, config):
        with lock:
            calls.append(prompt)
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        try:
            threading.Event().wait(0.2)  # a decode that takes a while, so overlaps would show
            return real_check(image, prompt, seed, config)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(requests, "parse_start", slow_check)
    engine = Engine(tiny_pipeline, EngineConfig(memory_budget_bytes=1 << 32, max_sessions=1, max_waiting=8),
                    start_worker=False)
    service = streaming.LiveService(engine, tmp_path / "recordings", StreamConfig(decode_slots=2))

    async def first_update(viewer: str, prompt: str):
        stream = service.stream(start_image, prompt, 0, viewer=viewer, address=f"10.0.0.{len(viewer)}")
        try:
            return (await stream.__anext__()).telemetry
        except StreamError as exc:
            return f"refused: {exc}"
        finally:
            await stream.aclose()

    async def attack():
        # viewer "a" sends twice at once; "bb", "ccc", "dddd", "eeeee" once each (distinct addresses)
        jobs = [first_update("a", "a1"), first_update("a", "a2")] + \
            [first_update(v, v) for v in ("bb", "ccc", "dddd", "eeeee")]
        return await asyncio.gather(*jobs)

    try:
        results = asyncio.run(attack())
    finally:
        service.shutdown()
        engine.shutdown()
    refused = [r for r in results if r.startswith("refused: this page (or API client) already has a world")]
    assert len(refused) == 1, results  # the second stream of "a" was refused...
    assert len(calls) == 5 and sorted(calls).count("a1") + sorted(calls).count("a2") == 1  # ...undecoded
    assert peak[0] == 2  # five decodes wanted at once, two ran at a time


def test_fire_and_forget_requests_cannot_take_every_seat_and_place_in_line(server, healthy):
    url, engine, _ = server
    with raw_http(url) as attacker:
        image = upload(attacker, FOREST)
        events = [attacker.post("gradio_api/call/start", json={"data": [image, "a forest", i]}).json()["event_id"]
                  for i in range(10)]
        wait_until(lambda: engine.stats()["active_sessions"] == 2, "the attacker to take the free seat")
        # A real user from another address gets a world once the unread requests have given theirs back.
        newcomer = Viewer(url, seed=7)
        try:
            with pytest.raises(AppError, match="already has a world running or waiting"):
                newcomer.client.predict(handle_file(str(FOREST)), "a forest", 8, api_name="/start")
            wait_until(lambda: engine.stats()["waiting"] == 0, "the unread tickets to leave the line")
            assert sorted(engine.session_ids()) == sorted([healthy.session_id, newcomer.session_id])
            newcomer.wait_for_blocks(2)
        finally:
            newcomer.stop()
        outcomes = [sse_events(attacker, "start", event_id) for event_id in events]
    refused = [o for o in outcomes if any(e == "error" and "your address already holds 2" in json.dumps(d)
                                          for e, d in o)]
    assert len(refused) == 8, outcomes


# ---------------------------------------------------------------------------------------------
# 6. A closed world's Gradio stream is released, whatever the client


def test_api_sessions_release_their_gradio_streams(server, healthy):
    url, _, app = server
    hashes = []
    with raw_http(url, "127.0.0.1") as http:
        image = upload(http, FOREST)
        for i in range(3):
            session_hash = f"api-{uuid.uuid4().hex}"
            hashes.append(session_hash)
            event_id = http.post("gradio_api/call/start",
                                 json={"data": [image, "a forest", i], "session_hash": session_hash}).json()["event_id"]
            segments = []

            def stop_after_two_segments(event, data):
                if event == "generating" and isinstance(data[0], dict) and data[0].get("url"):
                    segments.append(data)
                    if len(segments) == 2:  # Gradio holds the run's segments, for the playlist...
                        assert session_hash in app.demo.pending_streams
                        http.post("gradio_api/call/stop", json={"data": [data[2]], "session_hash": session_hash})

            outcome = sse_events(http, "start", event_id, on_event=stop_after_two_segments)
            assert len(segments) >= 2 and outcome[-1][0] == "complete", outcome[-3:]

    def held_segments():
        return sum(len(stream.segments) for h in hashes for run in app.demo.pending_streams.get(h, {}).values()
                   for stream in run.values())

    wait_until(lambda: held_segments() == 0 and not any(h in app.demo.pending_streams for h in hashes),
               "the ended streams to be released", timeout_s=30)  # ...and lets them go soon after


# ---------------------------------------------------------------------------------------------
# 7. The smaller ones


def test_small_attacks_get_short_plain_messages(server, healthy, tmp_path):
    url, _, _ = server
    client = Client(url, verbose=False, download_files=False)
    huge_id = "x" * 10_000_000
    with pytest.raises(AppError) as caught:
        client.predict(huge_id, '{"event_id": 1, "keys": []}', api_name="/act")
    assert "no session 'xxx" in str(caught.value) and "(10000000 characters)" in str(caught.value)
    assert len(str(caught.value)) < 500

    with pytest.raises(AppError, match="seed must be a whole number"):
        client.predict(handle_file(str(FOREST)), "a forest", 1.5, api_name="/start")
    with pytest.raises(AppError, match="seed must be a whole number"):
        client.predict(handle_file(str(FOREST)), "a forest", 1.5, '{"event_id": 0, "keys": ["w"]}', None, None, None,
                       api_name="/generate")

    own = healthy.client
    for events, message in [("[" * 50_000, "nested too deeply"),
                            ('{"event_id": 1' + "0" * 5000 + ', "keys": []}', "too many digits")]:
        with pytest.raises(AppError, match=message) as caught:
            own.predict(healthy.session_id, events, api_name="/act")
        assert "recursion" not in str(caught.value) and "sys.set_int_max_str_digits" not in str(caught.value)

    svg = tmp_path / "drawing.svg"
    svg.write_bytes(b"<svg not really")
    with pytest.raises(AppError, match="not a readable image") as caught:
        client.predict(handle_file(str(svg)), "a forest", 0, api_name="/start")
    assert "0x" not in str(caught.value) and "BytesIO" not in str(caught.value)

    frames = 9
    rigid = np.tile(np.eye(4), (frames, 1, 1))
    rigid[:, 2, 3] = np.linspace(0, 1, frames)
    intrinsics = np.tile([500.0, 500.0, 416.0, 240.0], (frames, 1))
    np.save(tmp_path / "intrinsics.npy", intrinsics)
    sheared = rigid.copy()
    sheared[:, 0, 1] = 0.5
    far = rigid.copy()
    far[:, 0, 3] = 1e12
    for name, poses, message in [("scaled", rigid * 1e308, "not orthonormal"), ("sheared", sheared, "not orthonormal"),
                                 ("far", far, "beyond the limit")]:
        np.save(tmp_path / f"{name}.npy", poses)
        with pytest.raises(AppError, match=message):
            client.predict(handle_file(str(FOREST)), "a forest", 0, "", None, handle_file(str(tmp_path / f"{name}.npy")),
                           handle_file(str(tmp_path / "intrinsics.npy")), api_name="/generate")
    with pytest.raises(AppError, match="too many digits"):
        client.predict(handle_file(str(FOREST)), "a forest", 0, '{"event_id": 1' + "0" * 5000 + ', "keys": []}',
                       None, None, None, api_name="/generate")
    client.close()


def test_messages_quote_values_briefly_and_name_the_problem():
    assert len(quote("y" * 10_000_000)) < 200 and "10000000 characters" in quote("y" * 10_000_000)
    assert len(quote([["z" * 5000] * 5000] * 5000)) < 200
    for bad in (1.5, "1.5", float("nan"), float("inf"), True, -1, 2**63):
        with pytest.raises(RequestError, match="whole number"):
            parse_seed(bad)
    assert parse_seed(2**62 + 1) == 2**62 + 1  # exact: not through a float
    with pytest.raises(EventError, match="nested too deeply"):
        parse_actions("[" * 50_000, 3)
    with pytest.raises(EventError, match="too many digits"):
        parse_event_line('{"event_id": 1' + "0" * 5000 + ', "keys": []}', 3)
    with pytest.raises(EventError, match="not valid Unicode text"):
        parse_event_line('{"event_id": 1, "keys": [], "prompt": "\\udfff"}', 3)
    with pytest.raises(EventError) as caught:
        parse_event_line(json.dumps({"event_id": 1, "keys": ["k" * 60000]}), 3)
    assert len(str(caught.value)) < 300


def test_pose_files_must_hold_rigid_bounded_poses():
    frames = 5
    poses = np.tile(np.eye(4), (frames, 1, 1))
    angle = np.linspace(0, 1, frames)
    poses[:, 0, 0] = poses[:, 2, 2] = np.cos(angle)
    poses[:, 0, 2], poses[:, 2, 0] = np.sin(angle), -np.sin(angle)
    poses[:, :3, 3] = np.linspace(0, 1, frames)[:, None]
    intrinsics = np.tile([500.0, 500.0, 416.0, 240.0], (frames, 1))
    validate_trajectory(poses.astype(np.float32), intrinsics)  # float32 rounding is well within tolerance
    for change, message in [(lambda p: p * 1e308, "not orthonormal"), (lambda p: p * 2.0, "not orthonormal"),
                            (lambda p: p @ np.diag([1.0, 1.3, 1.0, 1.0]), "not orthonormal"),
                            (lambda p: p + np.pad(np.full((frames, 3, 1), 2e6), ((0, 0), (0, 1), (3, 0))),
                             "beyond the limit")]:
        with pytest.raises(TrajectoryError, match=message):
            validate_trajectory(change(poses.copy()), intrinsics)


# ---------------------------------------------------------------------------------------------
# 5. Files: removed on close, on SIGTERM, and after kill -9 at the next start-up


def _start_app(tmp: Path, port: int) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "GRADIO_TEMP_DIR"}
    env.update(TMPDIR=str(tmp), LINGBOT_TEST_PRESET="tiny", GRADIO_ANALYTICS_ENABLED="False")
    process = subprocess.Popen([sys.executable, str(ROOT / "app.py"), "--port", str(port), "--host", "127.0.0.1",
                                "--max-sessions", "2"], env=env, cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def ready():
        assert process.poll() is None, f"the app exited with {process.returncode}"
        try:
            return httpx.get(f"http://127.0.0.1:{port}/gradio_api/info", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(ready, "the app to start")
    return process


def _files(tmp: Path) -> list[Path]:
    return [p for p in tmp.rglob("*") if p.is_file()]


def _play_and_download(url: str) -> None:
    client = Client(url, verbose=False, download_files=False)
    job = client.submit(handle_file(str(FOREST)), "a forest", 0, api_name="/start")
    wait_until(lambda: sum(isinstance(o[0], dict) for o in job.outputs()) >= 2, "two blocks")
    session_id = next(o[2] for o in job.outputs() if o[2])
    for _ in range(4):
        client.predict(session_id, api_name="/download")
    client.predict(session_id, api_name="/stop")
    wait_until(job.done, "the stream to end")
    client.close()


@pytest.mark.slow  # a minute or more on 2 cores: .ci/run runs it, the fast suite does not
def test_the_app_leaves_no_files_after_sigterm_or_after_kill_and_restart(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    port = free_port()
    url = f"http://127.0.0.1:{port}/"

    process = _start_app(tmp, port)
    try:
        _play_and_download(url)
        [folder] = tmp.glob(PREFIX + "*")
        exports = list(folder.glob("recordings/*/export-*"))
        assert 1 <= len(exports) <= 2, exports  # four downloads, at most two exports kept
        assert any(p.is_relative_to(folder / "gradio") for p in _files(tmp))  # Gradio's cache is in the folder
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=120)
    # Gradio makes an empty default cache folder when imported, before the app points it into its work folder.
    assert _files(tmp) == [] and list(tmp.glob(PREFIX + "*")) == []

    process = _start_app(tmp, port)
    _play_and_download(url)
    [killed] = tmp.glob(PREFIX + "*")
    process.kill()  # SIGKILL: nothing of this process runs any more
    process.wait(timeout=60)
    assert killed.exists() and len(_files(killed)) > 3

    process = _start_app(tmp, port)  # the next start removes what the dead one left
    try:
        assert not killed.exists()
        assert len(list(tmp.glob(PREFIX + "*"))) == 1
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=120)
    assert _files(tmp) == [] and list(tmp.glob(PREFIX + "*")) == []


def test_only_work_folders_of_ended_processes_are_swept(tmp_path):
    code = ("import sys, time; sys.path.insert(0, sys.argv[1]); from lingbot_core.process.workdir import WorkFolder; "
            "f = WorkFolder.create(sys.argv[2]); print(f.path, flush=True); time.sleep(600)")
    alive = subprocess.Popen([sys.executable, "-c", code, str(ROOT), str(tmp_path)], stdout=subprocess.PIPE, text=True)
    dead = subprocess.Popen([sys.executable, "-c", code, str(ROOT), str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        alive_path, dead_path = Path(alive.stdout.readline().strip()), Path(dead.stdout.readline().strip())
        dead.kill()
        dead.wait(timeout=30)
        foreign = tmp_path / (PREFIX + "without-a-lock")  # not made by WorkFolder: never touched
        foreign.mkdir()
        mine = WorkFolder.create(tmp_path)
        assert mine.swept == [dead_path] and not dead_path.exists()
        assert alive_path.exists() and foreign.exists() and remove_stale(tmp_path) == []  # mine is held too
        mine.remove()
        assert not mine.path.exists()
    finally:
        alive.kill()
        alive.wait(timeout=30)


def test_offline_outputs_do_not_pile_up_or_leak_descriptors(tiny_pipeline, start_image, tmp_path):
    """Each /generate call made a new MP4 in the work folder for the process's whole life and left its
    mkstemp descriptor open; now a call closes its descriptor and removes outputs Gradio copied long ago."""
    import time

    import app as lingbot_app

    out_dir = tmp_path / "offline"
    out_dir.mkdir()
    stale, recent = out_dir / "lingbot-offline-stale.mp4", out_dir / "lingbot-offline-recent.mp4"
    for path in (stale, recent):
        path.write_bytes(b"old output")
    hour_ago = time.time() - 3600
    os.utime(stale, (hour_ago, hour_ago))
    picture = tmp_path / "start.png"
    Image.fromarray(start_image).save(picture)
    script = json.dumps({"event_id": 1, "keys": ["w"]})
    engine = Engine(tiny_pipeline, EngineConfig(memory_budget_bytes=1 << 32, max_sessions=1), start_worker=False)
    descriptors = len(os.listdir("/proc/self/fd"))
    outputs = [lingbot_app.generate_offline(engine, str(picture), "a forest", 0, script, None, None, None,
                                            out_dir, tmp_path, max_blocks=2)[0] for _ in range(3)]
    engine.shutdown()
    assert len(os.listdir("/proc/self/fd")) == descriptors
    assert not stale.exists() and recent.exists()
    assert all(Path(out).stat().st_size > 0 for out in outputs)
