"""The app end to end: gradio_client against app.py served on 127.0.0.1, on the tiny test model.

What must hold: a started world streams H.264 segments and takes actions; what was streamed is what
the download holds and what the replay regenerates; every way out (stop, disconnect, input idle, tab
close, generator exit) leaves the engine with no session; a full server puts newcomers in line with a
readable position; bad input gets a message and the server keeps serving; the offline endpoint
makes the same MP4 as the offline command's path, 12N - 3 frames for N events.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))

from app_driver import FOREST, ROOT, VILLAGE, stream_outputs, wait_until  # noqa: E402
from gradio_client import Client, handle_file  # noqa: E402
from gradio_client.exceptions import AppError  # noqa: E402
from lingbot_core.boundary.events import read_events  # noqa: E402
from lingbot_core.boundary.offline import controls_from_events, write_rollout  # noqa: E402
from lingbot_core.boundary.image import fit_image, image_digest, load_image  # noqa: E402
from lingbot_core.boundary.requests import BlockControl  # noqa: E402
from lingbot_core.serving.contract import EngineConfig  # noqa: E402
from lingbot_core.boundary.events import EventError, KeyStateEvent, parse_actions  # noqa: E402
from lingbot_core.boundary.requests import RequestError, parse_seed  # noqa: E402
from lingbot_core.serving.contract import Block  # noqa: E402
from lingbot_core.serving.pacing import AdaptiveLead, PlaybackClock  # noqa: E402
from lingbot_core.serving.streaming import LiveService, StreamConfig, StreamError  # noqa: E402
from lingbot_core.serving.telemetry import telemetry_line  # noqa: E402
from lingbot_core.boundary.video import count_frames, frames_to_uint8, mp4_segment  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:::gradio.queueing")  # pandas deprecations in Gradio's analytics


# lead_s large: the API tests take blocks as fast as they come (pacing is tested on its own and in the browser)
APP_SERVER = dict(engine=EngineConfig(max_sessions=2, max_waiting=1, idle_ttl_s=120), stream=StreamConfig(lead_s=1e6),
                  build=dict(offline_max_blocks=16))  # the `server` fixture (conftest.py)


def decode(path: Path) -> np.ndarray:
    import av
    with av.open(str(path)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(container.streams.video[0])])


def download(url: str, target: Path) -> Path:
    target.write_bytes(httpx.get(url, timeout=30).content)
    return target


def regenerate_as_streamed(engine, image: Path, replay: dict, tmp_path: Path) -> np.ndarray:
    """The replay run offline (same image, prompt, seed, one block per recorded block), each block
    encoded as the stream encodes it, then decoded: x264 is deterministic, so this is exact."""
    controls = [BlockControl(actions=tuple(frozenset(f) for f in block["frames"])) for block in replay["blocks"]]
    decoded = []
    for output in engine.pipeline.rollout(image, replay["prompt"], replay["seed"], controls):
        segment = tmp_path / f"regenerated-{output.block_index}.mp4"
        segment.write_bytes(mp4_segment(frames_to_uint8(output.frames), engine.pipeline.config.fps))
        decoded.append(decode(segment))
    return np.concatenate(decoded)


# ---------------------------------------------------------------------------------------------
# A session through the API


def test_start_act_stream_stop_and_download_matches_replay(server, tmp_path):
    url, engine, _ = server
    config = engine.pipeline.config
    client = Client(url, verbose=False, download_files=False)
    job = client.submit(handle_file(str(FOREST)), "a forest path", 7, api_name="/start")
    session_id, playlist, segments, telemetry = None, None, 0, []
    for video, text, sid in stream_outputs(job):
        telemetry.append(text)
        session_id = sid or session_id
        if isinstance(video, dict) and video.get("url"):
            playlist, segments = video["url"], segments + 1
            if segments == 2:
                assert "queued 1 event(s)" == client.predict(session_id, json.dumps({"event_id": 1, "keys": ["w"]}),
                                                             api_name="/act")
            if segments == 4:  # a list of events in one call: release w, then a one-block script
                client.predict(session_id, json.dumps([{"event_id": 2, "keys": []},
                                                       {"event_id": 3, "frames": [["j"], ["j"], []]}]),
                               api_name="/act")
            if segments == 7:
                assert client.predict(session_id, api_name="/stop").startswith("stopped after")
    assert telemetry[-1].startswith("stopped after") and telemetry[-1].endswith("can be downloaded")
    assert any(t.startswith("block 3 · ") and "ms/block" in t and "sessions active" in t for t in telemetry)
    assert session_id not in engine.session_ids()

    # The HLS playlist lists every streamed segment; a segment is an MPEG-TS of block 0's 9 frames.
    listing = httpx.get(playlist, timeout=30).text
    names = [line for line in listing.splitlines() if line.endswith(".ts") or ".ts?" in line]
    assert len(names) == segments and "#EXT-X-ENDLIST" in listing
    first = download(playlist.rsplit("/", 1)[0] + "/" + names[0], tmp_path / "first.ts")
    assert first.read_bytes()[0] == 0x47 and count_frames(first)[0] == config.pixel_frames_for_blocks(1)

    # The download: the streamed blocks as one MP4 (12N - 3 frames) and a replay of exactly those blocks.
    mp4_data, replay_data = client.predict(session_id, api_name="/download")
    mp4 = download(mp4_data["url"], tmp_path / "rollout.mp4")
    replay = json.loads(httpx.get(replay_data["url"], timeout=30).text)
    assert len(replay["blocks"]) == segments
    assert count_frames(mp4) == (config.pixel_frames_for_blocks(segments), float(config.fps))
    assert replay["seed"] == 7 and replay["prompt"] == "a forest path"
    assert replay["image_sha256"] == image_digest(fit_image(load_image(FOREST), config.height, config.width))
    pressed = [i for i, b in enumerate(replay["blocks"]) if any("w" in f for f in b["frames"])]
    assert pressed and pressed[0] >= 1  # the action reached the world, from a later block on
    assert any(b["frames"] == [["j"], ["j"], []] for b in replay["blocks"])

    # Oracle: the replay, regenerated offline and encoded block by block, is the downloaded video exactly.
    np.testing.assert_array_equal(decode(mp4), regenerate_as_streamed(engine, FOREST, replay, tmp_path))


def test_reset_starts_a_new_world_in_the_same_stream(server, tmp_path):
    url, engine, _ = server
    client = Client(url, verbose=False, download_files=False)
    job = client.submit(handle_file(str(FOREST)), "a forest path", 1, api_name="/start")
    session_id, segments, after_reset = None, 0, []
    for video, text, sid in stream_outputs(job):
        session_id = sid or session_id
        if not (isinstance(video, dict) and video.get("url")):
            continue
        segments += 1
        if segments == 2:
            message = client.predict(session_id, handle_file(str(VILLAGE)), "a village", 5, api_name="/reset")
            assert message == "reset: a new world from seed 5"
        elif segments > 2 and (after_reset or text.startswith("block 0 · ")):  # blocks already made may come first
            after_reset.append(text)
            if len(after_reset) == 3:
                mp4_data, replay_data = client.predict(session_id, api_name="/download")
                client.predict(session_id, api_name="/stop")
    assert [t.split(" · ")[0] for t in after_reset[:3]] == ["block 0", "block 1", "block 2"]
    replay = json.loads(httpx.get(replay_data["url"], timeout=30).text)  # the new world only, as far as recorded
    assert replay["seed"] == 5 and replay["prompt"] == "a village" and len(replay["blocks"]) >= 3
    config = engine.pipeline.config
    assert replay["image_sha256"] == image_digest(fit_image(load_image(VILLAGE), config.height, config.width))
    mp4 = download(mp4_data["url"], tmp_path / "world2.mp4")
    np.testing.assert_array_equal(decode(mp4), regenerate_as_streamed(engine, VILLAGE, replay, tmp_path))
    assert session_id not in engine.session_ids()


# ---------------------------------------------------------------------------------------------
# Admission: three viewers, seats for two


def test_three_clients_against_two_seats_queue_then_all_sessions_close(server):
    """Two seats, one place in line: the third waits with its position, a fourth is refused."""
    url, engine, app = server
    clients = [Client(url, verbose=False, download_files=False) for _ in range(3)]
    jobs = [c.submit(handle_file(str(FOREST)), "a forest path", i, api_name="/start") for i, c in enumerate(clients)]

    def latest(job):
        outputs = job.outputs()
        return outputs[-1] if outputs else (None, "", None)

    def session_of(job):
        return next((o[2] for o in job.outputs() if isinstance(o[2], str) and o[2]), None)

    wait_until(lambda: sum(session_of(j) is not None for j in jobs) == 2
               and any(latest(j)[1].startswith("waiting in line: position 1") for j in jobs), "two seats and a line")
    waiting = next(j for j in jobs if session_of(j) is None)
    assert "2/2 sessions active, 1 waiting" in latest(waiting)[1]
    assert len(engine.session_ids()) == 2
    with pytest.raises(AppError, match="full"):  # a fourth finds the line full too: refused, in words
        Client(url, verbose=False).predict(handle_file(str(FOREST)), "a forest path", 3, api_name="/start")

    first = next(j for j in jobs if session_of(j) is not None)
    first.cancel()  # a viewer disconnects: its seat goes to the one in line
    wait_until(lambda: session_of(waiting) is not None, "the waiting viewer to get the freed seat")
    wait_until(lambda: session_of(first) not in engine.session_ids(), "the disconnected session to close")
    for job in jobs:
        job.cancel()
    wait_until(lambda: engine.session_ids() == [], "every session to close after all viewers left")
    wait_until(lambda: app.service.live_session_ids() == [], "the app to forget the live sessions")
    assert engine.stats()["pages_in_use"] == 0


# ---------------------------------------------------------------------------------------------
# Bad input


def test_bad_input_gets_a_message_and_the_server_keeps_serving(server, tmp_path):
    url, engine, _ = server
    client = Client(url, verbose=False, download_files=False)
    not_image = tmp_path / "notes.png"
    not_image.write_bytes(b"these are not pixels " * 20)
    data = FOREST.read_bytes()
    truncated = tmp_path / "truncated.png"
    truncated.write_bytes(data[: len(data) // 2])
    huge = tmp_path / "huge.png"
    Image.new("RGB", (7000, 6000), (90, 140, 60)).save(huge)  # 42 MP: over the 40 MP limit
    cases = [
        ((handle_file(str(not_image)), "a forest", 0), "not a readable image"),
        ((handle_file(str(truncated)), "a forest", 0), "not a readable image"),
        ((handle_file(str(huge)), "a forest", 0), "at most 40000000 pixels"),
        ((handle_file(str(FOREST)), "   ", 0), "prompt is empty"),
        ((handle_file(str(FOREST)), "x" * 16385, 0), "the limit is 16384"),
        ((None, "a forest", 0), "upload an image"),
    ]
    for args, message in cases:
        with pytest.raises(AppError, match=message):
            client.predict(*args, api_name="/start")
    for args, message in [(("no-such-session", '{"event_id": 1, "keys": ["w"]}'), "no session"),
                          (("", '{"event_id": 1, "keys": ["w"]}'), "press Start"),
                          (("no-such-session",), "no session")]:
        with pytest.raises(AppError, match=message):
            client.predict(*args, api_name="/act" if len(args) == 2 else "/stop")

    # Still serving: a large (downscaled) image starts a world; bad events on it are named and change nothing.
    large = tmp_path / "large.png"
    Image.open(FOREST).resize((2400, 1600)).save(large)
    job = client.submit(handle_file(str(large)), "a forest", 0, api_name="/start")
    session_id = None
    for video, _, sid in stream_outputs(job):
        session_id = sid or session_id
        if isinstance(video, dict):
            break
    for events, message in [("{not json", "not valid JSON"), ('{"event_id": 5, "keys": ["q"]}', "unknown key 'q'"),
                            ('[{"event_id": 6, "keys": ["w"]}, {"event_id": 6, "keys": []}]', "stale or a duplicate"),
                            ('"w"', "JSON object")]:
        with pytest.raises(AppError, match=message):
            client.predict(session_id, events, api_name="/act")
    assert client.predict(session_id, '{"event_id": 7, "keys": ["d"]}', api_name="/act") == "queued 1 event(s)"
    client.predict(session_id, api_name="/stop")
    wait_until(job.done, "the stream to end")
    assert engine.session_ids() == []


# ---------------------------------------------------------------------------------------------
# Offline generation


def test_generate_from_script_equals_the_offline_path(server, tmp_path):
    url, engine, _ = server
    config = engine.pipeline.config
    client = Client(url, verbose=False, download_files=False)
    script = (ROOT / "examples" / "walk.jsonl").read_text()
    video, message = client.predict(handle_file(str(FOREST)), "a forest path", 3, script, None, None, None,
                                    api_name="/generate")
    blocks = len(read_events(script, config.transformer.num_frames_per_block))
    mp4 = download(video["video"]["url"] if "video" in video else video["url"], tmp_path / "app.mp4")
    assert count_frames(mp4)[0] == config.pixel_frames_for_blocks(blocks) == 12 * blocks - 3
    assert message.startswith(f"{blocks} blocks, {12 * blocks - 3} frames")

    # The same script through the offline command's functions gives the same pictures.
    controls = controls_from_events(read_events(script, 3), config)
    reference = tmp_path / "reference.mp4"
    write_rollout(engine.pipeline.rollout(FOREST, "a forest path", 3, controls), reference, config)
    np.testing.assert_array_equal(decode(mp4), decode(reference))

    # The script as a file is the same request.
    script_file = tmp_path / "walk.jsonl"
    script_file.write_text(script)
    video, _ = client.predict(handle_file(str(FOREST)), "a forest path", 3, "", handle_file(str(script_file)),
                              None, None, api_name="/generate")
    from_file = download(video["video"]["url"] if "video" in video else video["url"], tmp_path / "file.mp4")
    np.testing.assert_array_equal(decode(from_file), decode(reference))


def test_generate_from_trajectory_and_bad_requests(server, tmp_path):
    url, engine, _ = server
    config = engine.pipeline.config
    client = Client(url, verbose=False, download_files=False)
    frames = 21  # 6 latent frames = 2 blocks = 21 video frames
    poses = np.tile(np.eye(4), (frames, 1, 1))
    poses[:, 2, 3] = np.linspace(0, 1, frames)
    intrinsics = np.tile([500.0, 500.0, 416.0, 240.0], (frames, 1))
    np.save(tmp_path / "poses.npy", poses)
    np.save(tmp_path / "intrinsics.npy", intrinsics)
    video, message = client.predict(handle_file(str(FOREST)), "a forest", 0, "", None,
                                    handle_file(str(tmp_path / "poses.npy")),
                                    handle_file(str(tmp_path / "intrinsics.npy")), api_name="/generate")
    mp4 = download(video["video"]["url"] if "video" in video else video["url"], tmp_path / "traj.mp4")
    assert count_frames(mp4)[0] == config.pixel_frames_for_blocks(2) == frames

    garbage = tmp_path / "garbage.npy"
    garbage.write_bytes(b"\x00" * 64)
    script = '{"event_id": 0, "keys": ["w"]}'
    too_long = "\n".join(json.dumps({"event_id": i, "keys": ["w"]}) for i in range(17))
    cases = [
        (("", None, handle_file(str(garbage)), handle_file(str(tmp_path / "intrinsics.npy"))), "is not an NPY file"),
        (("", None, handle_file(str(tmp_path / "poses.npy")), None), "needs both"),
        ((script, None, handle_file(str(tmp_path / "poses.npy")), handle_file(str(tmp_path / "intrinsics.npy"))),
         "not both"),
        (("", None, None, None), "not both"),
        (('{"event_id": 0, "keys": ["w"]}\n{"event_id": 0, "keys": []}', None, None, None), "does not increase"),
        (('{"event_id": 0, "frames": [["w"]]}', None, None, None), "list of 3 key lists"),
        ((too_long, None, None, None), "line 17: the script holds more than 16 events; this server makes at most 16"),
    ]
    for (text, file, p, k), message in cases:
        with pytest.raises(AppError, match=message):
            client.predict(handle_file(str(FOREST)), "a forest", 0, text, file, p, k, api_name="/generate")


# ---------------------------------------------------------------------------------------------
# The stream's exits, driven directly (no Gradio)


def collect(service, image, *, viewer=None, after=None, limit=50):
    """Run one stream until it ends (or `limit` updates); `after(update, n)` acts along the way."""
    async def run():
        updates = []
        stream = service.stream(image, "a forest", 0, viewer)
        try:
            async for update in stream:
                updates.append(update)
                if after is not None and after(update, len(updates)) == "leave":
                    break
                if len(updates) >= limit:
                    break
        finally:
            await stream.aclose()
        return updates
    return asyncio.run(run())


@pytest.mark.parametrize("exit_path", ["generator exit", "input idle", "tab closed", "stop"])
def test_every_exit_closes_the_engine_session(server, tmp_path, exit_path, monkeypatch):
    _, engine, _ = server
    if exit_path == "input idle":  # the engine's one idle policy (the app's --idle-ttl), made short here
        monkeypatch.setattr(engine, "config", dataclasses.replace(engine.config, idle_ttl_s=0.6))
    service = LiveService(engine, tmp_path / "recordings", StreamConfig(lead_s=1e6))
    seen, answers = [], []

    def after(update, n):
        seen.append(update.session_id)
        if n == 3:
            if exit_path == "generator exit":
                return "leave"
            if exit_path == "tab closed":
                assert service.close_viewer("tab-1") == 1
            if exit_path == "stop":
                answers.append(service.stop(update.session_id, "tab-1"))
        return None

    try:
        updates = collect(service, FOREST, viewer="tab-1", after=after, limit=400)
        session_id = next(s for s in seen if s)
        blocks = sum(1 for update in updates if update.segment)
        expected = {"generator exit": None, "input idle": "stopped: no input for 1 s; press Start to play again",
                    "tab closed": "stopped: the tab was closed",
                    "stop": f"stopped after {blocks} block(s) of this world; the rollout can be downloaded"}[exit_path]
        if expected is not None:
            assert updates[-1].telemetry == expected and updates[-1].finished
        if exit_path == "stop":  # the page shows Stop's answer and the stream's last line in one field
            assert answers == [expected]
        wait_until(lambda: session_id not in engine.session_ids(), f"the session to close after {exit_path}")
        assert service.live_session_ids() == []
    finally:
        service.shutdown()


# ---------------------------------------------------------------------------------------------
# Pure parts


def test_playback_clock_keeps_the_viewer_fed_but_not_far_ahead():
    clock = PlaybackClock(delivery_s=0.25)
    assert clock.wait_before_next(100.0, lead_s=0.3) == 0.0  # nothing sent: take the first block now
    clock.on_sent(0.5625, now=100.0)  # block 0: plays from 100.25 to 100.8125
    assert clock.wait_before_next(100.0, 0.3) == pytest.approx(100.8125 - 0.3 - 100.0)
    clock.on_sent(0.75, now=100.5125)  # on time: no waiting, the playhead runs on
    assert clock.origin == pytest.approx(100.25)
    assert clock.wait_before_next(100.6, 0.3) == pytest.approx(100.25 + 1.3125 - 0.3 - 100.6)
    assert clock.playhead(101.0) == pytest.approx(0.75)
    clock.on_sent(0.75, now=103.0)  # late: the viewer ran dry at 101.5625 and resumes at 103.25
    assert clock.origin == pytest.approx(103.25 - 1.3125)
    assert clock.playhead(104.0) == pytest.approx(1.3125 + 0.75)

    # The player's own report replaces the estimate: here it is 0.2 s behind, so the next take waits longer.
    clock.observe(1.8, now=104.0)
    assert clock.playhead(104.0) == pytest.approx(1.8)
    assert clock.wait_before_next(104.0, 0.1) == pytest.approx(2.0625 - 0.1 - 1.8)
    clock.observe(1.8, now=105.0)  # paused (or stalled): the clock stops with it and the world waits
    assert clock.wait_before_next(105.0, 0.1) == pytest.approx(2.0625 - 0.1 - 1.8)
    clock.observe(99.0, now=105.0)  # a report past what was sent cannot be right: capped
    assert clock.playhead(105.0) == pytest.approx(2.0625) and clock.wait_before_next(105.0, 0.3) == 0.0


def test_the_telemetry_line_shows_the_key_to_frame_latency_of_a_block_that_applied_keys():
    block = Block(4, np.zeros((12, 2, 2, 3), np.uint8), None, {}, 500.0, {"frames": [], "event_ids": [7]})
    stats = {"active_sessions": 1, "capacity": 2}
    line = telemetry_line(block, 12, 16, None, stats, key_ms=1234.4)
    assert line == ("block 4 · 500 ms/block · 24.0 FPS generated (playback 16) · key → frame ≈ 1234 ms · "
                    "1/2 sessions active")
    assert "key" not in telemetry_line(block, 12, 16, None, stats)


def test_playhead_reports_are_checked(server, tmp_path):
    _, engine, _ = server
    service = LiveService(engine, tmp_path / "recordings")
    try:
        for bad in ("soon", float("nan"), -1.0, float("inf")):
            with pytest.raises(StreamError, match="playhead"):
                service.report_playhead("any", bad)
        for bad in ("many", "-1", "1.5", True, 2.0):
            with pytest.raises(StreamError, match="stalls"):
                service.report_playhead("any", 1.0, stalls=bad)
        with pytest.raises(StreamError, match="no session"):
            service.report_playhead("no-such-session", 1.0)
    finally:
        service.shutdown()


def test_the_lead_grows_only_for_stalls_pacing_caused_and_shrinks_back_when_playback_is_smooth():
    config = StreamConfig(lead_s=0.6, lead_min_s=0.3, lead_max_s=0.9, lead_up_s=0.15, lead_down_s=0.05,
                          lead_calm_blocks=2)
    lead = AdaptiveLead(config)
    assert lead.after_block(stalled=True, held_back=False) == 0.6  # the model was late: a lead would not help
    assert lead.after_block(stalled=True, held_back=True) == pytest.approx(0.75)
    assert lead.after_block(stalled=True, held_back=True) == pytest.approx(0.9)
    assert lead.after_block(stalled=True, held_back=True) == pytest.approx(0.9)  # at most lead_max_s
    assert lead.after_block(stalled=False, held_back=True) == pytest.approx(0.9)  # one calm block: not yet
    assert lead.after_block(stalled=False, held_back=True) == pytest.approx(0.85)  # two in a row
    assert lead.after_block(stalled=True, held_back=False) == pytest.approx(0.85)  # resets the calm count
    assert lead.after_block(stalled=False, held_back=True) == pytest.approx(0.85)
    for _ in range(40):
        lead.after_block(stalled=False, held_back=True)
    assert lead.lead_s == pytest.approx(0.3)  # never below lead_min_s
    with pytest.raises(ValueError, match="lead_min_s"):
        StreamConfig(lead_min_s=1.0, lead_max_s=0.5)


def test_a_page_that_reports_stalls_gets_a_longer_lead_and_sees_it(server, tmp_path):
    """Through the stream: each block that follows a stall, the block having been held back for pacing,
    adds lead_up_s, and the telemetry line shows the viewer's lead."""
    _, engine, _ = server
    config = StreamConfig(lead_s=0.0, lead_min_s=0.0, lead_max_s=10.0, lead_up_s=0.1, lead_calm_blocks=100)
    service = LiveService(engine, tmp_path / "recordings", config)
    reported = {"stalls": 0, "sent_s": 0.0}

    def after(update, n):
        if update.segment is not None:
            # The player holds 2 s of video (so the next block is held back for pacing, however slow this
            # machine makes the tiny model) and ran dry once more since the last block.
            reported["sent_s"] += count_frames(update.segment)[0] / 16
            reported["stalls"] += 1
            service.report_playhead(update.session_id, max(0.0, reported["sent_s"] - 2.0), "tab-1",
                                    stalls=reported["stalls"])
        return "leave" if n == 8 else None

    try:
        updates = collect(service, FOREST, viewer="tab-1", after=after, limit=400)
        leads = [float(re.search(r"lead (\d+\.\d+) s", u.telemetry).group(1)) for u in updates
                 if u.segment is not None and "lead" in u.telemetry]
        assert leads and leads == sorted(leads) and leads[-1] > leads[0], leads
    finally:
        service.shutdown()


def test_action_and_seed_parsing():
    assert parse_actions('{"event_id": 1, "keys": ["w"]}', 3) == [KeyStateEvent(1, frozenset({"w"}))]
    assert parse_actions([{"event_id": 1, "keys": []}], 3) == [KeyStateEvent(1, frozenset())]
    assert parse_actions("  ", 3) == []
    for bad, message in [("[1]", "JSON object"), ("{", "not valid JSON"), (json.dumps([{}] * 65), "at most 64"),
                         ('[{"event_id": 1, "keys": ["w"]}, {"event_id": 2, "keys": ["q"]}]', "unknown key")]:
        with pytest.raises(EventError, match=message):
            parse_actions(bad, 3)
    assert parse_seed(None) == 0 and parse_seed(12.0) == 12 and parse_seed("7") == 7
    for bad in (-1, 1.5, "x", 2**63):
        with pytest.raises(RequestError, match="seed"):
            parse_seed(bad)
