"""vLLM-Omni's realtime video messages (protocols/vllm_omni): parsing, upstream's error texts, builders, keys.

Cases and texts come from ../shared/reference/vllm-omni-realtime-protocol.md.
"""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from lingbot_core.config import CameraConfig
from lingbot_core.model.camera import CameraState, integrate_actions, rotation_y
from lingbot_core.model.camera_motion import CameraMotion, advance, pose_matrix
from lingbot_core.protocols.vllm_omni import messages as m
from lingbot_core.protocols.vllm_omni.keys import (
    MOVE_STEP,
    PITCH_STEP_DEG,
    YAW_STEP_DEG,
    script_from_blocks,
    velocity_delta,
    velocity_payload,
)

MODEL = "robbyant/lingbot-world-v2-14b-causal-fast-diffusers"
IMAGE = "data:image/png;base64,iVBORw0KGgo="


def start(**fields) -> dict:
    msg = {"type": "session.start", "prompt": "The camera moves slowly forward.",
           "image_reference": {"image_url": IMAGE}}
    msg.update(fields)
    return {k: v for k, v in msg.items() if v is not ...}  # `...` removes a key


def parse_start(msg: dict | str, served: str | None = MODEL) -> m.SessionStart:
    return m.parse_start(msg if isinstance(msg, str) else json.dumps(msg), served)


def start_error(msg: dict | str, served: str | None = MODEL) -> m.ProtocolError:
    with pytest.raises(m.ProtocolError) as info:
        parse_start(msg, served)
    assert info.value.fatal and info.value.code is None and info.value.event_id is None
    return info.value


def control(msg: dict | str) -> m.ControlMessage:
    return m.parse_control(msg if isinstance(msg, str) else json.dumps(msg))


def control_error(msg: dict | str) -> m.ProtocolError:
    with pytest.raises(m.ProtocolError) as info:
        control(msg)
    assert not info.value.fatal
    return info.value


def interaction(event: dict | None = None, **body) -> dict:
    if event is not None:
        body["event"] = event
    return {"type": "session.interaction", "interaction": body}


def camera_event(**camera) -> dict:
    return {"multi_modal_data": {"camera": camera}}


def padded(msg: dict, total: int) -> str:
    """`msg` as JSON of exactly `total` characters (a "pad" string fills it)."""
    base = json.dumps({**msg, "pad": ""})
    return json.dumps({**msg, "pad": "x" * (total - len(base))})


# ---------------------------------------------------------------- constants


def test_constants_are_the_references():
    assert m.PATH == "/v1/realtime/video"
    assert (m.START_MAX_CHARS, m.CONTROL_MAX_CHARS) == (4 * 1024 * 1024, 128 * 1024)
    assert (m.START_TIMEOUT_S, m.STALL_TIMEOUT_S) == (10.0, 60.0)
    assert (m.CAMERA_TRANSITION_CHUNKS_DEFAULT, m.PROMPT_TRANSITION_CHUNKS_DEFAULT) == (1, 3)
    assert m.START_TIMEOUT == "Timeout waiting for session.start"
    assert m.STALL_TIMEOUT == "Stall timeout: no generation progress"
    assert m.INTERACTION_FAILED_MESSAGE == "Failed to apply interaction"


# ---------------------------------------------------------------- session.start


def test_the_reference_example_start_parses():
    text = ('{"type":"session.start","model":"robbyant/lingbot-world-v2-14b-causal-fast-diffusers",'
            '"prompt":"The camera moves slowly forward.","image_reference":{"image_url":"data:image/png;base64,iVBOR"},'
            '"width":832,"height":480,"num_frames":129,"fps":16,"seed":42,"extra_params":{"flow_shift":5.0}}')
    s = parse_start(text)
    assert (s.model, s.prompt) == (MODEL, "The camera moves slowly forward.")
    assert s.image_url == "data:image/png;base64,iVBOR"
    assert (s.width, s.height, s.num_frames, s.fps, s.seed, s.flow_shift) == (832, 480, 129, 16, 42, 5.0)
    assert (s.num_inference_steps, s.camera_action_script, s.action_path, s.codec_options) == (None,) * 4
    assert s.streaming_buffer_seconds is None
    assert s.config["image_reference"] == {"image_url": "data:image/png;base64,iVBOR"}
    assert s.config["extra_params"] == {"flow_shift": 5.0} and s.config["generate_sound"] is False
    assert "type" not in s.config and "format" not in s.config


