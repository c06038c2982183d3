"""Conformance of lingbot_core.protocols.sglang (wire format, frame batches, camera actions) to the reference
../shared/reference/sglang-realtime-protocol.md.

The expected wire maps and field lists below are written from the reference (plus the upstream facts the
reference leaves implicit: content types application/x-raw-rgb, image/webp, image/jpeg, and the image
fields source_/preview_ width/height), never from our own encoder, so a codec bug cannot agree with itself.
"""

from __future__ import annotations

import io

import msgpack
import numpy as np
import pytest
from PIL import Image

from lingbot_core.boundary.events import KeyStateEvent, ScriptEvent
from lingbot_core.protocols.sglang.actions import CameraInput, event_to_message, tokens_to_keys
from lingbot_core.protocols.sglang.batching import (IMAGE_FRAMES_PER_BATCH, RAW_FRAMES_PER_BATCH, ChunkAssembler,
                                          build_frame_batches)
from lingbot_core.protocols.sglang.protocol import (
    INVALID_EVENT, INVALID_REQUEST, MAX_SCRIPT_FRAMES, SPLIT_PAYLOAD_BYTES, CameraScript, CameraState, ChunkStats,
    CompositeInput, ErrorMessage, EventMessage, FrameBatch, InitRequest, ProtocolError, ServerMessageReader,
    Transition, decode_client_message, decode_event, decode_init, encode_client_message, encode_server_message)

INIT_FIELDS = {"prompt", "first_frame", "condition_inputs", "max_chunks", "seed", "guidance_scale", "size",
               "realtime_output_format", "realtime_preview_max_width", "realtime_output_pacing",
               "realtime_causal_sink_size", "realtime_causal_kv_cache_num_frames", "num_inference_steps", "fps",
               "output_quality", "output_compression"}
BATCH_FIELDS = {"type", "request_id", "chunk_index", "content_type", "num_frames", "total_size",
                "frame_batch_index", "num_frame_batches", "is_final_frame_batch", "event_id"}
RAW_FIELDS = {"format", "width", "height", "channels", "bytes_per_frame", "raw_size", "encoding"}
IMAGE_FIELDS = {"format", "encoding", "source_width", "source_height", "preview_width", "preview_height", "width",
                "height", "payload_lengths"}
STATS_FIELDS = {"session_id", "request_id", "chunk_index", "event_id", "request_prepare_ms",
                "scheduler_forward_ms", "pace_wait_ms", "header_write_ms", "raw_payload_build_ms", "raw_write_ms",
                "ws_write_ms", "chunk_total_ms", "num_batches", "num_frames", "raw_bytes", "ws_payload_bytes",
                "content_type"}


def pack(value) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def unpack(data: bytes):
    return msgpack.unpackb(data, raw=False)


def frames_of(count: int, height: int = 48, width: int = 64, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, height, width, 3), dtype=np.uint8)


# ---------------------------------------------------------------- init


def test_init_with_every_field_round_trips_and_keeps_unknown_keys():
    init = InitRequest(
        prompt="a lakeside at dawn", first_frame=b"\x89PNG fake bytes",
        condition_inputs={"camera_actions": CameraState((Transition(("w",), 12),))}, max_chunks=5, seed=7,
        guidance_scale=1.5, size="160x96", realtime_output_format="webp", realtime_preview_max_width=320,
        realtime_output_pacing=True, realtime_causal_sink_size=9, realtime_causal_kv_cache_num_frames=18,
        num_inference_steps=4, fps=16, output_quality=80, output_compression=70, extra={"negative_prompt": "x"})
    wire = unpack(encode_client_message(init))
    assert set(wire) == INIT_FIELDS | {"type", "negative_prompt"}
    assert wire["type"] == "init"
    assert wire["condition_inputs"] == {"camera_actions": {"mode": "state",
                                                           "transitions": [{"actions": ["w"], "client_ts_ms": 12}]}}
    assert decode_init(encode_client_message(init)) == init
    assert init.width_height == (160, 96)


