"""The app in a real browser: headless Chromium (Debian's /usr/bin/chromium) driven by Playwright.

The page's default, the socket player (page/player.js over serving/live_socket.py): frames arrive and are
drawn, a held key reaches the engine over the socket (the replay records it), closing the tab frees the
seat, and a second world from the same browser session, or one more than the per-address limit, is refused.
The HLS fallback (`?player=hls`, Gradio's streaming video): the video really plays (currentTime advances,
the buffered range grows) while the telemetry updates; held keys and the on-screen key buttons reach the
world and typing in a text field does not; Stop offers the rollout for download (12N - 3 frames, N = the
replay's blocks); closing the tab closes the engine session. A screenshot goes to artifacts/ (gitignored).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHROMIUM = Path("/usr/bin/chromium")
if not CHROMIUM.exists():
    pytest.skip(f"{CHROMIUM} is missing: install Debian's chromium (setup.sh does) to run the browser tests",
                allow_module_level=True)
playwright_api = pytest.importorskip("playwright.sync_api", reason="the playwright Python package is not installed")

from lingbot_core.serving.contract import EngineConfig  # noqa: E402
from lingbot_core.serving.streaming import StreamConfig  # noqa: E402
from tests.app_driver import running_app  # noqa: E402
from lingbot_core.boundary.video import count_frames  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:::gradio.queueing")

FOREST = ROOT / "examples" / "forest.png"
ARTIFACTS = ROOT / "artifacts"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--autoplay-policy=no-user-gesture-required"]
WAIT_MS = 120_000  # generous bound on waits; never asserted as a timing

VIDEO_STATE = """() => {
  const v = document.querySelector('#lingbot-video video');
  if (!v || !v.buffered.length) return null;
  return {time: v.currentTime, buffered: v.buffered.end(v.buffered.length - 1), paused: v.paused,
          error: v.error && v.error.code};
}"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_app(EngineConfig(max_sessions=2), StreamConfig(), tmp_path_factory.mktemp("app")) as (url, engine, _):
        yield url, engine


@pytest.fixture(scope="module")
def browser():
    with playwright_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


def replay_blocks(engine, session_id: str) -> list[list[list[str]]]:
    return [block["frames"] for block in json.loads(engine.replay(session_id).to_json())["blocks"]]


def wait_for_key_in_replay(engine, session_id: str, key: str) -> None:
    deadline = time.monotonic() + WAIT_MS / 1000
    while not any(key in frame for frames in replay_blocks(engine, session_id) for frame in frames):
        assert time.monotonic() < deadline, f"key {key!r} never reached the world"
        time.sleep(0.05)


def start_world(page, url: str) -> str:
    """Load the page with the HLS player, upload the forest, press Start, wait for video to play; returns the
    session id."""
    page.goto(url + "?player=hls")
    page.wait_for_selector("#lingbot-video")
    page.locator("input[type=file]").first.set_input_files(str(FOREST))
    page.wait_for_selector("img[src*='forest']", timeout=WAIT_MS)
    page.get_by_role("button", name="Start", exact=True).click()
    page.wait_for_function(f"({VIDEO_STATE})()?.time > 0.2", timeout=WAIT_MS)
    return page.locator("#lingbot-session textarea, #lingbot-session input").first.input_value()


def telemetry_block(page) -> int:
    text = page.locator("#lingbot-telemetry").inner_text()
    assert text.startswith("block "), text
    assert "ms/block" in text and "FPS generated" in text and "session memory" in text and "sessions active" in text
    return int(text.split()[1])