def test_start_defaults_and_spellings():
    s = parse_start(start(), served=None)
    assert s.fps == 24 and s.config["fps"] == 24  # [REQ] default
    assert (s.model, s.width, s.height, s.num_frames, s.seed) == (None,) * 5
    assert parse_start(start(model="other"), served=None).model == "other"  # no served name: no check
    assert parse_start(start(prompt="  a \n  b ")).prompt == "a b"  # cleaned once, at the boundary
    s = parse_start(start(width=100, height=100, size="832x480"))
    assert (s.width, s.height) == (832, 480)  # size overrides
    s = parse_start(start(video_params={"width": 832, "height": 480, "fps": 16, "num_frames": 33}))
    assert (s.width, s.height, s.fps, s.num_frames) == (832, 480, 16, 33)
    s = parse_start(start(fps=8, video_params={"fps": 16, "num_frames": 33}))
    assert (s.fps, s.num_frames) == (8, 33)  # top level first
    assert parse_start(start(seconds="2", fps=16)).num_frames == 32
    assert parse_start(start(seconds="2")).num_frames == 48  # x the default 24
    assert parse_start(start(seconds="2", num_frames=33)).num_frames == 33
    assert parse_start(start(fps=16.0)).fps == 16  # an integral float, as pydantic takes it
    assert parse_start(start(unknown_key={"x": 1})).config.get("unknown_key") is None  # ignored
    assert parse_start(start(image_reference={"image_url": "https://example.com/a.png"})).image_url.startswith("https")
    assert parse_start(start(format="m4s")).fps == 24


def test_start_flow_shift_and_extra_params():
    assert parse_start(start(flow_shift=3.0)).flow_shift == 3.0
    assert parse_start(start(flow_shift=3.0, extra_params={"flow_shift": 5})).flow_shift == 5.0  # extra wins
    s = parse_start(start(extra_params={"camera_action_script": [[["W"], ["w", "D"], []]], "action_path": "p",
                                        "video_codec_options": {"preset": "fast"}}, streaming_buffer_seconds=1.25))
    assert s.camera_action_script == ((frozenset("w"), frozenset("wd"), frozenset()),)
    assert (s.action_path, s.codec_options, s.streaming_buffer_seconds) == ("p", {"preset": "fast"}, 1.25)
    assert parse_start(start(extra_params={"preencode_mp4": False})).fps == 24


def test_start_sampling_params_are_lifted_or_merged():
    s = parse_start(start(seed=1, sampling_params={"seed": 2, "num_inference_steps": 4, "flow_shift": 7.0,
                                                    "custom": "x"}, extra_params={"a": 1}))
    assert s.seed == 1  # already at top level: stays, the sampling value goes to extra_params
    assert s.num_inference_steps == 4 and s.flow_shift == 7.0  # lifted
    assert s.config["extra_params"] == {"a": 1, "seed": 2, "custom": "x"}
    assert parse_start(start(sampling_params=[1, 2])).seed is None  # not an object: dropped


def test_start_transport_errors_are_upstreams():
    assert str(start_error("not json")) == "Invalid JSON in session.start"
    assert str(start_error("[" * 100_000 + "]" * 100_000)) == "Invalid JSON in session.start"  # deep nesting
    assert str(start_error('{"seed": ' + "9" * 5000 + "}")) == "Invalid JSON in session.start"  # int() digit limit
    assert str(start_error("[1, 2]")) == "session.start must be a JSON object"
    assert str(start_error(start(type="init"))) == "Expected session.start, got: init"
    assert str(start_error(start(type=...))) == "Expected session.start, got: None"
    assert str(start_error(interaction({"prompt": "x"}))) == "Expected session.start, got: session.interaction"
    assert str(start_error(start(format="mp4"))) == "Invalid session.start format: expected 'm4s'."
    assert str(start_error(start(format=None))) == "Invalid session.start format: expected 'm4s'."
    assert str(start_error(start(model="someone/else"))) == (
        f"Model mismatch: request specifies 'someone/else' but server is running '{MODEL}'.")
    long_type = start_error(start(type="t" * 10_000)).message
    assert long_type.startswith("Expected session.start, got: 'ttt") and len(long_type) < 200  # bounded echo


