"""lingbot_core/protocols/sglang/server.py: SGLang's realtime protocol served by our engine, over real WebSockets.

The conformance client here is written from the reference (../shared/reference/sglang-realtime-protocol.md)
with raw `websockets` and `msgpack`, not with lingbot_core.protocols.sglang, so server and client cannot share a bug.
The oracle: the engine's own Block messages for each session are recorded (a spy on next_message), and
the frames reassembled from the socket must equal their pixels bit for bit (raw), or decode to their size
(webp). The tiny model's chunks are 9 frames (chunk 0) and 12 frames: at 64x32 rgb24 that is 55,296 bytes
(a payload sent inside its frame_batch map) and 73,728 bytes (>= 64 KiB: a frame_batch_header, then the
payload), so both forms occur; a raw chunk never exceeds 16 frames here, so the >16-frame raw split
cannot occur with this model (lingbot_core/protocols/sglang/batching.py's tests cover it), while webp chunks
split into batches of 6.
"""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path

import msgpack
import numpy as np
import pytest
import uvicorn
from PIL import Image
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from lingbot_core.protocols.sglang.server import RealtimeServer, create_app
from lingbot_core.serving.contract import Block, EngineConfig
from lingbot_core.serving.factory import create_engine
from lingbot_core.serving.streaming import StreamConfig

pytestmark = pytest.mark.usefixtures("single_thread")  # conftest: one intra-op thread for tiny tensors

ROOT = Path(__file__).resolve().parents[1]
PATH = "/v1/realtime_video/generate"
WAIT_S = 120  # generous bound on waits; never asserted as a timing
STATS_FIELDS = ("session_id", "request_id", "chunk_index", "event_id", "request_prepare_ms", "scheduler_forward_ms",
                "pace_wait_ms", "header_write_ms", "raw_payload_build_ms", "raw_write_ms", "ws_write_ms",
                "chunk_total_ms", "num_batches", "num_frames", "raw_bytes", "ws_payload_bytes", "content_type")
BATCH_FIELDS = ("request_id", "chunk_index", "content_type", "num_frames", "total_size", "frame_batch_index",
                "num_frame_batches", "is_final_frame_batch")
RAW_FIELDS = ("format", "width", "height", "channels", "bytes_per_frame", "raw_size", "encoding")
MODEL_W, MODEL_H = 64, 32  # the tiny model's frame


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.05)


def png(seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (40, 70, 3), dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


# ---------------------------------------------------------------------------------------------
# The server under test: the tiny engine, its Blocks recorded, served by uvicorn in a thread


@dataclass
class Served:
    url: str
    engine: object
    blocks: dict = field(default_factory=dict)  # session id -> the Blocks its consumer took, in order

    def drained(self) -> bool:
        return not self.engine.session_ids() and self.engine.stats()["waiting"] == 0 \
            and self.engine.pages.num_in_use == 0


@pytest.fixture(scope="module")
def served(single_thread):
    engine = create_engine(preset="tiny", engine_config=EngineConfig(max_sessions=2, max_waiting=1))
    result = Served("", engine)
    take = engine.next_message

    def spy(session_id, timeout=None):  # the oracle: what the engine handed the protocol server
        message = take(session_id, timeout)
        if isinstance(message, Block):
            result.blocks.setdefault(session_id, []).append(message)
        return message

    engine.next_message = spy
    server = RealtimeServer(engine)
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(create_app(server), host="127.0.0.1", port=port, log_level="warning",
                                       ws_per_message_deflate=False))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    wait_until(lambda: uv.started, "uvicorn to start")
    result.url = f"ws://127.0.0.1:{port}"
    try:
        yield result
    finally:
        uv.should_exit = True
        thread.join(timeout=30)
        server.close()
        engine.shutdown()


@pytest.fixture
def fresh(served):
    """Each test starts and ends with no session on the server (a test that leaves one fails here)."""
    wait_until(served.drained, "sessions of an earlier test to close")
    yield served
    wait_until(served.drained, "every session to close and return its pages")