def test_init_defaults_are_the_references():
    init = decode_init(pack({"type": "init", "prompt": "p"}))
    assert (init.seed, init.guidance_scale, init.size, init.num_inference_steps) == (42, 1.0, "832x480", 4)
    assert init.max_chunks is None and init.realtime_output_format == "raw" and init.first_frame is None
    # explicit None means the default too (a continuous session for max_chunks)
    assert decode_init(pack({"type": "init", "prompt": "p", "seed": None, "max_chunks": None})) == init


@pytest.mark.parametrize("first_frame", ["https://example.org/a.png", "http://h/a.jpg",
                                         "data:image/png;base64,AAAA", b"bytes"])
def test_init_first_frame_forms(first_frame):
    assert decode_init(pack({"type": "init", "prompt": "p", "first_frame": first_frame})).first_frame == first_frame


@pytest.mark.parametrize("raw", [
    {"type": "init"},
    {"type": "init", "prompt": ""},
    {"type": "init", "prompt": "   "},
    {"type": "init", "prompt": 3},
    {"type": "event", "kind": "prompt", "payload": "p"},  # anything but init first
    {"prompt": "no type"},
    {"type": "init", "prompt": "p", "max_chunks": 0},
    {"type": "init", "prompt": "p", "max_chunks": True},
    {"type": "init", "prompt": "p", "size": "832*480"},
    {"type": "init", "prompt": "p", "size": "0x480"},
    {"type": "init", "prompt": "p", "seed": "42"},
    {"type": "init", "prompt": "p", "guidance_scale": float("nan")},
    {"type": "init", "prompt": "p", "realtime_output_format": "png"},
    {"type": "init", "prompt": "p", "realtime_output_pacing": 1},
    {"type": "init", "prompt": "p", "first_frame": "file:///etc/passwd"},
    {"type": "init", "prompt": "p", "first_frame": b""},
    {"type": "init", "prompt": "p", "condition_inputs": {"camera_actions": "w"}},
    {"type": "init", "prompt": "p", "num_inference_steps": 0},
    {"type": "init", "prompt": "p", "output_quality": 101},
])
def test_invalid_init_gets_the_references_error(raw):
    with pytest.raises(ProtocolError) as caught:
        decode_init(pack(raw))
    assert caught.value.content == INVALID_REQUEST
    assert caught.value.detail  # and says what was wrong


@pytest.mark.parametrize("data", [b"\xc1", pack([1, 2]), "a text frame", pack({"type": "init", "prompt": "p"}) + b"x"])
def test_undecodable_init_gets_the_references_error(data):
    with pytest.raises(ProtocolError) as caught:
        decode_init(data)
    assert caught.value.content == INVALID_REQUEST


# ---------------------------------------------------------------- events


EVENT_CASES = [
    (EventMessage("prompt", "a snowy forest", 1),
     {"type": "event", "kind": "prompt", "payload": "a snowy forest", "event_id": 1}),
    (EventMessage("camera_actions", CameraScript((("w",), ("w", "j"), ())), 2),
     {"type": "event", "kind": "camera_actions", "payload": [["w"], ["w", "j"], []], "event_id": 2}),
    (EventMessage("camera_actions", CameraState((Transition(("d",), 1500), Transition(()))), 3),
     {"type": "event", "kind": "camera_actions", "event_id": 3,
      "payload": {"mode": "state", "transitions": [{"actions": ["d"], "client_ts_ms": 1500}, {"actions": []}]}}),
    (EventMessage("composite_input", CompositeInput((("prompt", "night"),
                                                     ("camera_actions", CameraState((Transition(("i",)),))))), 4),
     {"type": "event", "kind": "composite_input", "event_id": 4,
      "payload": {"input_types": ["prompt", "camera_actions"], "prompt": "night",
                  "camera_actions": {"mode": "state", "transitions": [{"actions": ["i"]}]}}}),
    (EventMessage("heartbeat", None, None), {"type": "event", "kind": "heartbeat", "payload": None, "event_id": None}),
]