def test_start_size_cap_is_on_the_decoded_string_length():
    ok = padded(start(), m.START_MAX_CHARS)
    assert len(ok) == m.START_MAX_CHARS and parse_start(ok).fps == 24
    assert str(start_error(padded(start(), m.START_MAX_CHARS + 1))) == "session.start message too large"
    wide = padded(start(), m.START_MAX_CHARS).replace("x", "é")  # twice the bytes, the same characters
    assert len(wide.encode()) > m.START_MAX_CHARS and parse_start(wide).fps == 24


@pytest.mark.parametrize("fields,detail", [
    ({"prompt": ...}, "prompt is required"),
    ({"prompt": "   "}, "prompt is empty"),
    ({"prompt": 5}, "prompt must be a string"),
    ({"prompt": "\ud800"}, "not valid Unicode"),
    ({"prompt": "x" * 20_000}, "the limit is"),
    ({"image_reference": ...}, "image_reference is required"),
    ({"image_reference": {"file_id": "file-1"}}, "not supported yet"),
    ({"image_reference": {"image_url": IMAGE, "detail": "high"}}, "exactly one key"),
    ({"image_reference": {}}, "exactly one key"),
    ({"image_reference": {"image_url": "file:///etc/passwd"}}, "data:image/ URL or an http(s) URL"),
    ({"image_reference": "data:image/png;base64,AA"}, "must be an object"),
    ({"width": 0}, "width must be at least 1"),
    ({"width": "832"}, "width must be an integer"),
    ({"height": True}, "height must be an integer"),
    ({"fps": 16.5}, "fps must be an integer"),
    ({"num_frames": 0}, "num_frames must be at least 1"),
    ({"size": "832*480"}, "size must be 'WxH'"),
    ({"size": "0x480"}, "size must be 'WxH'"),
    ({"seconds": 4}, "seconds must be a whole number"),
    ({"video_params": [832, 480]}, "video_params must be an object"),
    ({"video_params": {"num_frames": -1}}, "video_params.num_frames must be at least 1"),
    ({"num_inference_steps": 201}, "num_inference_steps must be at most 200"),
    ({"flow_shift": -1}, "flow_shift must be a positive finite number"),
    ({"flow_shift": 0}, "flow_shift must be a positive finite number"),
    ({"extra_params": {"flow_shift": "5"}}, "extra_params.flow_shift must be a positive finite number"),
    ({"streaming_buffer_seconds": 0}, "streaming_buffer_seconds must be a positive finite number"),
    ({"model": 3}, "model must be a string"),
    ({"extra_params": [1]}, "extra_params must be an object"),
    ({"extra_params": {"preencode_mp4": True}}, "preencode_mp4 is not supported"),
    ({"extra_params": {"video_codec_options": {"crf": 18}}}, "video_codec_options must map names to strings"),
    ({"extra_params": {"action_path": ""}}, "action_path must not be empty"),
    ({"extra_params": {"camera_action_script": []}}, "non-empty list"),
    ({"extra_params": {"camera_action_script": [[["w"], []]]}}, "chunk 0 must be a list of exactly 3"),
    ({"extra_params": {"camera_action_script": [[["w"], [], ["up"]]]}}, "chunk 0 frame 2 holds 'up'"),
    ({"extra_params": {"camera_action_script": [[["w"], [], ["\u212a"]]]}}, "chunk 0 frame 2 holds"),  # Kelvin
    ({"extra_params": {"camera_action_script": [[["w"], "wd", []]]}}, "chunk 0 frame 1 must be a list"),
])
def test_start_field_errors(fields, detail):
    exc = start_error(start(**fields))
    assert exc.message.startswith("Invalid session.start: ") and detail in exc.message


def test_start_refuses_non_finite_numbers():
    text = json.dumps(start(flow_shift=1.0)).replace("1.0", "NaN")  # Python's json reads NaN, as upstream's does
    assert "flow_shift must be a positive finite number" in start_error(text).message
    assert "must be an integer" in start_error(json.dumps(start(fps=1.0)).replace("1.0", "Infinity")).message


# ---------------------------------------------------------------- control messages


def test_ping_stop_playback():
    assert control({"type": "session.ping"}) == m.Ping()
    assert control({"type": "session.stop", "extra": 1}) == m.Stop()
    assert control({"type": "session.playback", "position_seconds": 1.5}) == m.Playback(1.5)
    for bad in (-0.1, "1", None, True):
        assert "position_seconds" in control_error({"type": "session.playback", "position_seconds": bad}).message
    assert "position_seconds" in control_error('{"type": "session.playback", "position_seconds": Infinity}').message