# ---------------------------------------------------------------------------------------------
# A client written from the reference


@dataclass
class Chunk:
    stats: dict
    batches: list  # (map, payload) in arrival order
    forms: list  # "inline" (payload in the map) or "split" (frame_batch_header, then the payload)
    frames: np.ndarray | None  # raw: reassembled [N, H, W, 3]; images: decoded


class Client:
    def __init__(self, url: str):
        self.ws = connect(url + PATH, max_size=None, ping_interval=None, compression=None, open_timeout=30,
                          legacy=True)  # websockets' way to hold a connection past one `with`
        self.errors: list[dict] = []

    def send(self, **message) -> None:
        self.ws.send(msgpack.packb(message, use_bin_type=True))

    def init(self, **fields) -> None:
        fields.setdefault("prompt", "a forest path")
        fields.setdefault("first_frame", png())
        self.send(type="init", **fields)

    def event(self, kind: str, payload, event_id=None) -> None:
        self.send(type="event", kind=kind, payload=payload, event_id=event_id)

    def message(self, timeout: float = WAIT_S) -> dict:
        value = msgpack.unpackb(self.ws.recv(timeout=timeout), raw=False)
        assert isinstance(value, dict), "every server message is a msgpack map"
        return value

    def error(self) -> dict:
        message = self.message()
        assert message["type"] == "error", message
        return message

    def chunk(self, until_error: bool = False) -> Chunk | None:
        """The next chunk's frame batches and its chunk_stats (error messages on the way are kept); with
        until_error, None as soon as an error message arrives between chunks."""
        batches, forms = [], []
        while True:
            message = self.message()
            kind = message["type"]
            if kind == "error":
                self.errors.append(message)
                if until_error and not batches:
                    return None
            elif kind == "frame_batch":
                batches.append((message, message["payload"]))
                forms.append("inline")
            elif kind == "frame_batch_header":
                payload = self.ws.recv(timeout=WAIT_S)  # the bare payload is the next binary message
                assert isinstance(payload, bytes)
                assert len(payload) >= 64 * 1024, "only a payload of 64 KiB or more travels after a header"
                batches.append((message, payload))
                forms.append("split")
            elif kind == "chunk_stats":
                return Chunk(message, batches, forms, reassemble(batches, message))
            else:
                raise AssertionError(f"unexpected message type {kind!r}")

    def chunk_echoing(self, event_id: int, limit: int = 30) -> Chunk:
        for _ in range(limit):
            chunk = self.chunk()
            if chunk.stats["event_id"] == event_id:
                return chunk
        raise AssertionError(f"no chunk echoed event {event_id} within {limit} chunks")

    def closed(self) -> tuple[int, str]:
        """Read until the server closes (keeping error messages); (code, reason)."""
        with pytest.raises(ConnectionClosed) as caught:
            while True:
                data = self.ws.recv(timeout=WAIT_S)
                try:
                    message = msgpack.unpackb(data, raw=False)
                except Exception:  # a bare frame payload (msgpack raises several types on it)
                    continue
                if isinstance(message, dict) and message.get("type") == "error":
                    self.errors.append(message)
        return caught.value.rcvd.code, caught.value.rcvd.reason

    def close(self) -> None:
        self.ws.close()


