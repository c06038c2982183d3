"""lingbot_core.protocols.sglang.client against a tiny fake realtime server, over a real WebSocket on localhost.

The fake server is written here from the reference (../shared/reference/sglang-realtime-protocol.md) with
plain msgpack maps, not with our codec, so client and server cannot share a bug. It serves deterministic
frames (a seeded generator per chunk), so the client's reassembled pixels are checked exactly; chunk 0
has 9 frames, later chunks 20: one batch of 16 (147 KB: header-then-payload form) and one of 4 (37 KB:
inline). Before each later chunk it waits for one valid event (lockstep), so which event a chunk carries
is deterministic. Scenarios: serve, busy (error + close 1008), full (close 1008 CAPACITY_EXHAUSTED), fail
(the generate loop's error before chunk 1), drop (TCP cut mid-chunk 1), garbage (a wrong total_size), stall,
sink (records events, sends nothing).
"""

from __future__ import annotations

import io
import json
import threading
import uuid
from http import HTTPStatus

import msgpack
import numpy as np
import pytest
from PIL import Image
from websockets.exceptions import ConnectionClosed
from websockets.sync.server import serve

from lingbot_core.boundary.events import KeyStateEvent
from lingbot_core.protocols.sglang.client import (Outcome, RealtimeClient, ReceivedChunk, RemoteUnavailable, list_models)
from lingbot_core.protocols.sglang.protocol import ErrorMessage, EventMessage, InitRequest

WIDTH, HEIGHT = 64, 48


def expected_frames(seed: int, chunk: int) -> np.ndarray:
    count = 9 if chunk == 0 else 20
    return np.random.default_rng([seed, chunk]).integers(0, 256, (count, HEIGHT, WIDTH, 3), dtype=np.uint8)