def test_play_keys_stop_and_download_in_the_browser(server, browser, tmp_path):
    url, engine = server
    page = browser.new_page(viewport={"width": 1280, "height": 900}, accept_downloads=True)
    errors = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    session_id = start_world(page, url)
    assert session_id in engine.session_ids()

    # The video plays: the playhead and the buffered range move on, and the telemetry follows the blocks.
    before, block_before = page.evaluate(VIDEO_STATE), telemetry_block(page)
    page.wait_for_function(f"({VIDEO_STATE})().time > {before['time'] + 1.0} && "
                           f"({VIDEO_STATE})().buffered > {before['buffered'] + 1.0}", timeout=WAIT_MS)
    after = page.evaluate(VIDEO_STATE)
    assert after["error"] is None and not after["paused"]
    assert telemetry_block(page) > block_before

    # A held key reaches the world and lights its button while held.
    page.mouse.click(5, 5)
    page.keyboard.down("w")
    page.wait_for_selector("#lingbot-key-w.lingbot-held")
    wait_for_key_in_replay(engine, session_id, "w")
    page.keyboard.up("w")
    page.wait_for_selector("#lingbot-key-w:not(.lingbot-held)")

    # So does holding an on-screen key button.
    page.locator("#lingbot-key-d").hover()
    page.mouse.down()
    wait_for_key_in_replay(engine, session_id, "d")
    page.mouse.up()

    # Typing in a text field is text, not movement.
    prompt = page.get_by_label("Prompt")
    prompt.click()
    prompt.press_sequentially(" ijkl")
    blocks_then = len(replay_blocks(engine, session_id))
    page.wait_for_function(f"({VIDEO_STATE})().buffered > {page.evaluate(VIDEO_STATE)['buffered'] + 1.5}",
                           timeout=WAIT_MS)
    assert len(replay_blocks(engine, session_id)) > blocks_then + 1
    assert not any(k in frame for frames in replay_blocks(engine, session_id) for frame in frames for k in "ijkl")
    assert prompt.input_value().endswith(" ijkl")

    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "browser_play.png"), full_page=True)

    # Stop: the session closes and the rollout is offered for download.
    page.get_by_role("button", name="Stop", exact=True).click()
    page.wait_for_function("document.querySelector('#lingbot-telemetry').innerText.startsWith('stopped after')",
                           timeout=WAIT_MS)
    assert session_id not in engine.session_ids()
    with page.expect_download() as replay_download:
        page.locator("#lingbot-replay").click()
    replay = json.loads(Path(replay_download.value.path()).read_text())
    with page.expect_download() as mp4_download:
        page.locator("#lingbot-mp4").click()
    mp4 = tmp_path / "rollout.mp4"
    mp4_download.value.save_as(mp4)
    assert count_frames(mp4)[0] == engine.pipeline.config.pixel_frames_for_blocks(len(replay["blocks"]))
    assert any("w" in frame for block in replay["blocks"] for frame in block["frames"])
    assert errors == []
    page.close()


def test_closing_the_tab_closes_the_session(server, browser):
    url, engine = server
    page = browser.new_page()
    session_id = start_world(page, url)
    assert session_id in engine.session_ids()
    page.close()  # the tab goes: the heartbeat drops, demo.unload and the stream's exit both close the session
    deadline = time.monotonic() + WAIT_MS / 1000
    while session_id in engine.session_ids():
        assert time.monotonic() < deadline, "the session outlived its tab"
        time.sleep(0.1)
    assert engine.stats()["pages_in_use"] == 0


# ---------------------------------------------------------------------------------------------
# The socket player (the page's default)

PRESENTED = "() => window.lingbotPlayer ? window.lingbotPlayer.presented().length : 0"


def start_socket_world(page, url: str) -> str:
    page.goto(url)
    page.wait_for_selector("#lingbot-canvas-box", state="attached")
    page.locator("input[type=file]").first.set_input_files(str(FOREST))
    page.wait_for_selector("img[src*='forest']", timeout=WAIT_MS)
    page.get_by_role("button", name="Start", exact=True).click()
    page.wait_for_function(f"({PRESENTED})() > 12", timeout=WAIT_MS)
    return page.locator("#lingbot-session textarea, #lingbot-session input").first.input_value()


