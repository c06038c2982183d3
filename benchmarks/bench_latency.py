"""Latency as a player sees it, measured in a real browser against the app, for both of the page's players.

    python benchmarks/bench_latency.py [--player socket|hls|both] [--truth] [--presses 16] [--model embedded]
                                       [--preset tiny] [--shot PNG]

Starts the app in-process (embedded model by default, no download) on a free localhost port, drives
headless Chromium (Debian's /usr/bin/chromium) with Playwright, on the same machine, and prints for each
player (the socket player, the page's default, page/player.js; Gradio's HLS video, `?player=hls`):

- Start -> first frame: from the click on Start to the first frame presented on screen;
- key press -> first frame reflecting it, median and p90: from the keydown to the presentation of the first
  frame of the first block generated with that key (the block comes from the session's replay log). Keys
  W A S D I J K L in turn, each pressed at a random point of the block rhythm and held until it shows;
- the floor such a latency has here: half a block's wait for the next block to start, plus the time to the
  block's first frame (a whole block, as frames leave the engine a block at a time);
- frames presented a second while playing, and the picture standing still (stalls a minute);
- bytes a second the player received (the socket player's own count);
- the app's CPU a block, all but the model: the CPU time of the process's Python threads other than the
  engine's worker (whose OpenMP team runs the model), per block.
With --truth the page's Ground truth box is ticked (the true world rendered beside the model's).

Frame presentation times come from requestVideoFrameCallback (HLS) or the socket player's own clock, so they
include muxing, delivery, decoding and each player's buffer.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import app as lingbot_app  # noqa: E402
from lingbot_core.serving.contract import EngineConfig  # noqa: E402
from lingbot_core.serving.factory import create_engine  # noqa: E402

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


def thread_cpu_s() -> dict[int, float]:
    """CPU seconds (user + system) each thread of this process has used so far (Linux /proc)."""
    out = {}
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            out[int(task.name)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def app_cpu_s(before: dict[int, float], after: dict[int, float], model_thread: int) -> float:
    """CPU the app spent between two readings, all but the model: the Python threads other than the engine's
    worker (Gradio, the streams, encoding, the socket). The worker and the threads Python does not know (its
    OpenMP team, where PyTorch runs the model's kernels) are the model's."""
    python = {thread.native_id for thread in threading.enumerate()} - {model_thread}
    return sum(after[t] - before.get(t, 0.0) for t in after if t in python)


# The socket player's presented frames as [page time, media time] (as the HLS probe records them).
SOCKET_FRAMES = ("(fps) => window.lingbotPlayer.presented().map(([t, b, f]) => "
                 "[t, (b === 0 ? f : (12 * b - 3 + f)) / fps])")


def run(args, player: str) -> dict:
    from playwright.sync_api import sync_playwright

    engine = create_engine(args.model, preset=args.preset, compile=args.compile,
                           engine_config=EngineConfig(max_sessions=2))
    config = engine.pipeline.config
    half_frame = 0.5 / config.fps
    app = lingbot_app.build_demo(engine)
    _, url, _ = app.launch(server_name="127.0.0.1", server_port=free_port(), prevent_thread_lock=True, quiet=True)
    results: dict = {"player": player, "model": config.name, "picture": Path(start_picture(args, config)).name,
                     "key_ms": [], "block_ms": [], "stage_ms": []}
    frames_js = "window.__probe.frames" if player == "hls" else f"({SOCKET_FRAMES})({config.fps})"
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.add_init_script(PROBE_JS)
            page.goto(url + ("?player=hls" if player == "hls" else ""))
            page.wait_for_selector("#lingbot-video", state="attached")
            page.locator("input[type=file]").first.set_input_files(start_picture(args, config))
            time.sleep(1.0)
            if args.truth:
                page.get_by_label("Ground truth").check()
            page.get_by_role("button", name="Start").click()
            page.wait_for_function(f"{frames_js}.length > 0", timeout=120_000)
            results["start_ms"] = page.evaluate(f"{frames_js}[0][0] - window.__probe.start")
            time.sleep(2.0)  # let the stream settle into its pace
            session_id = engine.session_ids()[0]
            worker = engine._worker.native_id
            cpu0, blocks0 = thread_cpu_s(), len(replay_blocks(engine, session_id))
            bytes0, wall0 = page.evaluate("window.lingbotPlayer.received()"), time.monotonic()
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
                    shown = page.evaluate(f"(t) => {{ const f = {frames_js}.find((x) => x[1] >= t); "
                                          "return f ? f[0] : null; }", block_start_s(config, block) - half_frame)
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
                if match := re.search(r"first frame (\d+) ms", telemetry):
                    results.setdefault("first_frame_ms", []).append(float(match.group(1)))
                if match := re.search(r"lead (\d+\.\d+) s", telemetry):
                    results["lead_s"] = float(match.group(1))  # the stream's adaptive lead (last seen)
                time.sleep(0.3)
            time.sleep(max(args.play_s - (time.monotonic() - wall0), 0.0))  # play on to the measured length
            blocks = len(replay_blocks(engine, session_id)) - blocks0
            app_cpu = app_cpu_s(cpu0, thread_cpu_s(), worker)
            results["app_cpu_ms_per_block"] = 1000.0 * app_cpu / max(blocks, 1)
            results["bytes_per_s"] = ((page.evaluate("window.lingbotPlayer.received()") - bytes0)
                                      / (time.monotonic() - wall0)) if player == "socket" else None
            frames = page.evaluate(frames_js)
            playing = [f for f in frames if f[0] >= frames[0][0]]
            results["played_s"] = playing[-1][1] - playing[0][1]
            span_s = (playing[-1][0] - playing[0][0]) / 1000.0
            results["displayed_fps"] = (len(playing) - 1) / span_s if span_s > 0 else float("nan")
            results["freezes"] = freezes(playing, config.fps)
            if args.shot:
                page.screenshot(path=args.shot, full_page=True)
            browser.close()
    finally:
        app.close()
        engine.shutdown()
    return results


def report(r: dict) -> None:
    keys = sorted(r["key_ms"])
    p90 = keys[min(len(keys) - 1, int(round(0.9 * (len(keys) - 1))))]
    median_block = statistics.median(r["block_ms"]) if r["block_ms"] else float("nan")
    # Half a 750 ms block's wait for the next block to start, then the time to its first frame on the way out:
    # the first decoded frames where they leave early (the socket player), the whole block otherwise.
    first = statistics.median(r["first_frame_ms"]) if r.get("first_frame_ms") else median_block
    floor = 375.0 + first
    count, frozen = r["freezes"]
    per_minute = 60 * count / r["played_s"] if r["played_s"] else float("nan")
    print(f"[{r['player']}] model {r['model']}, start picture {r['picture']}: Start -> first frame "
          f"{r['start_ms']:.0f} ms")
    print(f"[{r['player']}] key -> frame, {len(keys)} presses: median {statistics.median(keys):.0f} ms, p90 {p90:.0f} ms "
          f"(floor here about {floor:.0f} ms: half a block's wait + {first:.0f} ms to the block's first frame; "
          f"blocks take {median_block:.0f} ms)")
    print(f"[{r['player']}]   per press (ms): " + ", ".join(f"{k:.0f}" for k in r["key_ms"]))
    print(f"[{r['player']}] displayed {r['displayed_fps']:.1f} FPS over {r['played_s']:.1f} s of video; picture stood "
          f"still {count} times ({frozen:.1f} s, {per_minute:.1f} a minute)")
    if "lead_s" in r:
        print(f"[{r['player']}] pacing lead at the last press: {r['lead_s']:.2f} s")
    received = f"{r['bytes_per_s'] / 1000:.0f} kB/s received" if r["bytes_per_s"] is not None else "bytes: n/a"
    print(f"[{r['player']}] {received}; the app's CPU a block, all but the model: {r['app_cpu_ms_per_block']:.0f} ms")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--player", choices=("socket", "hls", "both"), default="both")
    parser.add_argument("--truth", action="store_true", help="tick Ground truth (the true world beside the model's)")
    parser.add_argument("--presses", type=int, default=16)
    parser.add_argument("--play-s", type=float, default=0.0, help="play at least this long (stalls a minute over it)")
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--preset", help="test preset (tiny) instead of the full embedded size")
    parser.add_argument("--picture", help="start picture (default: the page's first example)")
    parser.add_argument("--shot", help="save a screenshot here at the end")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="as the app's --compile (default: its choice)")
    args = parser.parse_args(argv)
    if not Path(CHROMIUM).exists():
        print(f"error: {CHROMIUM} is missing (apt-get install chromium)", file=sys.stderr)
        return 2
    import torch
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} cores shared with Chromium"
          + (", Ground truth ticked" if args.truth else ""))
    for player in (("socket", "hls") if args.player == "both" else (args.player,)):
        report(run(args, player))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
