"""Latency as a player sees it, measured in a real browser against the app.

    python benchmarks/bench_latency.py [--presses 8] [--model embedded] [--preset tiny] [--shot PNG]

Starts the app in-process (embedded model by default, no download) on a free localhost port, drives
headless Chromium (Debian's /usr/bin/chromium) with Playwright and prints:

- Start -> first frame: from the click on Start to the first video frame presented on screen;
- key press -> first frame reflecting it: from the keydown to the presentation of the first frame of
  the first block generated with that key (the block comes from the session's replay log; its first
  frame has media time (12b - 3) / 16 s). Keys W A S D I J K L in turn, each pressed at a random
  point of the block rhythm and held until it shows;
- the buffer the player holds ahead of its playhead, and the generation speed from the telemetry.

Frame presentation times come from requestVideoFrameCallback, so they include muxing, HLS delivery,
decoding and the player's buffer. The target is two blocks of video (1.5 s at 16 FPS).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import app as lingbot_app  # noqa: E402
from lingbot_core.serving.engine import EngineConfig  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--autoplay-policy=no-user-gesture-required"]

# Logs every presented frame (display time, media time), every keydown and the Start click, in page time.
PROBE_JS = """
window.__probe = {frames: [], keys: {}, start: null, ahead: [], stalls: []};
document.addEventListener("keydown", (e) => { if (!e.repeat) window.__probe.keys[e.key] = performance.now(); }, true);
document.addEventListener("click", (e) => {
  const b = e.target.closest && e.target.closest("button");
  if (b && b.textContent.trim() === "Start") window.__probe.start = performance.now();
}, true);
setInterval(() => {
  const v = document.querySelector("#lingbot-video video");
  if (!v) return;
  if (!v.__probed) {
    v.__probed = true;
    v.addEventListener("waiting", () => { window.__probe.stalls.push(performance.now()); });
    const onFrame = (now, meta) => {
      window.__probe.frames.push([meta.expectedDisplayTime || now, meta.mediaTime]);
      v.requestVideoFrameCallback(onFrame);
    };
    v.requestVideoFrameCallback(onFrame);
  }
  if (v.buffered.length && !v.paused) window.__probe.ahead.push(v.buffered.end(v.buffered.length - 1) - v.currentTime);
}, 50);
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def block_start_s(config, block_index: int) -> float:
    """Media time of a block's first frame: block 0 starts the video, block b follows 12b - 3 frames."""
    return 0.0 if block_index == 0 else config.pixel_frames_for_blocks(block_index) / config.fps


def replay_blocks(engine, session_id: str) -> list:
    return json.loads(engine.replay(session_id).to_json())["blocks"]


def first_block_with(blocks: list, key: str, start: int) -> int | None:
    """The first block from `start` on whose key sets contain `key`."""
    for index in range(start, len(blocks)):
        if any(key in frame for frame in blocks[index]["frames"]):
            return index
    return None


# When the first frame at or after a media time was presented (null: not yet).
SHOWN_AT = "(t) => { const f = window.__probe.frames.find((x) => x[1] >= t); return f ? f[0] : null; }"


def freezes(frames: list, fps: int) -> tuple[int, float]:
    """(count, seconds) of the picture standing still during playback: gaps between consecutive presented
    frames longer than two frame intervals, each counted beyond its one interval. This is what a viewer
    sees of a stall (the page's `waiting` events also count waits too short to notice); frames the
    browser skipped under load show here too, as the viewer would see them."""
    interval = 1.0 / fps
    count, frozen = 0, 0.0
    for (shown_a, media_a), (shown_b, media_b) in zip(frames, frames[1:]):
        gap = (shown_b - shown_a) / 1000.0
        if media_b > media_a and gap > 2 * interval:
            count += 1
            frozen += gap - interval
    return count, frozen


def start_picture(args, config) -> str:
    """--picture, else the page's first example: what most viewers press Start on (a world render for the
    trained embedded model, whose condition stream the app encodes while idle; a photo otherwise)."""
    if args.picture:
        return args.picture
    examples = lingbot_app.world_examples() if lingbot_app.is_world_model(config) else []
    return examples[0][0] if examples else str(ROOT / "examples" / "forest.png")