def reassemble(batches: list, stats: dict) -> np.ndarray:
    """Check one chunk's batches against each other and its stats; its frames."""
    assert batches, "a chunk has at least one frame batch"
    count = len(batches)
    frames = []
    for index, (header, payload) in enumerate(batches):
        for name in BATCH_FIELDS:
            assert name in header, f"frame batch lacks {name}"
        assert "payload" not in header or header["payload"] == payload
        assert header["frame_batch_index"] == index and header["num_frame_batches"] == count
        assert header["is_final_frame_batch"] == (index == count - 1)
        assert header["chunk_index"] == stats["chunk_index"] and header["request_id"] == stats["request_id"]
        assert header["content_type"] == stats["content_type"]
        assert header.get("event_id") == stats["event_id"]
        assert header["total_size"] == len(payload)
        if header.get("encoding") == "raw":
            for name in RAW_FIELDS:
                assert name in header, f"raw frame batch lacks {name}"
            assert header["num_frames"] <= 16
            assert (header["format"], header["channels"]) == ("rgb24", 3)
            assert header["bytes_per_frame"] == header["width"] * header["height"] * 3
            assert header["raw_size"] == len(payload) == header["num_frames"] * header["bytes_per_frame"]
            frames.append(np.frombuffer(payload, np.uint8).reshape(header["num_frames"], header["height"],
                                                                   header["width"], 3))
        else:
            assert header["num_frames"] <= 6
            lengths = header["payload_lengths"]
            assert len(lengths) == header["num_frames"] and sum(lengths) == len(payload)
            offsets = np.cumsum([0, *lengths])
            for start, end in zip(offsets[:-1], offsets[1:]):
                with Image.open(io.BytesIO(payload[start:end])) as image:
                    frames.append(np.asarray(image.convert("RGB"))[None])
    for name in STATS_FIELDS:
        assert name in stats, f"chunk_stats lacks {name}"
    assert stats["num_batches"] == count
    assert stats["num_frames"] == sum(h["num_frames"] for h, _ in batches)
    assert stats["raw_bytes"] == sum(len(p) for _, p in batches)
    assert stats["ws_payload_bytes"] >= stats["raw_bytes"]
    assert stats["request_id"].startswith(stats["session_id"] + "_")
    for name in STATS_FIELDS:
        if name.endswith("_ms"):
            assert stats[name] >= 0.0, name
    assert stats["scheduler_forward_ms"] > 0 and stats["chunk_total_ms"] >= stats["scheduler_forward_ms"]
    return np.concatenate(frames)


# ---------------------------------------------------------------------------------------------
# Tests


def test_models_names_the_loaded_model(served):
    with urllib.request.urlopen(served.url.replace("ws", "http") + "/v1/models", timeout=30) as response:
        body = json.loads(response.read())
    assert body["object"] == "list"
    assert [(m["id"], m["object"]) for m in body["data"]] == [("tiny", "model")]


def test_keys_a_prompt_and_a_script_arrive_as_the_engine_made_them(fresh):
    """Raw frames equal the engine's blocks bit for bit; each chunk echoes the event its block applied."""
    client = Client(fresh.url)
    # The init's camera actions apply to chunk 0; a size the model does not make is accepted.
    client.init(size="832x480", seed=7, realtime_output_format="raw",
                condition_inputs={"camera_actions": [["l"], ["l", "unknown-token"], []]})
    chunks = [client.chunk()]
    assert chunks[0].stats["event_id"] is None  # the init's actions carry no event_id
    client.event("camera_actions", {"mode": "state", "transitions": [{"actions": ["w"], "client_ts_ms": 5}]}, 10)
    chunks.append(client.chunk_echoing(10))
    client.event("prompt", "the same path at night", 11)
    chunks.append(client.chunk_echoing(11))
    client.event("camera_actions", [["a"], ["a"], ["d"], ["d"]], 12)  # 4 latent frames: two blocks, padded
    chunks.append(client.chunk_echoing(12))
    chunks.append(client.chunk())
    session_id = chunks[0].stats["session_id"]
    client.event("dance", {}, 13)  # an unknown kind: an error, and the connection stays
    for _ in range(5):
        assert client.chunk().stats["session_id"] == session_id
        if client.errors:
            break
    assert [e["content"] for e in client.errors] == ["invalid event"] and "dance" in client.errors[0]["detail"]
    client.close()
    wait_until(lambda: session_id not in fresh.engine.session_ids(), "the disconnect to close the session")

    blocks = {b.block_index: b for b in fresh.blocks[session_id]}
    indexes = [c.stats["chunk_index"] for c in chunks]
    assert indexes[0] == 0 and indexes == sorted(set(indexes))
    for chunk in chunks:
        block = blocks[chunk.stats["chunk_index"]]  # one chunk per block, in order
        np.testing.assert_array_equal(chunk.frames, block.pixels)  # bit-exact
        assert chunk.frames.shape[1:] == (MODEL_H, MODEL_W, 3)  # the model's size, not the asked 832x480
        assert chunk.stats["num_frames"] == len(block.pixels) == (9 if block.block_index == 0 else 12)
        assert chunk.stats["scheduler_forward_ms"] == pytest.approx(block.block_ms)
    assert chunks[0].forms == ["inline"] and all(c.forms == ["split"] for c in chunks[1:])
    entries = [blocks[c.stats["chunk_index"]].replay_entry for c in chunks]
    assert entries[0]["frames"] == [["l"], ["l"], []]
    assert all("w" in keys for keys in entries[1]["frames"])
    assert entries[2]["prompt"] == "the same path at night"
    assert entries[3]["frames"] == [["a", "w"], ["a", "w"], ["d", "w"]]  # the script, with the held key
    assert entries[4]["frames"] == [["d", "w"], ["w"], ["w"]] and chunks[4].stats["event_id"] == 12