def test_control_transport_errors_are_upstreams_and_not_fatal():
    assert str(control_error("{oops")) == "Invalid JSON message"
    assert str(control_error("[" * 100_000)) == "Invalid JSON message"
    assert str(control_error('"text"')) == "WebSocket messages must be JSON objects"
    assert str(control_error({"type": "session.shout"})) == "Unknown message type: session.shout"
    assert str(control_error({"kind": "x"})) == "Unknown message type: None"
    assert str(control_error({"type": "session.start", "prompt": "x"})) == "Unknown message type: session.start"


def test_control_size_cap_is_on_the_decoded_string_length():
    assert control(padded({"type": "session.ping"}, m.CONTROL_MAX_CHARS)) == m.Ping()
    assert str(control_error(padded({"type": "session.ping"}, m.CONTROL_MAX_CHARS + 1))) == "control message too large"
    wide = padded({"type": "session.ping"}, m.CONTROL_MAX_CHARS).replace("x", "\u00e9")
    assert len(wide.encode()) > m.CONTROL_MAX_CHARS and control(wide) == m.Ping()


def test_the_reference_example_interaction_parses():
    text = ('{"type":"session.interaction","interaction":{"event_id":"fwd-1","event":{"multi_modal_data":{"camera":'
            '{"mode":"velocity","data":{"translation":[0,0,0.05],"rotation":[0,0,0,1]}}}}}}')
    assert control(text) == m.Interaction("fwd-1", None, m.CameraCommand("velocity", (0, 0, 0.05), (0, 0, 0, 1)), None)


def test_interaction_prompt_camera_and_defaults():
    got = control(interaction({"prompt": " a  snowy   street ", "other": "forwarded"}, transition_chunks=2))
    assert got == m.Interaction(None, "a snowy street", None, 2)  # event_id None: the server assigns one
    got = control(interaction(camera_event(data={}), event_id="c"))
    assert got.camera == m.CameraCommand("target", (0.0, 0.0, 0.0), (0.0, 0.0, 0.0, 1.0))  # every default
    assert got.transition_chunks is None and got.prompt is None
    got = control(interaction({"prompt": "  ", **camera_event(data={"rotation": [0, 0, 0, 2]})}))
    assert got.prompt is None and got.camera.rotation == (0.0, 0.0, 0.0, 1.0)  # normalised
    q = control(interaction(camera_event(data={"rotation": [1, 1, 1, 1]}))).camera.rotation
    assert q == pytest.approx((0.5, 0.5, 0.5, 0.5)) and math.isclose(math.hypot(*q), 1.0)
    got = control(interaction({"prompt": "p", "multi_modal_data": {"camera": {"data": {}}, "audio": {}}}))
    assert got.prompt == "p" and got.camera is not None and got.other_modalities == ("audio",)
    assert control(interaction({"prompt": "p", "multi_modal_data": {}})).camera is None


@pytest.mark.parametrize("value,expected", [(0, 0), (3, 3), (2.0, 2), (None, None)])
def test_interaction_transition_chunks_accepted(value, expected):
    assert control(interaction({"prompt": "p"}, transition_chunks=value)).transition_chunks == expected


@pytest.mark.parametrize("msg,text", [
    ({"type": "session.interaction"}, "session.interaction requires an interaction object"),
    ({"type": "session.interaction", "interaction": [1]}, "session.interaction requires an interaction object"),
    (interaction({"prompt": "p"}, event_id=""), "session.interaction event_id must be a non-empty string"),
    (interaction({"prompt": "p"}, event_id=7), "session.interaction event_id must be a non-empty string"),
    (interaction(None), m.EMPTY_EVENT),
    (interaction("p"), m.EMPTY_EVENT),
    (interaction({}), m.EMPTY_EVENT),
    (interaction({"prompt": "   "}), m.EMPTY_EVENT),
    (interaction({"prompt": "", "multi_modal_data": {}}), m.EMPTY_EVENT),
    (interaction({"prompt": 5}), m.EMPTY_EVENT),
    (interaction({"prompt": "p", "negative_prompt": "blur"}),
     "session.interaction negative_prompt is not supported in this release"),
    (interaction({"prompt": 5, **camera_event(data={})}), "session.interaction event.prompt must be a string"),
    (interaction({"prompt": "p", "multi_modal_data": [1]}),
     "session.interaction event.multi_modal_data must be an object"),
    (interaction({"multi_modal_data": {"camera": "w"}}),
     "session.interaction event.multi_modal_data.camera must be an object"),
    (interaction({"prompt": "p"}, transition_chunks=True), "session.interaction transition_chunks must be an integer"),
    (interaction({"prompt": "p"}, transition_chunks=1.5), "session.interaction transition_chunks must be an integer"),
    (interaction({"prompt": "p"}, transition_chunks="1"), "session.interaction transition_chunks must be an integer"),
    (interaction({"prompt": "p"}, transition_chunks=-1), "session.interaction transition_chunks must be >= 0"),
])
def test_interaction_transport_errors(msg, text):
    exc = control_error(msg)
    assert str(exc) == text and exc.code is None and exc.event_id is None


