"""vLLM-Omni's realtime video protocol: typed client messages parsed once, and the JSON both sides send.

Written from ../shared/reference/vllm-omni-realtime-protocol.md (the contract); bracketed keys name its sources:
[H] the WebSocket handler, [REQ] the request schema, [CAM] the camera modality, [PRM] prompt updates, [PIPE] the
LingBot pipeline, [EXR-late] the later example revision with playback pacing. One WebSocket is one session at
`/v1/realtime/video`; client messages are JSON text, the server sends JSON control messages and binary fMP4.

    parse_start(text, served_model) -> SessionStart          the first message ([H] §2.1); ProtocolError(fatal)
    parse_control(text) -> Interaction | Ping | Stop | Playback   every later one (§2.2, §2.3); not fatal
    video_start / chunk_metadata / interaction_queued / pong / done / error   server messages (§3), as dicts
    start_message / interaction_message / camera_payload / ping_message / stop_message / playback_message
                                                              client messages, as dicts

Error texts are upstream's exactly ([H], §2-§4): clients match on them. Where the reference gives no text for a
check ("each multi_modal_data[modality] must be an object", the playback bound, our own checks of start fields)
the text here is ours. The reference shortens the empty-event text to "…requires a non-empty event.prompt and/or
non-empty event.multi_modal_data"; EMPTY_EVENT completes it with the prefix every other interaction text has.

Decisions where the reference is silent:
- Field checks are pydantic-like but stricter: integers are JSON integers (an integral float such as 16.0 is
  taken, as pydantic takes it; numeric strings and booleans are refused). Checks upstream makes only after
  `video.start` (image_reference, camera_action_script, preencode_mp4) are made here, as "Invalid session.start:
  <text>", so a bad start never starts. LingBot's own rules (832x480, num_frames = 9+12k, 4 steps) are not:
  the server checks them against its model config and reports them after `video.start`, as upstream does.
- image_reference is required (LingBot generates from one image [PIPE]); only `data:image/` and http(s) URLs.
- Schema fields we do not use (negative_prompt, guidance_scale, lora, ...) are not validated, only echoed in
  `config`; unknown top-level keys are dropped, as pydantic drops them.
- A camera payload the engine would refuse ([CAM]: bad mode, data not an object, data.actions, a bad pose) is
  refused here as upstream's `interaction_failed` ("Failed to apply interaction" + the event_id), with [CAM]'s
  own text as `detail` for logs. Other modalities are kept by name (`Interaction.other_modalities`) for the
  server to refuse the same way after its event_id_conflict check.
- An interaction whose `event_id` is omitted has event_id None here: the server assigns `new_event_id()`.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import dataclass
from typing import Any, Mapping, Sequence, Union

from lingbot_core.boundary.user_text import QUOTE_CHARS, check_text, quote
from lingbot_core.config import TextConfig
from lingbot_core.boundary.prompt import clean_prompt

PATH = "/v1/realtime/video"
FORMAT = "m4s"
START_MAX_CHARS = 4 * 1024 * 1024  # [H]: on the decoded string's length, not its UTF-8 bytes
CONTROL_MAX_CHARS = 128 * 1024
START_TIMEOUT_S = 10.0
STALL_TIMEOUT_S = 60.0
DEFAULT_FPS = 24  # [REQ], when neither fps nor video_params.fps is sent
CAMERA_TRANSITION_CHUNKS_DEFAULT = 1  # [CAM]; an Interaction's transition_chunks None means "the default"
PROMPT_TRANSITION_CHUNKS_DEFAULT = 3  # [PRM]
SCRIPT_KEYS = frozenset("wasdijkl")
SCRIPT_FRAMES_PER_CHUNK = 3  # camera_action_script: one key list per latent frame, 3 latent frames a chunk

# Upstream's error texts ([H], [CAM]).
NOT_AVAILABLE = "Streaming video generation is not available"
START_TIMEOUT = "Timeout waiting for session.start"
STALL_TIMEOUT = "Stall timeout: no generation progress"
START_TOO_LARGE = "session.start message too large"
START_BAD_JSON = "Invalid JSON in session.start"
START_NOT_OBJECT = "session.start must be a JSON object"
BAD_FORMAT = "Invalid session.start format: expected 'm4s'."
INVALID_START = "Invalid session.start: "
CONTROL_TOO_LARGE = "control message too large"
BAD_JSON = "Invalid JSON message"
NOT_OBJECT = "WebSocket messages must be JSON objects"
UNKNOWN_TYPE = "Unknown message type: "
NO_INTERACTION = "session.interaction requires an interaction object"
BAD_EVENT_ID = "session.interaction event_id must be a non-empty string"
EMPTY_EVENT = "session.interaction requires a non-empty event.prompt and/or non-empty event.multi_modal_data"
NEGATIVE_PROMPT = "session.interaction negative_prompt is not supported in this release"
BAD_TRANSITION = "session.interaction transition_chunks must be an integer"
NEGATIVE_TRANSITION = "session.interaction transition_chunks must be >= 0"
EVENT_ID_CONFLICT = "event_id_conflict"  # both the code and the message
INTERACTION_FAILED = "interaction_failed"  # the code ...
INTERACTION_FAILED_MESSAGE = "Failed to apply interaction"  # ... and its message
# Ours, not upstream's (which sends no refusal: a second session's fate is not found): a full server or line says
# so with this code before any chunk, so a pool client takes the next seat instead of failing the world.
SERVER_BUSY = "server_busy"
CAMERA_ACTIONS = ("camera data.actions (WASD keys) is not accepted by the engine; "
                  "send structural translation/rotation instead")

# VideoGenerationRequest's fields [REQ] (what sampling_params may lift), plus [EXR-late]'s pacing field; and
# the defaults its model_dump carries into video.start's config when they are not sent.
REQUEST_FIELDS = frozenset({
    "model", "prompt", "seconds", "size", "image_reference", "video_params", "user", "width", "height", "fps",
    "num_frames", "negative_prompt", "num_inference_steps", "guidance_scale", "guidance_scale_2",
    "boundary_ratio", "flow_shift", "true_cfg_scale", "seed", "generate_sound", "sound_duration",
    "enable_frame_interpolation", "frame_interpolation_exp", "frame_interpolation_scale",
    "frame_interpolation_model_path", "lora", "extra_params", "streaming_buffer_seconds"})
_CONFIG_DEFAULTS = {"generate_sound": False, "enable_frame_interpolation": False, "frame_interpolation_exp": 1,
                    "frame_interpolation_scale": 1.0}

# Bounded digit counts: a 4 MiB message could otherwise carry a number that int() refuses to parse.
_SIZE = re.compile(r"([1-9][0-9]{0,5})x([1-9][0-9]{0,5})")
_SECONDS = re.compile(r"[1-9][0-9]{0,5}")


class ProtocolError(ValueError):
    """A message the protocol refuses. `message` is the text sent in `error`; `code`/`event_id` go with it
    (only interaction_failed and event_id_conflict have them); `fatal`: the session ends (every error before
    `video.start`), or continues (every control-message error); `detail`: our plain-words reason, for logs."""

    def __init__(self, message: str, *, fatal: bool, code: str | None = None, event_id: str | None = None,
                 detail: str | None = None):
        super().__init__(message if detail is None else f"{message}: {detail}")
        self.message, self.fatal, self.code, self.event_id, self.detail = message, fatal, code, event_id, detail

    def wire(self, request_id: str | None = None) -> dict:
        """The `error` message (upstream sends request_id with the coded errors only)."""
        return error(self.message, self.code, request_id, self.event_id)


class _Bad(Exception):
    """A field check failed; the caller wraps the text in its message."""


# ---------------------------------------------------------------- client -> server


@dataclass(frozen=True)
class SessionStart:
    """A validated `session.start`. None means "not sent" (the server's default); `config` is what
    `video.start` echoes: the request's schema fields minus None ones, with the schema's defaults and fps."""

    model: str | None
    prompt: str  # cleaned (clean_prompt)
    image_url: str  # a data:image/ URL or an http(s) URL, not yet fetched or decoded
    width: int | None
    height: int | None
    num_frames: int | None
    fps: int
    seed: int | None
    flow_shift: float | None
    num_inference_steps: int | None
    camera_action_script: tuple[tuple[frozenset[str], ...], ...] | None  # per chunk, 3 key sets
    action_path: str | None
    codec_options: dict[str, str] | None
    streaming_buffer_seconds: float | None
    config: dict[str, Any]


@dataclass(frozen=True)
class CameraCommand:
    """`multi_modal_data.camera` [CAM]: translation xyz and a unit quaternion (x, y, z, w)."""

    mode: str  # "velocity" | "target"
    translation: tuple[float, float, float]
    rotation: tuple[float, float, float, float]


@dataclass(frozen=True)
class Interaction:
    event_id: str | None  # None: the client sent none (the server assigns new_event_id())
    prompt: str | None  # cleaned
    camera: CameraCommand | None
    transition_chunks: int | None  # None: the modality's default (camera 1, prompt 3)
    other_modalities: tuple[str, ...] = ()  # multi_modal_data keys besides camera; refused by the server


@dataclass(frozen=True)
class Ping:
    pass


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class Playback:
    position_seconds: float  # [EXR-late]


ControlMessage = Union[Interaction, Ping, Stop, Playback]


# ---------------------------------------------------------------- field checks


def _echo(value: object) -> str:
    """`value` as upstream's f-string shows it, bounded: a short string as it is, anything else quoted."""
    if isinstance(value, str) and len(value) <= QUOTE_CHARS:
        return value
    return "None" if value is None else quote(value)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _int(value: object, name: str, minimum: int | None = None, maximum: int | None = None) -> int:
    if not (_is_number(value) and (isinstance(value, int) or (math.isfinite(value) and value.is_integer()))):
        raise _Bad(f"{name} must be an integer, got {quote(value)}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise _Bad(f"{name} must be at least {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise _Bad(f"{name} must be at most {maximum}, got {value}")
    return value


def _opt_int(value: object, name: str, minimum: int | None = None, maximum: int | None = None) -> int | None:
    return None if value is None else _int(value, name, minimum, maximum)


def _opt_positive(value: object, name: str) -> float | None:
    if value is None:
        return None
    if not _is_number(value) or not math.isfinite(value) or value <= 0:
        raise _Bad(f"{name} must be a positive finite number, got {quote(value)}")
    return float(value)


def _opt_str(value: object, name: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise _Bad(f"{name} must be a string, got {quote(value)}")
    try:
        return check_text(value, name)
    except ValueError as exc:
        raise _Bad(str(exc)) from None


def _object(value: object, name: str) -> dict | None:
    if value is not None and not isinstance(value, dict):
        raise _Bad(f"{name} must be an object, got {quote(value)}")
    return value


def _load(text: str, limit: int, too_large: str, bad_json: str, not_object: str, fatal: bool) -> dict:
    if not isinstance(text, str):
        raise TypeError(f"a message is the text of a WebSocket text frame; got {type(text).__name__}")
    if len(text) > limit:
        raise ProtocolError(too_large, fatal=fatal)
    try:
        msg = json.loads(text)
    # ValueError: JSONDecodeError, and an integer past int()'s digit limit; RecursionError: "[[[[..." nesting.
    except (ValueError, RecursionError):
        raise ProtocolError(bad_json, fatal=fatal) from None
    if not isinstance(msg, dict):
        raise ProtocolError(not_object, fatal=fatal)
    return msg


# ---------------------------------------------------------------- session.start


def _lift(msg: dict) -> dict:
    """[H]: sampling_params keys that are request fields not already at top level are lifted; the rest merge
    into extra_params (a sampling_params that is not an object is dropped, as upstream drops it)."""
    request = {k: v for k, v in msg.items() if k not in ("type", "format", "sampling_params")}
    sampling = msg.get("sampling_params")
    if isinstance(sampling, dict):
        extra = dict(_object(request.get("extra_params"), "extra_params") or {})
        for key, value in sampling.items():
            if key in REQUEST_FIELDS and key not in request:
                request[key] = value
            else:
                extra[key] = value
        if extra:
            request["extra_params"] = extra
    return request


def _image_url(ref: object) -> str:
    if ref is None:
        raise _Bad("image_reference is required: LingBot-World generates from one image")
    if not isinstance(ref, dict):
        raise _Bad(f"image_reference must be an object with image_url, got {quote(ref)}")
    if "file_id" in ref:
        raise _Bad("image_reference.file_id is not supported yet; send image_url")
    if set(ref) != {"image_url"}:
        raise _Bad(f"image_reference takes exactly one key, image_url; got {quote(sorted(map(str, ref)))}")
    url = _opt_str(ref["image_url"], "image_reference.image_url")
    if url is None or not url[:11].lower().startswith(("data:image/", "http://", "https://")):
        raise _Bad(f"image_reference.image_url must be a data:image/ URL or an http(s) URL, got {quote(url)}")
    return url


def _script(value: object) -> tuple[tuple[frozenset[str], ...], ...] | None:
    """[REC][ACT]: one entry per chunk, each exactly 3 lists of key tokens (case-insensitive)."""
    if value is None:
        return None
    name = "extra_params.camera_action_script"
    if not isinstance(value, list) or not value:
        raise _Bad(f"{name} must be a non-empty list with one entry per chunk, got {quote(value)}")
    chunks = []
    for c, chunk in enumerate(value):
        if not isinstance(chunk, list) or len(chunk) != SCRIPT_FRAMES_PER_CHUNK:
            raise _Bad(f"{name} chunk {c} must be a list of exactly {SCRIPT_FRAMES_PER_CHUNK} key lists "
                       f"(one per latent frame), got {quote(chunk)}")
        frames = []
        for f, tokens in enumerate(chunk):
            if not isinstance(tokens, list):
                raise _Bad(f"{name} chunk {c} frame {f} must be a list of keys, got {quote(tokens)}")
            # isascii: "\u212a".lower() is "k" (the Kelvin sign); only the eight ASCII letters are keys.
            bad = [t for t in tokens if not (isinstance(t, str) and t.isascii() and t.lower() in SCRIPT_KEYS)]
            if bad:
                raise _Bad(f"{name} chunk {c} frame {f} holds {quote(bad[0])}; keys are w a s d i j k l")
            frames.append(frozenset(t.lower() for t in tokens))
        chunks.append(tuple(frames))
    return tuple(chunks)


def _codec_options(value: object) -> dict[str, str] | None:
    options = _object(value, "extra_params.video_codec_options")
    if options is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in options.items()):
        raise _Bad(f"extra_params.video_codec_options must map names to strings (PyAV options), got "
                   f"{quote(options)}")
    return None if options is None else dict(options)


def _start(request: dict, max_prompt_chars: int) -> SessionStart:
    get = request.get
    if get("prompt") is None:
        raise _Bad("prompt is required")
    prompt = _opt_str(get("prompt"), "prompt")
    try:
        prompt = clean_prompt(prompt, max_prompt_chars)
    except ValueError as exc:
        raise _Bad(str(exc)) from None
    image_url = _image_url(get("image_reference"))

    # [REQ] resolve_video_params: top-level first, then video_params; size overrides both; fps 24 by default;
    # `seconds` gives num_frames = seconds x fps when num_frames is not sent.
    width, height = _opt_int(get("width"), "width", 1), _opt_int(get("height"), "height", 1)
    fps, num_frames = _opt_int(get("fps"), "fps", 1), _opt_int(get("num_frames"), "num_frames", 1)
    params = _object(get("video_params"), "video_params") or {}
    width = width or _opt_int(params.get("width"), "video_params.width", 1)
    height = height or _opt_int(params.get("height"), "video_params.height", 1)
    fps = fps or _opt_int(params.get("fps"), "video_params.fps", 1) or DEFAULT_FPS
    num_frames = num_frames or _opt_int(params.get("num_frames"), "video_params.num_frames", 1)
    size = get("size")
    if size is not None:
        match = _SIZE.fullmatch(size) if isinstance(size, str) else None
        if match is None:
            raise _Bad(f"size must be 'WxH' in pixels, e.g. '832x480'; got {quote(size)}")
        width, height = int(match[1]), int(match[2])
    seconds = get("seconds")
    if seconds is not None:
        if not (isinstance(seconds, str) and _SECONDS.fullmatch(seconds)):
            raise _Bad(f"seconds must be a whole number of seconds as a string, e.g. \"8\"; got {quote(seconds)}")
        num_frames = num_frames or int(seconds) * fps

    extra = _object(get("extra_params"), "extra_params") or {}
    if extra.get("preencode_mp4") not in (None, False):
        raise _Bad("extra_params.preencode_mp4 is not supported: the stream is encoded chunk by chunk")
    flow_shift = _opt_positive(get("flow_shift"), "flow_shift")
    if extra.get("flow_shift") is not None:  # upstream updates extra_args with extra_params after flow_shift
        flow_shift = _opt_positive(extra["flow_shift"], "extra_params.flow_shift")
    action_path = _opt_str(extra.get("action_path"), "extra_params.action_path")
    if action_path == "":
        raise _Bad("extra_params.action_path must not be empty")

    config = {**_CONFIG_DEFAULTS, **{k: v for k, v in request.items() if k in REQUEST_FIELDS and v is not None}}
    config["fps"] = fps
    return SessionStart(
        model=_opt_str(get("model"), "model"), prompt=prompt, image_url=image_url, width=width, height=height,
        num_frames=num_frames, fps=fps,
        seed=_opt_int(get("seed"), "seed", -(2**63), 2**64 - 1),  # what a 64-bit generator seed can hold
        flow_shift=flow_shift, num_inference_steps=_opt_int(get("num_inference_steps"), "num_inference_steps", 1, 200),
        camera_action_script=_script(extra.get("camera_action_script")), action_path=action_path,
        codec_options=_codec_options(extra.get("video_codec_options")),
        streaming_buffer_seconds=_opt_positive(get("streaming_buffer_seconds"), "streaming_buffer_seconds"),
        config=config)


def parse_start(text: str, served_model: str | None,
                max_prompt_chars: int = TextConfig.max_prompt_chars) -> SessionStart:
    """The first message, checked in upstream's order ([H] _receive_start); ProtocolError(fatal=True)."""
    msg = _load(text, START_MAX_CHARS, START_TOO_LARGE, START_BAD_JSON, START_NOT_OBJECT, fatal=True)
    if msg.get("type") != "session.start":
        raise ProtocolError(f"Expected session.start, got: {_echo(msg.get('type'))}", fatal=True)
    if msg.get("format", FORMAT) != FORMAT:
        raise ProtocolError(BAD_FORMAT, fatal=True)
    try:
        start = _start(_lift(msg), max_prompt_chars)
    except _Bad as exc:
        raise ProtocolError(INVALID_START + str(exc), fatal=True) from None
    if start.model is not None and served_model is not None and start.model != served_model:
        raise ProtocolError(f"Model mismatch: request specifies '{_echo(start.model)}' but server is running "
                            f"'{served_model}'.", fatal=True)
    return start


# ---------------------------------------------------------------- control messages


def _camera(payload: dict) -> CameraCommand:
    """[CAM] validate_payload, with its texts."""
    mode = payload.get("mode", "target")
    if not isinstance(mode, str) or mode not in ("target", "velocity"):
        raise _Bad("camera mode must be 'target' or 'velocity'")
    data = payload.get("data")
    if not isinstance(data, dict):
        raise _Bad("camera data must be an object")
    if "actions" in data:
        raise _Bad(CAMERA_ACTIONS)

    def vector(name: str, default: Sequence[float], shape: str) -> tuple[float, ...]:
        value = data.get(name, default)
        if not isinstance(value, (list, tuple)) or len(value) != len(default):
            raise _Bad(f"camera {name} must be a length-{len(default)} list/tuple{shape}")
        if not all(_is_number(v) and math.isfinite(v) for v in value):
            raise _Bad(f"camera {name} must be non-nan and non-inf")
        return tuple(float(v) for v in value)

    translation = vector("translation", (0.0, 0.0, 0.0), "")
    rotation = vector("rotation", (0.0, 0.0, 0.0, 1.0), " (x, y, z, w)")
    norm = math.hypot(*rotation)  # no overflow for components near 1e308
    if norm == 0.0:
        raise _Bad("camera rotation quaternion must be non-zero")
    return CameraCommand(mode, translation, tuple(v / norm for v in rotation))


def _interaction(msg: dict, max_prompt_chars: int) -> Interaction:
    """[H] _handle_interaction's transport checks, in its order, then what the engine would refuse."""
    def soft(message: str) -> ProtocolError:
        return ProtocolError(message, fatal=False)

    body = msg.get("interaction")
    if not isinstance(body, dict):
        raise soft(NO_INTERACTION)
    event_id = body.get("event_id")
    if event_id is not None and not (isinstance(event_id, str) and event_id):
        raise soft(BAD_EVENT_ID)
    event = body.get("event")
    event = event if isinstance(event, dict) else {}
    prompt, modalities = event.get("prompt"), event.get("multi_modal_data")
    has_prompt = isinstance(prompt, str) and bool(prompt.strip())
    if not has_prompt and not (isinstance(modalities, dict) and modalities):
        raise soft(EMPTY_EVENT)
    if event.get("negative_prompt") is not None:
        raise soft(NEGATIVE_PROMPT)
    if prompt is not None and not isinstance(prompt, str):
        raise soft("session.interaction event.prompt must be a string")
    if modalities is not None and not isinstance(modalities, dict):
        raise soft("session.interaction event.multi_modal_data must be an object")
    modalities = modalities or {}
    for name, value in modalities.items():
        if not isinstance(value, dict):
            raise soft(f"session.interaction event.multi_modal_data.{_echo(name)} must be an object")
    transition = body.get("transition_chunks")
    if transition is not None:
        if not _is_number(transition) or (isinstance(transition, float) and not transition.is_integer()):
            raise soft(BAD_TRANSITION)
        transition = int(transition)
        if transition < 0:
            raise soft(NEGATIVE_TRANSITION)

    try:
        cleaned = clean_prompt(check_text(prompt, "event.prompt"), max_prompt_chars) if has_prompt else None
        camera = _camera(modalities["camera"]) if "camera" in modalities else None
    except (_Bad, ValueError) as exc:
        raise ProtocolError(INTERACTION_FAILED_MESSAGE, fatal=False, code=INTERACTION_FAILED, event_id=event_id,
                            detail=str(exc)) from None
    return Interaction(event_id, cleaned, camera, transition, tuple(k for k in modalities if k != "camera"))


def parse_control(text: str, max_prompt_chars: int = TextConfig.max_prompt_chars) -> ControlMessage:
    """A message after session.start ([H] _control_loop); ProtocolError(fatal=False): the session goes on."""
    msg = _load(text, CONTROL_MAX_CHARS, CONTROL_TOO_LARGE, BAD_JSON, NOT_OBJECT, fatal=False)
    kind = msg.get("type")
    if kind == "session.stop":
        return Stop()
    if kind == "session.ping":
        return Ping()
    if kind == "session.interaction":
        return _interaction(msg, max_prompt_chars)
    if kind == "session.playback":
        position = msg.get("position_seconds")
        if not (_is_number(position) and math.isfinite(position) and position >= 0):
            raise ProtocolError("session.playback position_seconds must be a finite number >= 0", fatal=False)
        return Playback(float(position))
    raise ProtocolError(UNKNOWN_TYPE + _echo(kind), fatal=False)


# ---------------------------------------------------------------- server -> client (§3)


def new_request_id() -> str:
    return "video_stream-" + uuid.uuid4().hex


def new_event_id() -> str:
    return uuid.uuid4().hex


def video_start(request_id: str, config: Mapping[str, Any]) -> dict:
    return {"type": "video.start", "request_id": request_id, "format": FORMAT, "config": dict(config)}


def chunk_metadata(request_id: str, kind: str, transport_index: int, generation_index: int | None,
                   num_frames: int, byte_length: int, started: Sequence[str] = (), active: Sequence[str] = (),
                   completed: Sequence[str] = ()) -> dict:
    """Sent right before its binary frame. A trailer has generation_chunk_index None and 0 frames."""
    if kind not in ("media", "trailer"):
        raise ValueError(f"kind must be 'media' or 'trailer'; got {kind!r}")
    return {"type": "video.chunk_metadata", "request_id": request_id, "kind": kind,
            "transport_chunk_index": transport_index, "generation_chunk_index": generation_index,
            "num_frames": num_frames, "byte_length": byte_length, "started_event_ids": list(started),
            "active_event_ids": list(active), "completed_event_ids": list(completed)}


def interaction_queued(request_id: str, event_id: str) -> dict:
    return {"type": "session.interaction.queued", "request_id": request_id, "event_id": event_id}


def pong() -> dict:
    return {"type": "session.pong"}


def done(request_id: str, chunks: int, stopped: bool) -> dict:
    """`chunks`: binary payloads sent, the trailer included."""
    return {"type": "session.done", "request_id": request_id, "chunks": chunks, "stopped": stopped}


def error(message: str, code: str | None = None, request_id: str | None = None,
          event_id: str | None = None) -> dict:
    wire = {"type": "error", "message": message, "code": code, "request_id": request_id, "event_id": event_id}
    return {k: v for k, v in wire.items() if v is not None}


# ---------------------------------------------------------------- client messages


def start_message(prompt: str, image_url: str, *, model: str | None = None, width: int | None = None,
                  height: int | None = None, num_frames: int | None = None, fps: int | None = None,
                  seed: int | None = None, flow_shift: float | None = None, num_inference_steps: int | None = None,
                  camera_action_script: list | None = None, action_path: str | None = None,
                  codec_options: Mapping[str, str] | None = None,
                  streaming_buffer_seconds: float | None = None) -> dict:
    """A `session.start`; None fields are left off (the server's defaults apply)."""
    extra = {"camera_action_script": camera_action_script, "action_path": action_path,
             "video_codec_options": None if codec_options is None else dict(codec_options)}
    wire = {"type": "session.start", "model": model, "prompt": prompt, "image_reference": {"image_url": image_url},
            "width": width, "height": height, "num_frames": num_frames, "fps": fps, "seed": seed,
            "flow_shift": flow_shift, "num_inference_steps": num_inference_steps,
            "streaming_buffer_seconds": streaming_buffer_seconds,
            "extra_params": {k: v for k, v in extra.items() if v is not None} or None}
    return {k: v for k, v in wire.items() if v is not None}


def camera_payload(mode: str, translation: Sequence[float], rotation: Sequence[float]) -> dict:
    """`multi_modal_data.camera`: rotation is a quaternion (x, y, z, w)."""
    if mode not in ("velocity", "target") or len(translation) != 3 or len(rotation) != 4:
        raise ValueError(f"camera_payload needs mode velocity|target, 3 translation and 4 rotation numbers; got "
                         f"{mode!r}, {list(translation)}, {list(rotation)}")
    return {"mode": mode, "data": {"translation": [float(v) for v in translation],
                                   "rotation": [float(v) for v in rotation]}}


def interaction_message(event_id: str | None, prompt: str | None = None, camera: Mapping[str, Any] | None = None,
                        transition_chunks: int | None = None) -> dict:
    event: dict[str, Any] = {}
    if prompt is not None:
        event["prompt"] = prompt
    if camera is not None:
        event["multi_modal_data"] = {"camera": dict(camera)}
    body: dict[str, Any] = {"event": event}
    if event_id is not None:
        body = {"event_id": event_id, **body}
    if transition_chunks is not None:
        body["transition_chunks"] = transition_chunks
    return {"type": "session.interaction", "interaction": body}


def ping_message() -> dict:
    return {"type": "session.ping"}


def stop_message() -> dict:
    return {"type": "session.stop"}


def playback_message(position_seconds: float) -> dict:
    return {"type": "session.playback", "position_seconds": position_seconds}