class FakeRealtimeServer:
    def __init__(self, scenario: str = "serve"):
        self.scenario = scenario
        self.received: list[dict] = []  # every client message, decoded
        self.done = threading.Event()  # set when a session's handler returns
        self.server = serve(self._handle, "127.0.0.1", 0, max_size=None, ping_interval=None, compression=None,
                            process_request=self._http)
        self.url = f"ws://127.0.0.1:{self.server.socket.getsockname()[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.thread.join(timeout=10)

    @staticmethod
    def _http(connection, request):
        if request.path == "/v1/models":
            return connection.respond(HTTPStatus.OK, json.dumps({"data": [{"id": "fake-lingbot"}]}))
        return None

    def _recv(self, ws) -> dict:
        message = msgpack.unpackb(ws.recv(timeout=10), raw=False)
        self.received.append(message)
        return message

    def _send(self, ws, message: dict) -> None:
        ws.send(msgpack.packb(message, use_bin_type=True))

    def _handle(self, ws) -> None:
        try:
            self._session(ws)
        except (ConnectionClosed, TimeoutError):
            pass
        finally:
            self.done.set()

    def _session(self, ws) -> None:
        if self.scenario == "busy":
            self._recv(ws)
            self._send(ws, {"type": "error", "content": "another realtime session is already active"})
            ws.close(1008, "another realtime session is already active")
            return
        if self.scenario == "full":  # the fork's admission: a refusal reason on the close, no error message
            self._recv(ws)
            ws.close(1008, "CAPACITY_EXHAUSTED")
            return
        while True:  # an invalid init gets the error and the server waits for another
            init = self._recv(ws)
            if init.get("type") == "init" and isinstance(init.get("prompt"), str) and init["prompt"].strip():
                break
            self._send(ws, {"type": "error", "content": "invalid generate request"})
        if self.scenario == "stall":
            ws.recv()  # until the client goes away
            return
        if self.scenario == "sink":  # record every event until the client goes away
            while True:
                self._recv(ws)
        seed, event_id = init.get("seed", 42), None
        output_format = init.get("realtime_output_format", "raw")
        session = "fake"
        request_id = f"{session}_{uuid.uuid4().hex}"
        for chunk in range(init["max_chunks"]):
            while chunk > 0:
                event = self._recv(ws)
                if event.get("type") == "event" and event.get("kind") in ("prompt", "camera_actions",
                                                                          "composite_input"):
                    event_id = event.get("event_id")
                    break
                self._send(ws, {"type": "error", "content": "invalid event"})
            if self.scenario == "fail" and chunk == 1:
                self._send(ws, {"type": "error", "content": "error during generate loop: CUDA out of memory"})
                ws.close(1011, "internal error")
                return
            frames = expected_frames(seed, chunk)
            per_batch = 16 if output_format == "raw" else 6
            parts = [frames[i:i + per_batch] for i in range(0, len(frames), per_batch)]
            for index, part in enumerate(parts):
                header = {"type": "frame_batch", "request_id": request_id, "chunk_index": chunk,
                          "num_frames": len(part), "frame_batch_index": index, "num_frame_batches": len(parts),
                          "is_final_frame_batch": index == len(parts) - 1}
                if event_id is not None:
                    header["event_id"] = event_id
                if output_format == "raw":
                    payload = part.tobytes()
                    header |= {"content_type": "application/x-raw-rgb", "format": "rgb24", "width": WIDTH,
                               "height": HEIGHT, "channels": 3, "bytes_per_frame": WIDTH * HEIGHT * 3,
                               "raw_size": len(payload), "encoding": "raw"}
                else:  # lossless webp: the pixels must come back exactly
                    images = []
                    for frame in part:
                        buffer = io.BytesIO()
                        Image.fromarray(frame).save(buffer, format="WEBP", lossless=True)
                        images.append(buffer.getvalue())
                    payload = b"".join(images)
                    header |= {"content_type": "image/webp", "format": "webp", "encoding": "webp",
                               "source_width": WIDTH, "source_height": HEIGHT, "preview_width": WIDTH,
                               "preview_height": HEIGHT, "width": WIDTH, "height": HEIGHT,
                               "payload_lengths": [len(image) for image in images]}
                header["total_size"] = len(payload) + (1 if self.scenario == "garbage" else 0)
                if len(payload) >= 64 * 1024:
                    header["type"] = "frame_batch_header"
                    self._send(ws, header)
                    ws.send(payload)
                else:
                    self._send(ws, header | {"payload": payload})
                if self.scenario == "drop" and chunk == 1:
                    ws.close_socket()  # the process dies: no close frame
                    return
            self._send(ws, {"type": "chunk_stats", "session_id": session, "request_id": request_id,
                            "chunk_index": chunk, "event_id": event_id, "request_prepare_ms": 0.5,
                            "scheduler_forward_ms": 600.0 + chunk, "pace_wait_ms": 0, "header_write_ms": 0.1,
                            "raw_payload_build_ms": 0.2, "raw_write_ms": 0.3, "ws_write_ms": 0.4,
                            "chunk_total_ms": 650.0 + chunk, "num_batches": len(parts), "num_frames": len(frames),
                            "raw_bytes": frames.nbytes, "ws_payload_bytes": frames.nbytes + 500,
                            "content_type": header["content_type"]})
        ws.close(1000, "generation complete")


@pytest.fixture
def fake_server(request):
    server = FakeRealtimeServer(getattr(request, "param", "serve"))
    yield server
    server.stop()


def init(**fields) -> InitRequest:
    return InitRequest(prompt="a lakeside", first_frame=b"image bytes", size=f"{WIDTH}x{HEIGHT}", seed=5, **fields)