def test_max_chunks_closes_with_generation_complete_and_webp_batches_hold_six(fresh):
    client = Client(fresh.url)
    client.init(max_chunks=2, realtime_output_format="webp", realtime_preview_max_width=32, output_quality=90,
                realtime_output_pacing=True,
                first_frame="data:image/png;base64," + base64.b64encode(png(1)).decode())
    chunks = [client.chunk(), client.chunk()]
    assert client.closed() == (1000, "generation complete")
    session_id = chunks[0].stats["session_id"]
    for chunk, frames in zip(chunks, (9, 12)):
        assert chunk.stats["num_frames"] == frames and chunk.stats["num_batches"] == 2  # 6 + 3, 6 + 6
        assert chunk.frames.shape == (frames, 16, 32, 3)  # narrowed to the preview width
        header = chunk.batches[0][0]
        assert (header["source_width"], header["source_height"]) == (MODEL_W, MODEL_H)
        assert (header["preview_width"], header["preview_height"]) == (32, 16)
    assert [len(b.pixels) for b in fresh.blocks[session_id][:2]] == [9, 12]


def test_an_invalid_init_or_event_is_answered_and_the_connection_stays(fresh):
    client = Client(fresh.url)
    client.ws.send("not msgpack")  # a text frame
    assert client.error()["content"] == "invalid generate request"
    client.ws.send(msgpack.packb([1, 2, 3]))  # msgpack, but not a map
    assert client.error()["content"] == "invalid generate request"
    client.event("prompt", "first", 1)  # an event before init
    assert client.error()["content"] == "invalid generate request"
    client.init(prompt="  ")
    assert client.error()["content"] == "invalid generate request"
    client.init(first_frame="https://example.com/forest.png")
    refused = client.error()
    assert refused["content"] == "invalid generate request" and "fetches no URLs" in refused["detail"]
    client.send(type="init", prompt="no picture")
    assert client.error()["content"] == "invalid generate request"
    client.init(first_frame=b"not an image")
    assert client.error()["content"] == "invalid generate request"
    client.init(max_chunks=4)  # valid at last, on the same socket
    first = client.chunk()
    client.ws.send("text")
    client.event("camera_actions", {"mode": "held"}, 2)
    client.event("camera_actions", [["w"]], 1)
    client.event("camera_actions", [["w"]], 1)  # fine: the ids are the client's; the engine's are ours
    chunks = [client.chunk() for _ in range(3)]
    assert [c.stats["chunk_index"] for c in [first, *chunks]] == [0, 1, 2, 3]
    assert client.closed() == (1000, "generation complete")
    assert [e["content"] for e in client.errors] == ["invalid event"] * 2