def test_empty_event_text_is_the_references_completed():
    assert m.EMPTY_EVENT.endswith("requires a non-empty event.prompt and/or non-empty event.multi_modal_data")
    assert m.EMPTY_EVENT.startswith("session.interaction ")


@pytest.mark.parametrize("camera,detail", [
    ({"mode": "velocity", "data": {"actions": ["w"]}}, m.CAMERA_ACTIONS),
    ({"mode": "orbit", "data": {}}, "camera mode must be 'target' or 'velocity'"),
    ({"mode": "velocity"}, "camera data must be an object"),
    ({"data": [0, 0, 1]}, "camera data must be an object"),
    ({"data": {"translation": [0, 0]}}, "camera translation must be a length-3 list/tuple"),
    ({"data": {"translation": None}}, "camera translation must be a length-3 list/tuple"),
    ({"data": {"translation": [0, 0, "1"]}}, "camera translation must be non-nan and non-inf"),
    ({"data": {"rotation": [0, 0, 1]}}, "camera rotation must be a length-4 list/tuple (x, y, z, w)"),
    ({"data": {"rotation": [0, 0, 0, 0]}}, "camera rotation quaternion must be non-zero"),
    ({"data": {"rotation": [0, 0, True, 1]}}, "camera rotation must be non-nan and non-inf"),
])
def test_camera_the_engine_refuses_is_interaction_failed(camera, detail):
    exc = control_error(interaction({"multi_modal_data": {"camera": camera}}, event_id="cam-1"))
    assert (exc.message, exc.code, exc.event_id, exc.detail) == (
        "Failed to apply interaction", "interaction_failed", "cam-1", detail)
    assert exc.wire("video_stream-1") == {"type": "error", "message": "Failed to apply interaction",
                                          "code": "interaction_failed", "request_id": "video_stream-1",
                                          "event_id": "cam-1"}


def test_camera_actions_text_is_the_references():
    assert m.CAMERA_ACTIONS.endswith("not accepted by the engine; send structural translation/rotation instead")


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_camera_refuses_non_finite_numbers(value):
    text = json.dumps(interaction(camera_event(data={"translation": [0, 0, 7.5]}))).replace("7.5", value)
    assert control_error(text).detail == "camera translation must be non-nan and non-inf"
    text = json.dumps(interaction(camera_event(data={"rotation": [0, 0, 7.5, 1]}))).replace("7.5", value)
    assert control_error(text).detail == "camera rotation must be non-nan and non-inf"


def test_camera_huge_quaternion_normalises_without_overflow():
    q = control(interaction(camera_event(data={"rotation": [1e308, 0, 0, 1e308]}))).camera.rotation
    assert q == pytest.approx((math.sqrt(0.5), 0, 0, math.sqrt(0.5)))


def test_bad_interaction_prompt_is_interaction_failed():
    exc = control_error(interaction({"prompt": "x" * 20_000}, event_id="p-1"))
    assert (exc.message, exc.code, exc.event_id) == ("Failed to apply interaction", "interaction_failed", "p-1")
    assert "the limit is" in exc.detail


# ---------------------------------------------------------------- builders