@pytest.mark.parametrize("event, wire", EVENT_CASES, ids=[c[0].kind for c in EVENT_CASES])
def test_every_event_kind_has_the_references_wire_form_and_round_trips(event, wire):
    assert unpack(encode_client_message(event)) == wire
    assert decode_event(pack(wire)) == event
    assert decode_client_message(pack(wire)) == event


def test_unknown_tokens_pass_the_wire_and_are_ignored_by_the_mapping():
    event = decode_event(pack({"type": "event", "kind": "camera_actions", "payload": [["w", "jump", "ArrowUp"]],
                               "event_id": None}))
    assert event.payload.frames == (("w", "jump", "ArrowUp"),) and event.event_id is None
    assert tokens_to_keys(event.payload.frames[0]) == {"w"}


@pytest.mark.parametrize("raw", [
    {"type": "event", "kind": "teleport", "payload": None, "event_id": 1},
    {"type": "event", "payload": "p", "event_id": 1},
    {"type": "event", "kind": "prompt", "payload": "", "event_id": 1},
    {"type": "event", "kind": "prompt", "payload": ["p"], "event_id": 1},
    {"type": "event", "kind": "prompt", "payload": "p", "event_id": "1"},
    {"type": "event", "kind": "prompt", "payload": "p", "event_id": -1},
    {"type": "event", "kind": "camera_actions", "payload": [["w", 3]], "event_id": 1},
    {"type": "event", "kind": "camera_actions", "payload": [], "event_id": 1},
    {"type": "event", "kind": "camera_actions", "payload": [[]] * (MAX_SCRIPT_FRAMES + 1), "event_id": 1},
    {"type": "event", "kind": "camera_actions", "payload": {"transitions": [{"actions": ["w"]}]}, "event_id": 1},
    {"type": "event", "kind": "camera_actions", "payload": {"mode": "state", "transitions": []}, "event_id": 1},
    {"type": "event", "kind": "camera_actions", "payload": {"mode": "state", "transitions": [{"keys": ["w"]}]},
     "event_id": 1},
    {"type": "event", "kind": "camera_actions",
     "payload": {"mode": "state", "transitions": [{"actions": ["w"], "client_ts_ms": "now"}]}, "event_id": 1},
    {"type": "event", "kind": "composite_input", "payload": {"input_types": ["teleport"], "teleport": 1},
     "event_id": 1},
    {"type": "event", "kind": "composite_input", "payload": {"input_types": ["prompt"]}, "event_id": 1},
    {"type": "event", "kind": "composite_input", "payload": {"input_types": ["prompt"], "prompt": ""},
     "event_id": 1},
    {"type": "event", "kind": "composite_input",
     "payload": {"input_types": ["prompt"], "prompt": "p", "camera_actions": [["w"]]}, "event_id": 1},
    {"type": "init", "prompt": "p"} | {"type": "nonsense"},
])
def test_invalid_event_gets_the_references_error(raw):
    with pytest.raises(ProtocolError) as caught:
        decode_event(pack(raw))
    assert caught.value.content == INVALID_EVENT
    assert caught.value.detail


# ---------------------------------------------------------------- frame batches


def read_all(messages: list[bytes]) -> list:
    reader, out = ServerMessageReader(), []
    for data in messages:
        message = reader.feed(data)
        if message is not None:
            out.append(message)
    assert not reader.awaiting_payload
    return out


def test_raw_chunk_splits_into_batches_of_16_and_reassembles_bit_exact():
    frames = frames_of(40)
    batches = build_frame_batches(frames, request_id="sess_1", chunk_index=3, event_id=7)
    assert [b.num_frames for b in batches] == [RAW_FRAMES_PER_BATCH, RAW_FRAMES_PER_BATCH, 8]
    messages = [m for b in batches for m in encode_server_message(b)]
    received = read_all(messages)
    assert received == batches
    assembler = ChunkAssembler()
    assert [assembler.add(b) for b in received[:-1]] == [None, None]
    chunk = assembler.add(received[-1])
    assert (chunk.chunk_index, chunk.event_id, chunk.request_id, chunk.num_batches) == (3, 7, "sess_1", 3)
    np.testing.assert_array_equal(chunk.frames, frames)