def test_the_socket_player_plays_takes_keys_and_frees_the_seat(server, browser):
    url, engine = server
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    session_id = start_socket_world(page, url)
    assert session_id in engine.session_ids()
    assert page.evaluate("window.lingbotPlayer.connected()")
    assert page.evaluate("document.getElementById('lingbot-video').style.display") == "none"
    # Frames keep arriving and are drawn in order, blocks and frames as the engine made them.
    seen = page.evaluate(PRESENTED)
    page.wait_for_function(f"({PRESENTED})() > {seen + 24}", timeout=WAIT_MS)
    presented = page.evaluate("window.lingbotPlayer.presented()")
    order = [(block, frame) for _, block, frame in presented]
    assert order == sorted(order) and order[0] == (0, 0)
    assert page.evaluate("window.lingbotPlayer.received()") > 0
    # A held key goes over the socket and reaches the engine; nothing queued for /act meanwhile.
    page.mouse.click(5, 5)
    page.keyboard.down("j")
    wait_for_key_in_replay(engine, session_id, "j")
    page.keyboard.up("j")
    assert page.evaluate("window.lingbotControls.take()") == "[]"
    # One world a browser session: a second Start while this one plays makes no second world (Gradio holds the
    # click while the first runs; the stream refuses a second claim of the same session: tests/test_hardening.py).
    page.get_by_role("button", name="Start", exact=True).click()
    time.sleep(1.0)
    assert engine.session_ids() == [session_id]
    # Closing the tab frees the seat.
    page.close()
    deadline = time.monotonic() + WAIT_MS / 1000
    while session_id in engine.session_ids():
        assert time.monotonic() < deadline, "the session outlived its tab"
        time.sleep(0.1)
    assert errors == []


def test_a_socket_ticket_is_the_viewers_alone(server):
    """The socket refuses a ticket it never issued; the page's private endpoint issues one only to the viewer that
    owns the world (LiveService.ticket)."""
    from websockets.sync.client import connect

    url, engine = server
    with connect(url.replace("http", "ws", 1).rstrip("/") + "/lingbot/live?ticket=forged", open_timeout=30) as ws:
        reply = json.loads(ws.recv(timeout=30))
    assert reply["type"] == "error" and "unknown or ended player ticket" in reply["text"]



def test_one_more_world_than_the_address_may_hold_is_refused_in_the_browser(browser, tmp_path):
    """Two browser sessions from one address where the address may hold one world: the second Start is told why
    and makes no world; once the first tab closes, the second gets its world."""
    one_world = StreamConfig(max_streams_per_address=1)
    with running_app(EngineConfig(max_sessions=2), one_world, tmp_path) as (url, engine, _):
        viewport = {"width": 1280, "height": 900}
        first_context, second_context = browser.new_context(viewport=viewport), browser.new_context(viewport=viewport)
        try:  # two contexts: two Gradio sessions from one address
            first = first_context.new_page()
            session_id = start_socket_world(first, url)
            second = second_context.new_page()
            second.goto(url)
            second.wait_for_selector("#lingbot-canvas-box", state="attached")
            second.locator("input[type=file]").first.set_input_files(str(FOREST))
            second.wait_for_selector("img[src*='forest']", timeout=WAIT_MS)
            second.get_by_role("button", name="Start", exact=True).click()
            second.get_by_text("the most one address may hold").first.wait_for(timeout=WAIT_MS)
            assert engine.session_ids() == [session_id]
            first.close()
            deadline = time.monotonic() + WAIT_MS / 1000
            while engine.session_ids():
                assert time.monotonic() < deadline, "the first world outlived its tab"
                time.sleep(0.1)
            second.get_by_role("button", name="Start", exact=True).click()
            second.wait_for_function(f"({PRESENTED})() > 12", timeout=WAIT_MS)
            assert len(engine.session_ids()) == 1 and engine.session_ids() != [session_id]
        finally:
            first_context.close()
            second_context.close()