def test_server_builders_have_the_references_fields():
    rid = m.new_request_id()
    assert re.fullmatch(r"video_stream-[0-9a-f]{32}", rid) and rid != m.new_request_id()
    assert re.fullmatch(r"[0-9a-f]{32}", m.new_event_id())
    assert m.video_start(rid, {"fps": 16}) == {"type": "video.start", "request_id": rid, "format": "m4s",
                                               "config": {"fps": 16}}
    meta = m.chunk_metadata(rid, "media", 2, 2, 12, 50102, ["fwd-1"], ["fwd-1"], [])
    assert meta == {"type": "video.chunk_metadata", "request_id": rid, "kind": "media", "transport_chunk_index": 2,
                    "generation_chunk_index": 2, "num_frames": 12, "byte_length": 50102,
                    "started_event_ids": ["fwd-1"], "active_event_ids": ["fwd-1"], "completed_event_ids": []}
    trailer = m.chunk_metadata(rid, "trailer", 11, None, 0, 800)
    assert trailer["generation_chunk_index"] is None and trailer["completed_event_ids"] == []
    assert json.loads(json.dumps(trailer))["generation_chunk_index"] is None  # null on the wire
    with pytest.raises(ValueError):
        m.chunk_metadata(rid, "init", 0, 0, 0, 0)
    assert m.interaction_queued(rid, "fwd-1") == {"type": "session.interaction.queued", "request_id": rid,
                                                  "event_id": "fwd-1"}
    assert m.pong() == {"type": "session.pong"}
    assert m.done(rid, 3, True) == {"type": "session.done", "request_id": rid, "chunks": 3, "stopped": True}
    assert m.error("Stall timeout: no generation progress") == {"type": "error",
                                                                "message": "Stall timeout: no generation progress"}
    assert m.error(m.EVENT_ID_CONFLICT, m.EVENT_ID_CONFLICT, rid, "fwd-1") == {
        "type": "error", "message": "event_id_conflict", "code": "event_id_conflict", "request_id": rid,
        "event_id": "fwd-1"}
    assert m.ProtocolError("control message too large", fatal=False).wire() == {
        "type": "error", "message": "control message too large"}


def test_client_builders_round_trip_through_the_parsers():
    msg = m.start_message("a street", IMAGE, model=MODEL, width=832, height=480, num_frames=129, fps=16, seed=42,
                          flow_shift=5.0, camera_action_script=[[["w"], [], []]], codec_options={"preset": "fast"})
    assert msg["extra_params"] == {"camera_action_script": [[["w"], [], []]], "video_codec_options": {"preset": "fast"}}
    assert "num_inference_steps" not in msg and "action_path" not in msg["extra_params"]
    s = parse_start(msg)
    assert (s.prompt, s.width, s.num_frames, s.fps, s.seed, s.flow_shift) == ("a street", 832, 129, 16, 42, 5.0)
    assert "extra_params" not in m.start_message("p", IMAGE)

    cam = m.camera_payload("velocity", (0, 0, 0.05), (0, 0, 0, 1))
    assert cam == {"mode": "velocity", "data": {"translation": [0.0, 0.0, 0.05], "rotation": [0.0, 0.0, 0.0, 1.0]}}
    msg = m.interaction_message("fwd-1", camera=cam)
    assert msg == {"type": "session.interaction", "interaction": {"event_id": "fwd-1", "event": {
        "multi_modal_data": {"camera": cam}}}}
    assert control(msg) == m.Interaction("fwd-1", None, m.CameraCommand("velocity", (0, 0, 0.05), (0, 0, 0, 1)), None)
    msg = m.interaction_message(None, prompt="snow", transition_chunks=0)
    assert msg == {"type": "session.interaction", "interaction": {"event": {"prompt": "snow"}, "transition_chunks": 0}}
    assert control(msg) == m.Interaction(None, "snow", None, 0)
    assert control(m.ping_message()) == m.Ping() and control(m.stop_message()) == m.Stop()
    assert control(m.playback_message(2.0)) == m.Playback(2.0)
    with pytest.raises(ValueError):
        m.camera_payload("spin", (0, 0, 0), (0, 0, 0, 1))


# ---------------------------------------------------------------- keys (keys.py)


def motion_pose(keys: set[str], start: np.ndarray | None = None) -> np.ndarray:
    """One latent frame of `keys` sent as a velocity payload, from `start` (the identity by default)."""
    translation, rotation = velocity_delta(keys)
    return advance(CameraMotion.velocity(translation, rotation), np.eye(4) if start is None else start, 1)[0][0]


def test_key_steps_are_camera_configs():
    cfg = CameraConfig()
    assert (MOVE_STEP, PITCH_STEP_DEG, YAW_STEP_DEG) == (cfg.move_step, cfg.pitch_step_deg, cfg.yaw_step_deg)