def test_raw_wire_form_has_the_references_fields():
    batch = build_frame_batches(frames_of(2, 8, 8), request_id="s_u", chunk_index=0, event_id=None)[0]
    (message,) = encode_server_message(batch)
    wire = unpack(message)
    assert set(wire) == (BATCH_FIELDS - {"event_id"}) | RAW_FIELDS | {"payload"}  # no event applied yet
    assert wire["type"] == "frame_batch" and wire["content_type"] == "application/x-raw-rgb"
    assert (wire["format"], wire["channels"], wire["encoding"]) == ("rgb24", 3, "raw")
    assert wire["bytes_per_frame"] == 8 * 8 * 3 and wire["raw_size"] == wire["total_size"] == 2 * 8 * 8 * 3
    assert (wire["frame_batch_index"], wire["num_frame_batches"], wire["is_final_frame_batch"]) == (0, 1, True)


def test_a_payload_of_64_kib_or_more_travels_as_header_then_payload():
    # 64x48 rgb24 = 9216 bytes a frame: 16 frames (147456 B) split, the 4 left (36864 B) stay inline
    frames = frames_of(20)
    batches = build_frame_batches(frames, request_id="s_u", chunk_index=0, event_id=2)
    first, second = (encode_server_message(b) for b in batches)
    assert len(first) == 2 and len(second) == 1
    header = unpack(first[0])
    assert header["type"] == "frame_batch_header" and "payload" not in header
    assert set(header) == BATCH_FIELDS | RAW_FIELDS
    assert first[1] == frames[:16].tobytes()  # the bare payload, not msgpack
    assert unpack(second[0])["type"] == "frame_batch"
    assembler = ChunkAssembler()
    chunks = [assembler.add(b) for b in read_all(first + second)]
    np.testing.assert_array_equal(chunks[-1].frames, frames)


def test_the_split_threshold_is_exactly_64_kib():
    def batch(size: int) -> FrameBatch:
        return FrameBatch(request_id="r", chunk_index=0, content_type="application/x-raw-rgb", num_frames=size // 3,
                          total_size=size, frame_batch_index=0, num_frame_batches=1, is_final_frame_batch=True,
                          event_id=None, payload=bytes(size), format="rgb24", encoding="raw", width=size // 3,
                          height=1, channels=3, bytes_per_frame=3, raw_size=size)
    below = SPLIT_PAYLOAD_BYTES - 1 - (SPLIT_PAYLOAD_BYTES - 1) % 3  # whole frames of 3 bytes
    assert len(encode_server_message(batch(below))) == 1
    at = SPLIT_PAYLOAD_BYTES + (-SPLIT_PAYLOAD_BYTES) % 3
    assert len(encode_server_message(batch(at))) == 2