def test_two_sessions_play_at_once_a_third_waits_and_a_full_line_is_refused(fresh):
    first, second = Client(fresh.url), Client(fresh.url)
    first.init(seed=1)
    second.init(seed=2)
    a, b = first.chunk(), second.chunk()
    assert a.stats["session_id"] != b.stats["session_id"]
    assert set(fresh.engine.session_ids()) == {a.stats["session_id"], b.stats["session_id"]}
    third = Client(fresh.url)
    third.init(seed=3, condition_inputs={"camera_actions": [["k"]]})  # no seat: it waits in the engine's line
    # (one place), silently as upstream; its init's camera actions wait with it
    wait_until(lambda: fresh.engine.stats()["waiting"] == 1, "the third to wait in line")
    fourth = Client(fresh.url)
    fourth.init(seed=4)
    refused = fourth.error()
    assert refused["content"] == "CAPACITY_EXHAUSTED" and "full" in refused["detail"]
    assert fourth.closed() == (1008, "CAPACITY_EXHAUSTED")
    first.chunk(), second.chunk()  # both go on
    first.close()  # its seat goes to the third
    c = third.chunk()
    assert c.stats["chunk_index"] == 0 and c.stats["session_id"] not in (a.stats["session_id"],)
    assert fresh.blocks[c.stats["session_id"]][0].replay_entry["frames"] == [["k"], [], []]
    for client in (second, third):
        client.close()


def test_our_client_plays_it(fresh):
    from lingbot_core.protocols.sglang.client import Outcome, RealtimeClient, list_models
    from lingbot_core.protocols.sglang.protocol import InitRequest

    assert list_models(fresh.url) == ["tiny"]
    with RealtimeClient.connect(fresh.url, receive_timeout=WAIT_S) as client:
        client.init(InitRequest(prompt="a village", first_frame=png(2), max_chunks=3, seed=3))
        received = [client.next_chunk()]
        sent = client.send_keys({"j"})
        received += [client.next_chunk(), client.next_chunk()]
        ended = client.next_chunk()
    assert ended.outcome is Outcome.COMPLETED, ended
    session_id = received[0].stats.session_id
    for chunk, block in zip(received, fresh.blocks[session_id]):
        np.testing.assert_array_equal(chunk.frames, block.pixels)
    blocks = {b.block_index: b for b in fresh.blocks[session_id]}
    for chunk in received:  # a chunk that echoes the keys applied them (which chunk does is up to timing)
        if chunk.event_id == sent:
            assert all("j" in keys for keys in blocks[chunk.chunk_index].replay_entry["frames"])