@pytest.mark.parametrize("key", sorted("wasdijkl"))
def test_each_single_key_matches_our_integrator_for_one_frame(key):
    ours = integrate_actions(CameraState.initial(), [[key]], CameraConfig())[0][0]
    translation, rotation = velocity_delta({key})
    np.testing.assert_allclose(pose_matrix(translation, rotation), ours, atol=1e-15)
    np.testing.assert_allclose(motion_pose({key}), ours, atol=1e-15)


def test_velocity_payload_matches_cu():
    assert velocity_payload(set()) == {"mode": "velocity", "data": {"translation": [0.0, 0.0, 0.0],
                                                                    "rotation": [0.0, 0.0, 0.0, 1.0]}}
    payload = velocity_payload({"w", "d", "i", "l"})
    assert payload["data"]["translation"] == [0.05, 0.0, 0.05]  # diagonals are not normalised
    p, y = math.radians(2), math.radians(3)  # half-angles
    x_, y_, z_, w_ = payload["data"]["rotation"]
    assert (x_, y_, z_, w_) == pytest.approx((math.sin(p) * math.cos(y), math.cos(p) * math.sin(y),
                                              math.sin(p) * math.sin(y), math.cos(p) * math.cos(y)))
    assert z_ > 0  # q = pitch ⊗ yaw: z = +sin(p/2)·sin(y/2)
    assert velocity_payload({"w", "s", "j", "l"}) == velocity_payload(set())  # opposites cancel
    assert control(m.interaction_message("k", camera=payload)).camera.mode == "velocity"
    for bad in ("w", {"W"}, {"up"}):
        with pytest.raises(ValueError):
            velocity_delta(bad)


def test_velocity_differs_from_our_integrator_once_pitched():
    """Our integrator moves along the yaw-only horizontal forward and yaws about world Y; velocity moves and
    yaws in the camera's own, tilted frame."""
    cfg = CameraConfig()
    pitched_state = integrate_actions(CameraState.initial(), [["i"], ["i"]], cfg)[1]  # looking 8 degrees up
    pitched = np.array(pitched_state.pose)
    ours = integrate_actions(pitched_state, [["w"]], cfg)[0][0]
    np.testing.assert_allclose(ours[:3, 3], [0, 0, 0.05], atol=1e-15)  # horizontal
    theirs = motion_pose({"w"}, pitched)
    a = math.radians(8)
    np.testing.assert_allclose(theirs[:3, 3], [0, -0.05 * math.sin(a), 0.05 * math.cos(a)], atol=1e-15)  # climbs

    ours_yaw = integrate_actions(pitched_state, [["l"]], cfg)[0][0]
    theirs_yaw = motion_pose({"l"}, pitched)
    assert np.abs(ours_yaw[:3, :3] - theirs_yaw[:3, :3]).max() > 1e-3
    np.testing.assert_allclose(ours_yaw[:3, :3], rotation_y(6) @ pitched[:3, :3], atol=1e-15)  # world Y
    np.testing.assert_allclose(theirs_yaw[:3, :3], pitched[:3, :3] @ rotation_y(6), atol=1e-15)  # local Y


def test_combined_keys_in_one_frame_translate_before_rotating():
    ours = integrate_actions(CameraState.initial(), [["w", "l"]], CameraConfig())[0][0]
    theirs = motion_pose({"w", "l"})
    np.testing.assert_allclose(theirs[:3, 3], [0, 0, 0.05], atol=1e-15)  # the axes before this frame's turn
    a = math.radians(6)
    np.testing.assert_allclose(ours[:3, 3], [0.05 * math.sin(a), 0, 0.05 * math.cos(a)], atol=1e-15)
    np.testing.assert_allclose(ours[:3, :3], theirs[:3, :3], atol=1e-15)  # one rotation alone: the same


def test_script_from_blocks():
    script = script_from_blocks([(frozenset("wd"), frozenset(), frozenset("l")), [{"i"}, {"k", "j"}, set()]])
    assert script == [[["d", "w"], [], ["l"]], [["i"], ["j", "k"], []]]
    s = parse_start(start(extra_params={"camera_action_script": script}))
    assert s.camera_action_script[1] == (frozenset("i"), frozenset("jk"), frozenset())
    with pytest.raises(ValueError):
        script_from_blocks([(frozenset("w"), frozenset())])
    with pytest.raises(ValueError):
        script_from_blocks([(frozenset("w"), frozenset(), frozenset("x"))])