@pytest.mark.parametrize("output_format", ["jpeg", "webp"])
def test_image_chunks_split_into_batches_of_6_with_payload_lengths(output_format):
    frames = frames_of(14, 48, 64)
    batches = build_frame_batches(frames, request_id="s_u", chunk_index=1, event_id=4, output_format=output_format,
                                  preview_max_width=32)
    assert [b.num_frames for b in batches] == [IMAGE_FRAMES_PER_BATCH, IMAGE_FRAMES_PER_BATCH, 2]
    wire = unpack(encode_server_message(batches[0])[0])
    assert set(wire) == BATCH_FIELDS | IMAGE_FIELDS | {"payload"}
    assert wire["content_type"] == f"image/{output_format}"
    assert (wire["source_width"], wire["source_height"]) == (64, 48)
    assert (wire["preview_width"], wire["preview_height"]) == (wire["width"], wire["height"]) == (32, 24)
    assert sum(wire["payload_lengths"]) == wire["total_size"] == len(wire["payload"])
    assembler = ChunkAssembler()
    chunk = [assembler.add(b) for b in read_all([m for b in batches for m in encode_server_message(b)])][-1]
    # each image decodes (independently of our assembler) to what the assembler returns
    expected = []
    for b in batches:
        offset = 0
        for length in b.payload_lengths:
            expected.append(np.asarray(Image.open(io.BytesIO(b.payload[offset:offset + length])).convert("RGB")))
            offset += length
    np.testing.assert_array_equal(chunk.frames, np.stack(expected))
    assert chunk.frames.shape == (14, 24, 32, 3)
    # the preview is a downscaled picture of the source, not noise: compare with PIL's own downscale
    small = np.stack([np.asarray(Image.fromarray(f).resize((32, 24), Image.Resampling.BICUBIC)) for f in frames])
    assert np.abs(chunk.frames.astype(int) - small).mean() < 40


def test_an_empty_chunk_is_one_empty_batch():
    (batch,) = build_frame_batches(frames_of(0), request_id="r", chunk_index=0, event_id=None)
    chunk = ChunkAssembler().add(read_all(encode_server_message(batch))[0])
    assert chunk.frames.shape == (0, 48, 64, 3)


def test_frames_must_be_uint8_rgb():
    with pytest.raises(ValueError, match="uint8"):
        build_frame_batches(np.zeros((2, 4, 4, 3), np.float32), request_id="r", chunk_index=0, event_id=None)
    with pytest.raises(ValueError, match="raw, webp or jpeg"):
        build_frame_batches(frames_of(1), request_id="r", chunk_index=0, event_id=None, output_format="png")


def test_batches_out_of_order_or_across_chunks_are_protocol_errors():
    batches = build_frame_batches(frames_of(20), request_id="r", chunk_index=0, event_id=None)
    with pytest.raises(ProtocolError, match="batch 1 arrived where batch 0"):
        ChunkAssembler().add(batches[1])
    assembler = ChunkAssembler()
    assembler.add(batches[0])
    other = build_frame_batches(frames_of(20), request_id="r", chunk_index=1, event_id=None)[0]
    with pytest.raises(ProtocolError, match="began before chunk 0"):
        assembler.add(other)
    done = ChunkAssembler()
    for b in batches:
        done.add(b)
    with pytest.raises(ProtocolError, match="after chunk 0"):
        done.add(batches[0])


def test_reader_refuses_inconsistent_batches():
    (batch,) = build_frame_batches(frames_of(2, 8, 8), request_id="r", chunk_index=0, event_id=None)
    wire = unpack(encode_server_message(batch)[0])
    for change in ({"total_size": 5}, {"raw_size": 1}, {"bytes_per_frame": 7}, {"payload": b"short"},
                   {"is_final_frame_batch": False}, {"content_type": "video/mp4"}, {"channels": 4}):
        with pytest.raises(ProtocolError):
            ServerMessageReader().feed(pack(wire | change))
    header = dict(wire, type="frame_batch_header")
    del header["payload"]
    reader = ServerMessageReader()
    assert reader.feed(pack(header)) is None and reader.awaiting_payload
    with pytest.raises(ProtocolError, match="followed by its binary payload"):
        reader.feed("text")
    with pytest.raises(ProtocolError, match="unknown server message type"):
        ServerMessageReader().feed(pack({"type": "surprise"}))


# ---------------------------------------------------------------- chunk_stats and error