def headless_server() -> tuple[subprocess.Popen, str | None]:
    """`python -m lingbot_core.serve` on a free port in its own process (tiny preset): it and the URL of its ready
    line (None: it printed none)."""
    env = dict(os.environ, LINGBOT_TEST_PRESET="tiny", OMP_NUM_THREADS="1")
    process = subprocess.Popen([sys.executable, "-m", "lingbot_core.serve", "--port", "0", "--dtype", "fp32"],
                               cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in process.stdout:  # start-up lines, then the ready line
        if line.startswith("ready at "):
            return process, line.split()[2]
    return process, None


@pytest.mark.slow  # a minute or more on 2 cores: .ci/run runs it, the fast suite does not
def test_the_headless_command_serves_the_protocol():
    """python -m lingbot_core.serve in its own process: the ready line, /v1/models, one chunk, Ctrl-C."""
    process, url = headless_server()
    try:
        assert url is not None and url.endswith(PATH), "no ready line"
        base = url[:-len(PATH)]
        with urllib.request.urlopen(base.replace("ws", "http") + "/v1/models", timeout=30) as response:
            assert json.loads(response.read())["data"][0]["id"] == "tiny"
        client = Client(base)
        client.init(max_chunks=1)
        assert client.chunk().stats["num_frames"] == 9
        assert client.closed() == (1000, "generation complete")
        playing = Client(base)
        playing.init()  # a continuous session, open while the server stops
        playing.chunk()
        process.send_signal(signal.SIGINT)
        code, _ = playing.closed()
        assert code in (1000, 1001, 1012), code  # told, not dropped: uvicorn's restart code or ours
        assert process.wait(timeout=WAIT_S) == 0
        assert "Traceback" not in process.stdout.read()
    finally:
        process.send_signal(signal.SIGINT)  # Ctrl-C: uvicorn shuts down, the engine with it
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            raise


APP_SERVER = dict(engine=EngineConfig(max_sessions=2, max_waiting=1), stream=StreamConfig(), build={})  # conftest


def test_the_page_serves_the_protocol_on_its_own_port(server):
    """app.py: the same routes beside the Gradio page, on its port, over the page's engine."""
    url, engine, _ = server
    base = url.rstrip("/")
    with urllib.request.urlopen(base + "/v1/models", timeout=30) as response:
        assert [m["id"] for m in json.loads(response.read())["data"]] == ["tiny"]
    client = Client(base.replace("http", "ws", 1))
    client.init(max_chunks=1)
    chunk = client.chunk()
    assert chunk.stats["num_frames"] == 9 and chunk.frames.shape == (9, MODEL_H, MODEL_W, 3)
    assert client.closed() == (1000, "generation complete")
    wait_until(lambda: not engine.session_ids() and engine.pages.num_in_use == 0, "the page engine to drain")


def test_a_failed_block_is_reported_and_the_session_goes_on(fresh, monkeypatch):
    client = Client(fresh.url)
    client.init()
    session_id = client.chunk().stats["session_id"]
    session = fresh.engine._sessions[session_id].session  # the engine's own object: its next block fails once
    step = session.step

    def fail_once(*args, **kwargs):
        monkeypatch.setattr(session, "step", step)
        raise RuntimeError("out of memory (a test)")

    monkeypatch.setattr(session, "step", fail_once)
    while client.chunk(until_error=True) is not None:  # a block or two made before the failing one
        pass
    assert client.errors[0]["content"].startswith("error during generate loop: ")
    assert "out of memory (a test)" in client.errors[0]["content"]
    client.event("camera_actions", {"mode": "state", "transitions": [{"actions": ["w"]}]}, 1)
    client.chunk_echoing(1)  # it goes on (a block that failed with no new input waits for some)
    client.close()


def test_the_engine_closing_an_idle_session_ends_the_connection(fresh, monkeypatch):
    monkeypatch.setattr(fresh.engine, "config", replace(fresh.engine.config, idle_ttl_s=1.0))
    client = Client(fresh.url)
    client.init()
    client.chunk()
    assert client.closed() == (1000, "no input for 1 s")  # the engine's words
    assert client.errors[-1]["content"] == "session closed: no input for 1 s"


def test_a_full_length_script_waits_in_the_server_beyond_the_engines_event_queue(fresh):
    """512 latent frames are 171 engine events, past the engine's queue of 64: none is refused."""
    client = Client(fresh.url)
    client.init()
    session_id = client.chunk().stats["session_id"]
    client.event("camera_actions", [["d"]] * 512, 1)
    chunks = [client.chunk_echoing(1), client.chunk(), client.chunk()]
    assert not client.errors
    assert fresh.engine.session_status(session_id)["queued_events"] > 0
    blocks = {b.block_index: b for b in fresh.blocks[session_id]}
    for chunk in chunks:
        assert chunk.stats["event_id"] == 1
        assert blocks[chunk.stats["chunk_index"]].replay_entry["frames"] == [["d"]] * 3
    client.close()