def test_a_session_plays_with_keys_prompt_and_stats_then_completes(fake_server):
    with RealtimeClient.connect(fake_server.url, receive_timeout=10) as client:
        client.init(init(max_chunks=3))
        first = client.next_chunk()
        assert isinstance(first, ReceivedChunk) and first.chunk_index == 0 and first.event_id is None
        np.testing.assert_array_equal(first.frames, expected_frames(5, 0))
        assert first.stats.chunk_index == 0 and first.stats.num_frames == 9
        assert first.stats.scheduler_forward_ms == 600.0 and first.stats.chunk_total_ms == 650.0

        # an event the server refuses: the error is reported and the session goes on (sent raw: our own
        # client refuses to send an unknown kind)
        client._ws.send(msgpack.packb({"type": "event", "kind": "teleport", "payload": None, "event_id": None}))
        assert client.send_engine_event(KeyStateEvent(3, frozenset({"w", "j"}))) == 3
        second = client.receive()
        assert second == ErrorMessage("invalid event")
        second = client.next_chunk()
        assert (second.chunk_index, second.event_id, second.stats.event_id) == (1, 3, 3)
        np.testing.assert_array_equal(second.frames, expected_frames(5, 1))  # 16 (header form) + 4 (inline)
        assert second.stats.num_batches == 2

        assert client.send_prompt("at night") == 4  # the next id after 3
        third = client.next_chunk()
        assert (third.chunk_index, third.event_id) == (2, 4)
        np.testing.assert_array_equal(third.frames, expected_frames(5, 2))

        ended = client.next_chunk()
        assert (ended.outcome, ended.code, ended.reason) == (Outcome.COMPLETED, 1000, "generation complete")
        assert client.next_chunk() is ended  # stays ended, at once
        assert client.errors == ["invalid event"]
    sent = fake_server.received
    assert sent[0]["type"] == "init" and sent[0]["size"] == "64x48" and sent[0]["max_chunks"] == 3
    assert sent[2] == {"type": "event", "kind": "camera_actions", "event_id": 3,
                       "payload": {"mode": "state", "transitions": [{"actions": ["j", "w"]}]}}
    assert sent[3] == {"type": "event", "kind": "prompt", "payload": "at night", "event_id": 4}


def test_event_ids_must_increase_and_init_comes_first(fake_server):
    with RealtimeClient.connect(fake_server.url, receive_timeout=10) as client:
        with pytest.raises(RuntimeError, match="init"):
            client.send_keys({"w"})
        client.init(init(max_chunks=2))
        client.send_keys({"w"}, event_id=7)
        with pytest.raises(ValueError, match="does not increase"):
            client.send_keys({"a"}, event_id=7)