def test_chunk_stats_with_every_field_round_trips():
    stats = ChunkStats(session_id="sess", request_id="sess_u", chunk_index=2, event_id=5, request_prepare_ms=1.5,
                       scheduler_forward_ms=640.0, pace_wait_ms=0.0, header_write_ms=0.25, raw_payload_build_ms=3.0,
                       raw_write_ms=4.0, ws_write_ms=4.25, chunk_total_ms=700.5, num_batches=1, num_frames=12,
                       raw_bytes=14_376_960, ws_payload_bytes=14_377_200, content_type="application/x-raw-rgb",
                       extra={"header_pack_ms": 0.1})
    (message,) = encode_server_message(stats)
    wire = unpack(message)
    assert set(wire) == STATS_FIELDS | {"type", "header_pack_ms"} and wire["type"] == "chunk_stats"
    assert read_all([message]) == [stats]
    # integers where floats are expected are fine (msgpack keeps 0 as an int)
    assert read_all([pack(dict(wire, pace_wait_ms=0))])[0].pace_wait_ms == 0.0
    with pytest.raises(ProtocolError, match="chunk_stats lacks chunk_total_ms"):
        ServerMessageReader().feed(pack({k: v for k, v in wire.items() if k != "chunk_total_ms"}))


def test_error_message_round_trips():
    (message,) = encode_server_message(ErrorMessage("invalid event"))
    assert unpack(message) == {"type": "error", "content": "invalid event"}
    assert read_all([message]) == [ErrorMessage("invalid event")]


# ---------------------------------------------------------------- our events and keys <-> camera actions


def test_our_events_become_one_protocol_event_under_the_same_id():
    held = event_to_message(KeyStateEvent(4, frozenset({"w", "j"})))
    assert unpack(encode_client_message(held)) == {
        "type": "event", "kind": "camera_actions", "event_id": 4,
        "payload": {"mode": "state", "transitions": [{"actions": ["j", "w"]}]}}
    script = event_to_message(ScriptEvent(5, (frozenset("w"), frozenset(), frozenset("dl"))))
    assert unpack(encode_client_message(script))["payload"] == [["w"], [], ["d", "l"]]
    switch = event_to_message(KeyStateEvent(6, frozenset(), prompt="at night"))
    assert unpack(encode_client_message(switch)) == {
        "type": "event", "kind": "composite_input", "event_id": 6,
        "payload": {"input_types": ["prompt", "camera_actions"], "prompt": "at night",
                    "camera_actions": {"mode": "state", "transitions": [{"actions": []}]}}}


def test_camera_input_holds_keys_until_the_next_transition():
    camera = CameraInput()
    camera.apply(CameraState((Transition(("w", "jump")),)))
    assert camera.next_block(3) == (frozenset("w"),) * 3
    assert camera.next_block(3) == (frozenset("w"),) * 3  # level-triggered: still held
    camera.apply(CameraState((Transition(()),)))
    assert camera.next_block(2) == (frozenset(),) * 2


def test_a_short_press_lasts_at_least_one_frame_and_resends_cost_nothing():
    camera = CameraInput()
    camera.apply(CameraState((Transition(("d",)), Transition(()))))  # press and release between two frames
    assert camera.next_block(3) == (frozenset("d"), frozenset(), frozenset())
    for _ in range(20):  # the web UI resends the held state every 100 ms
        camera.apply(CameraState((Transition(("w",)),)))
    camera.apply(CameraState((Transition(("a",)),)))
    assert camera.next_block(3) == (frozenset("w"), frozenset("a"), frozenset("a"))


def test_scripts_queue_fifo_pad_with_no_keys_and_cap_at_512():
    camera = CameraInput(held="w")
    camera.apply(CameraScript((("a",), ("s",), ("d",), ("i",))))
    assert camera.next_block(3) == (frozenset("a"), frozenset("s"), frozenset("d"))
    assert camera.next_block(3) == (frozenset("i"), frozenset(), frozenset())  # padded with []
    assert camera.next_block(2) == (frozenset("w"),) * 2  # script done: the held keys again
    assert camera.apply(CameraScript(((),) * 500)) == 0
    assert camera.apply(CameraScript((("w",),) * 20)) == 8  # 512 queued at most
    assert camera.queued_script_frames == MAX_SCRIPT_FRAMES
