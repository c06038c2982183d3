"""Drive the app from a script with gradio_client: start a world, walk and turn, download the rollout.

    python app.py                                   # in another shell (or use a Space's URL)
    python examples/client.py [--url http://127.0.0.1:7860/] [--blocks 12] [--out out/client] [--offline]

Prints the telemetry of each streamed block, holds W for a few blocks and then W+L, saves the whole
rollout (MP4 + replay JSON) to --out and stops the session. With --offline it also renders
examples/walk.jsonl through /generate. Endpoints:

    /start(image, prompt, seed)      streams (video segment, telemetry, session id) per block
    /act(session_id, events)         events: JSON object or list, {"event_id": n, "keys": [...]} (held keys)
                                     or {"event_id": n, "frames": [[...], [...], [...]]} (one block)
    /stop(session_id), /reset(session_id, image, prompt, seed), /download(session_id) -> (MP4, JSON)
    /generate(image, prompt, seed, script, script_file, poses, intrinsics) -> (MP4, message)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import httpx
from gradio_client import Client, handle_file

HERE = Path(__file__).resolve().parent


def save(file_data: dict, target: Path) -> Path:
    """Fetch a file the app returned (download_files=False gives its URL)."""
    target.write_bytes(httpx.get(file_data["url"], timeout=60).content)
    return target


def play(client: Client, args) -> None:
    job = client.submit(handle_file(str(args.image)), args.prompt, args.seed, api_name="/start")
    session_id, blocks, next_event_id = None, 0, 1

    def hold(*keys: str) -> None:
        nonlocal next_event_id
        client.predict(session_id, json.dumps({"event_id": next_event_id, "keys": list(keys)}), api_name="/act")
        next_event_id += 1

    for video, telemetry, sid in job:
        print(telemetry)
        session_id = sid or session_id
        if not (isinstance(video, dict) and video.get("url")):  # no new segment in this update
            continue
        blocks += 1
        if blocks == 2:
            print(f"session {session_id}; the live video is an HLS playlist at {video['url']}")
            hold("w")
        elif blocks == args.blocks // 2:
            hold("w", "l")
        elif blocks == args.blocks - 2:
            hold()
        if blocks >= args.blocks:
            break

    mp4, replay = client.predict(session_id, api_name="/download")
    args.out.mkdir(parents=True, exist_ok=True)
    print("saved", save(mp4, args.out / "rollout.mp4"), "and", save(replay, args.out / "replay.json"))
    print(client.predict(session_id, api_name="/stop"))
    job.cancel()


def offline(client: Client, args) -> None:
    script = (HERE / "walk.jsonl").read_text()
    video, message = client.predict(handle_file(str(args.image)), args.prompt, args.seed, script, None, None, None,
                                    api_name="/generate")
    args.out.mkdir(parents=True, exist_ok=True)
    print("offline:", message, "->", save(video.get("video", video), args.out / "walk.mp4"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:7860/")
    parser.add_argument("--image", type=Path, default=HERE / "forest.png")
    parser.add_argument("--prompt", default="a forest path in spring, sunlight")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--blocks", type=int, default=12, help="blocks to watch before stopping (at least 4)")
    parser.add_argument("--out", type=Path, default=Path("out/client"))
    parser.add_argument("--offline", action="store_true", help="also run examples/walk.jsonl through /generate")
    args = parser.parse_args()
    args.blocks = max(args.blocks, 4)
    client = Client(args.url, verbose=False, download_files=False)
    play(client, args)
    if args.offline:
        offline(client, args)


if __name__ == "__main__":
    main()