@pytest.mark.parametrize("fake_server", ["sink"], indirect=True)
def test_senders_on_several_threads_get_increasing_ids_in_sending_order(fake_server):
    client = RealtimeClient.connect(fake_server.url, receive_timeout=10)
    client.init(init())
    threads = [threading.Thread(target=lambda: [client.send_keys({"w"}) for _ in range(25)]) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    client.send(EventMessage("heartbeat", None))  # a keep-alive takes no id
    client.close()
    assert fake_server.done.wait(timeout=10)
    events = fake_server.received[1:]
    assert [e["event_id"] for e in events] == list(range(100)) + [None]
    assert client.last_event_id == 99


@pytest.mark.parametrize("fake_server", ["serve"], indirect=True)
def test_webp_frames_reassemble_exactly(fake_server):
    with RealtimeClient.connect(fake_server.url, receive_timeout=10) as client:
        client.init(init(max_chunks=2, realtime_output_format="webp"))
        first = client.next_chunk()
        client.send_script([{"w"}, {"w"}, set()])
        second = client.next_chunk()
        np.testing.assert_array_equal(first.frames, expected_frames(5, 0))
        np.testing.assert_array_equal(second.frames, expected_frames(5, 1))  # batches of 6, 6, 6, 2
        assert second.stats.num_batches == 4
        assert client.next_chunk().outcome is Outcome.COMPLETED
    assert fake_server.received[1]["payload"] == [["w"], ["w"], []]


@pytest.mark.parametrize("fake_server", ["busy"], indirect=True)
def test_a_busy_server_is_a_refusal(fake_server):
    with RealtimeClient.connect(fake_server.url, receive_timeout=10) as client:
        client.init(init())
        ended = client.next_chunk()
    assert (ended.outcome, ended.code) == (Outcome.REFUSED, 1008)
    assert ended.last_error == "another realtime session is already active"
    assert "another realtime session is already active" in ended.message


@pytest.mark.parametrize("fake_server", ["full"], indirect=True)
def test_an_admission_refusal_names_its_reason(fake_server):
    with RealtimeClient.connect(fake_server.url, receive_timeout=10) as client:
        client.init(init())
        ended = client.next_chunk()
    assert (ended.outcome, ended.code, ended.reason, ended.last_error) == (Outcome.REFUSED, 1008,
                                                                          "CAPACITY_EXHAUSTED", None)
    assert "CAPACITY_EXHAUSTED" in ended.message


@pytest.mark.parametrize("fake_server", ["fail"], indirect=True)
def test_a_generate_loop_error_is_a_failed_session(fake_server):
    with RealtimeClient.connect(fake_server.url, receive_timeout=10) as client:
        client.init(init(max_chunks=3))
        assert client.next_chunk().chunk_index == 0
        client.send_keys({"w"})
        ended = client.next_chunk()
    assert (ended.outcome, ended.code) == (Outcome.FAILED, 1011)
    assert ended.last_error == "error during generate loop: CUDA out of memory"
    assert "after chunk 0" in ended.detail


@pytest.mark.parametrize("fake_server", ["garbage"], indirect=True)
def test_a_server_breaking_the_protocol_ends_the_session_clearly(fake_server):
    with RealtimeClient.connect(fake_server.url, receive_timeout=10) as client:
        client.init(init(max_chunks=1))
        ended = client.next_chunk()
    assert ended.outcome is Outcome.PROTOCOL_ERROR and "total_size" in ended.detail


@pytest.mark.parametrize("fake_server", ["drop"], indirect=True)
def test_a_server_that_drops_mid_chunk_is_a_dropped_session(fake_server):
    with RealtimeClient.connect(fake_server.url, receive_timeout=10) as client:
        client.init(init(max_chunks=3))
        assert client.next_chunk().chunk_index == 0
        client.send_keys({"s"})
        ended = client.next_chunk()  # chunk 1's first batch came, then the connection was cut
        assert (ended.outcome, ended.code) == (Outcome.DROPPED, 1006)
        assert "middle of chunk 1" in ended.detail
        with pytest.raises(Exception, match="dropped"):
            client.send_keys({"w"})


@pytest.mark.parametrize("fake_server", ["stall"], indirect=True)
def test_a_silent_server_times_out_and_the_socket_is_closed(fake_server):
    client = RealtimeClient.connect(fake_server.url, receive_timeout=0.3)
    client.init(init())
    ended = client.next_chunk()
    assert ended.outcome is Outcome.TIMEOUT and "no message" in ended.detail and ended.code is None
    assert client.receive() is ended


@pytest.mark.parametrize("fake_server", ["stall"], indirect=True)
def test_closing_from_another_thread_ends_a_blocked_receive(fake_server):
    client = RealtimeClient.connect(fake_server.url, receive_timeout=30)
    client.init(init())
    result = {}
    receiver = threading.Thread(target=lambda: result.setdefault("item", client.next_chunk()))
    receiver.start()
    ended = client.close()  # Stop / tab close while the receiver waits
    receiver.join(timeout=10)
    assert not receiver.is_alive()
    assert ended.outcome is Outcome.CLOSED and result["item"] is ended


def test_an_unreachable_server_is_a_clear_error():
    server = FakeRealtimeServer()
    url = server.url
    server.stop()
    with pytest.raises(RemoteUnavailable, match="127.0.0.1"):
        RealtimeClient.connect(url, open_timeout=2)
    with pytest.raises(ValueError, match="ws://host:port"):
        RealtimeClient.connect("http://example.org")


def test_models_are_listed(fake_server):
    assert list_models(fake_server.url) == ["fake-lingbot"]