def run(args) -> dict:
    from playwright.sync_api import sync_playwright

    engine = lingbot_app.create_engine(args.model, preset=args.preset, compile=args.compile,
                                       engine_config=EngineConfig(max_sessions=2))
    config = engine.pipeline.config
    half_frame = 0.5 / config.fps
    app = lingbot_app.build_demo(engine)
    _, url, _ = app.launch(server_name="127.0.0.1", server_port=free_port(), prevent_thread_lock=True, quiet=True)
    results: dict = {"model": config.name, "picture": Path(start_picture(args, config)).name, "key_ms": [],
                     "block_ms": []}
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.add_init_script(PROBE_JS)
            page.goto(url)
            page.wait_for_selector("#lingbot-video")
            page.locator("input[type=file]").first.set_input_files(start_picture(args, config))
            page.wait_for_selector("#lingbot-video") and time.sleep(1.0)
            page.get_by_role("button", name="Start").click()
            page.wait_for_function("window.__probe.frames.length > 0", timeout=120_000)
            results["start_ms"] = page.evaluate("window.__probe.frames[0][0] - window.__probe.start")
            time.sleep(2.0)  # let the stream settle into its pace
            session_id = engine.session_ids()[0]
            page.mouse.click(5, 5)  # focus the page, not a text field
            phase = random.Random(0)
            for press in range(args.presses):
                key = "wasdijkl"[press % 8]
                time.sleep(phase.uniform(0.0, 0.75))  # press at a random point of the block rhythm
                committed = len(replay_blocks(engine, session_id))  # these were made before the press
                page.keyboard.down(key)
                deadline = time.monotonic() + 60
                block = latency = None
                while time.monotonic() < deadline and latency is None:
                    time.sleep(0.03)
                    if block is None:
                        block = first_block_with(replay_blocks(engine, session_id), key, committed)
                        continue
                    shown = page.evaluate(SHOWN_AT, block_start_s(config, block) - half_frame)
                    if shown is not None:
                        latency = shown - page.evaluate("(k) => window.__probe.keys[k]", key)
                        results.setdefault("press_to_block", []).append(block - committed)
                page.keyboard.up(key)
                if latency is None:
                    raise RuntimeError(f"key {key!r} never reached the screen")
                results["key_ms"].append(latency)
                telemetry = page.locator("#lingbot-telemetry").inner_text()
                if match := re.search(r"(\d+) ms/block", telemetry):
                    results["block_ms"].append(float(match.group(1)))
                if match := re.search(r"lead (\d+\.\d+) s", telemetry):
                    results["lead_s"] = float(match.group(1))  # the stream's adaptive lead (last seen)
                time.sleep(0.3)
            results["ahead_s"] = statistics.median(page.evaluate("window.__probe.ahead.slice(-200)"))
            # Waits once the picture is playing: the wait for the first segment is Start -> first frame.
            results["stalls"] = page.evaluate("window.__probe.stalls.filter((t) => t > window.__probe.frames[0][0]).length")
            results["played_s"] = page.evaluate("window.__probe.frames.at(-1)[1]")
            results["freezes"] = freezes(page.evaluate("window.__probe.frames"), config.fps)
            if args.shot:
                page.screenshot(path=args.shot, full_page=True)
            browser.close()
    finally:
        app.close()
        engine.shutdown()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presses", type=int, default=16)
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--preset", help="test preset (tiny) instead of the full embedded size")
    parser.add_argument("--picture", help="start picture (default: the page's first example)")
    parser.add_argument("--shot", help="save a screenshot here at the end")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="as the app's --compile (default: its choice; --no-compile: eager from the first block, "
                             "without a background build sharing the cores)")
    args = parser.parse_args(argv)
    if not Path(CHROMIUM).exists():
        print(f"error: {CHROMIUM} is missing (apt-get install chromium)", file=sys.stderr)
        return 2
    r = run(args)
    block_s = 12 / 16
    keys = r["key_ms"]
    print(f"model {r['model']}, start picture {r['picture']}: Start -> first frame {r['start_ms']:.0f} ms")
    print(f"key press -> first frame reflecting it, {len(keys)} presses: median {statistics.median(keys):.0f} ms, "
          f"min {min(keys):.0f}, max {max(keys):.0f} ms "
          f"(median {statistics.median(keys) / 1000 / block_s:.2f} blocks of video; target <= 2 blocks = 1500 ms)")
    print("  per press (ms): " + ", ".join(f"{k:.0f}" for k in keys))
    if r["block_ms"]:
        median_block = statistics.median(r["block_ms"])
        print(f"generation: median {median_block:.0f} ms per 12-frame block "
              f"({12 / (median_block / 1000):.1f} FPS generated vs 16 FPS playback)")
    if "lead_s" in r:
        print(f"pacing lead (adapts to the player's stalls) at the last press: {r['lead_s']:.2f} s")
    print(f"player buffer ahead of the playhead: median {r['ahead_s'] * 1000:.0f} ms; the player waited for data "
          f"{r['stalls']} times in {r['played_s']:.1f} s of video ({60 * r['stalls'] / r['played_s']:.1f} stalls "
          "per minute)")
    count, frozen = r["freezes"]
    print(f"picture stood still (presented-frame gaps over 2 frame intervals): {count} times, {frozen:.1f} s in "
          f"{r['played_s']:.1f} s of video ({60 * count / r['played_s']:.1f} a minute, {100 * frozen / r['played_s']:.1f}% "
          "of the time)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
