"""SGLang's realtime video protocol: typed messages, their msgpack wire form, and strict validation.

Written from ../shared/reference/sglang-realtime-protocol.md (the contract), not from upstream code. One
WebSocket per session at `/v1/realtime_video/generate`; every message both ways is a binary msgpack map,
except the payload that follows a `frame_batch_header` (the bare frame bytes, as the next binary message).

    client -> server   InitRequest (type "init"), EventMessage (type "event")
    server -> client   FrameBatch (type "frame_batch", or "frame_batch_header" + payload), ChunkStats,
                       ErrorMessage

    decode_init(data)              -> InitRequest     ProtocolError("invalid generate request") otherwise
    decode_event(data)             -> EventMessage    ProtocolError("invalid event") otherwise
    encode_client_message(message) -> bytes
    encode_server_message(message) -> list[bytes]     a frame batch of >= 64 KiB is two messages
    ServerMessageReader().feed(data) -> message | None (None: a header, its payload comes next)

A ProtocolError's `content` is the exact text the reference puts in the error message (a server sends
`error_message(exc)`); its `detail` says in plain words what was wrong, for logs and for our own callers.
Splitting a chunk into batches and reassembling it is in batching.py; keys <-> camera actions in actions.py.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Union

import msgpack

from lingbot_core.boundary.user_text import quote

GENERATE_PATH = "/v1/realtime_video/generate"
MODELS_PATH = "/v1/models"

# The reference's exact error contents (clients match on them).
INVALID_REQUEST = "invalid generate request"
INVALID_EVENT = "invalid event"
SESSION_ACTIVE = "another realtime session is already active"
GENERATE_LOOP_ERROR = "error during generate loop: "
GENERATION_COMPLETE = "generation complete"  # the close reason sent with code 1000 at max_chunks

CLOSE_NORMAL = 1000  # max_chunks reached
CLOSE_POLICY = 1008  # refused: busy server, or the fork's admission (USER_SESSION_LIMIT, ...)
ADMISSION_REASONS = ("USER_SESSION_LIMIT", "CAPACITY_EXHAUSTED", "LEASE_LOST")

RAW_CONTENT_TYPE = "application/x-raw-rgb"
IMAGE_CONTENT_TYPES = {"webp": "image/webp", "jpeg": "image/jpeg"}
OUTPUT_FORMATS = ("raw", "webp", "jpeg")
RAW_CHANNELS = 3

# A frame batch whose payload is this large or larger travels as a header map and then the bare payload.
SPLIT_PAYLOAD_BYTES = 64 * 1024
# A camera script queue holds at most this many latent frames (the reference's FIFO cap).
MAX_SCRIPT_FRAMES = 512
# A state map's transitions in one event: a client sends those since its last event (the web UI, every
# 100 ms), so even frantic play stays far below this; a map of 10,000 is refused, not processed.
MAX_TRANSITIONS = 256

EVENT_KINDS = ("prompt", "camera_actions", "composite_input", "heartbeat")
# composite_input bundles these under one event_id (a composite inside a composite means nothing).
COMPOSITE_KINDS = ("prompt", "camera_actions")

_SIZE = re.compile(r"^([1-9][0-9]{0,5})x([1-9][0-9]{0,5})$")


class ProtocolError(ValueError):
    """A message that breaks the protocol. `content`: the reference's error text; `detail`: what was wrong."""

    def __init__(self, content: str, detail: str):
        super().__init__(f"{content}: {detail}")
        self.content = content
        self.detail = detail


# ---------------------------------------------------------------- client -> server


@dataclass(frozen=True)
class Transition:
    """One change of the held key set; level-triggered (it holds until the next transition)."""

    actions: tuple[str, ...]
    client_ts_ms: int | None = None


@dataclass(frozen=True)
class CameraState:
    """camera_actions in state mode: `{"mode": "state", "transitions": [...]}`."""

    transitions: tuple[Transition, ...]


@dataclass(frozen=True)
class CameraScript:
    """camera_actions as a script: one token list per *latent* frame, queued FIFO by the server."""

    frames: tuple[tuple[str, ...], ...]


CameraActions = Union[CameraScript, CameraState]


@dataclass(frozen=True)
class CompositeInput:
    """Several inputs applied all-or-nothing under one event_id; `inputs` keeps the input_types order."""

    inputs: tuple[tuple[str, Any], ...]  # (kind, its typed payload: str for prompt, CameraActions)


@dataclass(frozen=True)
class EventMessage:
    """`{"type": "event", "kind": K, "payload": P, "event_id": int | None}`.

    payload: str (prompt), CameraScript | CameraState (camera_actions), CompositeInput, or the decoded
    value as sent for heartbeat (the fork's keep-alive; its payload carries nothing we act on)."""

    kind: str
    payload: Any
    event_id: int | None = None


@dataclass(frozen=True)
class InitRequest:
    """The first client message. Fields the reference gives a default for carry it; None elsewhere means
    "the server's choice" and is left off the wire. `extra`: unknown keys, allowed and passed through."""

    prompt: str
    first_frame: bytes | str | None = None  # image bytes, an http(s) URL or a data:image/... URL
    condition_inputs: dict[str, Any] | None = None  # {"camera_actions": CameraActions} (typed on decode)
    max_chunks: int | None = None  # None: a continuous session
    seed: int = 42
    guidance_scale: float = 1.0
    size: str = "832x480"
    realtime_output_format: str = "raw"
    realtime_preview_max_width: int | None = None
    realtime_output_pacing: bool | None = None
    realtime_causal_sink_size: int | None = None
    realtime_causal_kv_cache_num_frames: int | None = None
    num_inference_steps: int = 4
    fps: int | None = None
    output_quality: int | None = None
    output_compression: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def width_height(self) -> tuple[int, int]:
        match = _SIZE.match(self.size)
        if match is None:
            raise ValueError(f"size must be 'WxH' in pixels, e.g. '832x480'; got {quote(self.size)}")
        return int(match.group(1)), int(match.group(2))


ClientMessage = Union[InitRequest, EventMessage]

_INIT_FIELDS = ("prompt", "first_frame", "condition_inputs", "max_chunks", "seed", "guidance_scale", "size",
                "realtime_output_format", "realtime_preview_max_width", "realtime_output_pacing",
                "realtime_causal_sink_size", "realtime_causal_kv_cache_num_frames", "num_inference_steps",
                "fps", "output_quality", "output_compression")


# ---------------------------------------------------------------- server -> client


@dataclass(frozen=True)
class FrameBatch:
    """Frames of one chunk, in order. Raw: rgb24 frames concatenated; webp/jpeg: images concatenated
    (`payload_lengths` splits them). `width`/`height` are the delivered frame size (the preview size for
    images). `event_id`: the last event applied to this chunk (None: none yet, left off the wire)."""

    request_id: str
    chunk_index: int
    content_type: str
    num_frames: int
    total_size: int  # bytes in this batch's payload
    frame_batch_index: int
    num_frame_batches: int
    is_final_frame_batch: bool
    event_id: int | None
    payload: bytes
    format: str  # "rgb24" for raw; "webp" / "jpeg"
    encoding: str  # "raw"; "webp" / "jpeg"
    width: int
    height: int
    channels: int | None = None  # raw only
    bytes_per_frame: int | None = None  # raw only
    raw_size: int | None = None  # raw only: the payload's length
    source_width: int | None = None  # images only: the generated frame size ...
    source_height: int | None = None
    preview_width: int | None = None  # ... and the size sent (bounded by realtime_preview_max_width)
    preview_height: int | None = None
    payload_lengths: tuple[int, ...] | None = None  # images only


@dataclass(frozen=True)
class ChunkStats:
    """Sent after each chunk's frame batches. Times in milliseconds; `extra`: keys beyond the reference's."""

    session_id: str
    request_id: str
    chunk_index: int
    event_id: int | None
    request_prepare_ms: float
    scheduler_forward_ms: float
    pace_wait_ms: float
    header_write_ms: float
    raw_payload_build_ms: float
    raw_write_ms: float
    ws_write_ms: float
    chunk_total_ms: float
    num_batches: int
    num_frames: int
    raw_bytes: int
    ws_payload_bytes: int
    content_type: str
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ErrorMessage:
    """`content`: the reference's text, which clients match on. `detail`: our server's plain-words reason
    (an extra key on the wire, left off when None; the reference's clients ignore it)."""

    content: str
    detail: str | None = None


ServerMessage = Union[FrameBatch, ChunkStats, ErrorMessage]

_STATS_MS = ("request_prepare_ms", "scheduler_forward_ms", "pace_wait_ms", "header_write_ms",
             "raw_payload_build_ms", "raw_write_ms", "ws_write_ms", "chunk_total_ms")
_STATS_COUNTS = ("num_batches", "num_frames", "raw_bytes", "ws_payload_bytes")
_BATCH_COMMON = ("request_id", "chunk_index", "content_type", "num_frames", "total_size", "frame_batch_index",
                 "num_frame_batches", "is_final_frame_batch")
_RAW_FIELDS = ("format", "width", "height", "channels", "bytes_per_frame", "raw_size", "encoding")
_IMAGE_FIELDS = ("format", "encoding", "source_width", "source_height", "preview_width", "preview_height",
                 "width", "height", "payload_lengths")


# ---------------------------------------------------------------- msgpack


def pack(value: dict) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def unpack_map(data: object, content: str) -> dict:
    """One binary message -> its msgpack map; anything else is a ProtocolError carrying `content`."""
    if isinstance(data, str):
        raise ProtocolError(content, "a text message; the protocol sends binary msgpack maps")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(content, f"a message must be bytes, got {type(data).__name__}")
    try:
        value = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types (ExtraData, FormatError, Unicode...)
        raise ProtocolError(content, f"not valid msgpack ({type(exc).__name__})") from None
    if not isinstance(value, dict):
        raise ProtocolError(content, f"a message must be a msgpack map, got {type(value).__name__}")
    return value


# ---------------------------------------------------------------- field checks


def _int(value: object, name: str, content: str, minimum: int | None = None, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(content, f"{name} must be an integer, got {quote(value)}")
    if minimum is not None and value < minimum:
        raise ProtocolError(content, f"{name} must be at least {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ProtocolError(content, f"{name} must be at most {maximum}, got {value}")
    return value


def _opt_int(value: object, name: str, content: str, minimum: int | None = None,
             maximum: int | None = None) -> int | None:
    return None if value is None else _int(value, name, content, minimum, maximum)


def _number(value: object, name: str, content: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ProtocolError(content, f"{name} must be a finite number, got {quote(value)}")
    return float(value)


def _str(value: object, name: str, content: str, non_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise ProtocolError(content, f"{name} must be a string, got {quote(value)}")
    if non_empty and not value.strip():
        raise ProtocolError(content, f"{name} must not be empty")
    return value


def _bool(value: object, name: str, content: str) -> bool:
    if not isinstance(value, bool):
        raise ProtocolError(content, f"{name} must be true or false, got {quote(value)}")
    return value


def _tokens(value: object, where: str) -> tuple[str, ...]:
    """A list of action tokens. Unknown *strings* are kept (the receiver ignores them); non-strings are not."""
    if not isinstance(value, (list, tuple)):
        raise ProtocolError(INVALID_EVENT, f"{where} must be a list of action tokens, got {quote(value)}")
    for token in value:
        if not isinstance(token, str):
            raise ProtocolError(INVALID_EVENT, f"{where} holds {quote(token)}; action tokens are strings")
    return tuple(value)


# ---------------------------------------------------------------- event payloads


def parse_camera_actions(value: object, content: str = INVALID_EVENT) -> CameraActions:
    """A camera_actions payload: a script (list per latent frame) or a state map; ProtocolError otherwise."""
    try:
        if isinstance(value, list):
            if not value:
                raise ProtocolError(INVALID_EVENT, "a camera_actions script must hold at least one latent frame")
            if len(value) > MAX_SCRIPT_FRAMES:
                raise ProtocolError(INVALID_EVENT, f"a camera_actions script holds at most {MAX_SCRIPT_FRAMES} "
                                                   f"latent frames, got {len(value)}")
            return CameraScript(tuple(_tokens(frame, f"script frame {i}") for i, frame in enumerate(value)))
        if isinstance(value, dict):
            if value.get("mode") != "state":
                raise ProtocolError(INVALID_EVENT, f"a camera_actions map must have mode 'state', "
                                                   f"got {quote(value.get('mode'))}")
            transitions = value.get("transitions")
            if not isinstance(transitions, list) or not transitions:
                raise ProtocolError(INVALID_EVENT, "camera_actions state needs a non-empty 'transitions' list")
            if len(transitions) > MAX_TRANSITIONS:
                raise ProtocolError(INVALID_EVENT, f"a camera_actions state holds at most {MAX_TRANSITIONS} "
                                                   f"transitions, got {len(transitions)}")
            parsed = []
            for i, item in enumerate(transitions):
                if not isinstance(item, dict) or "actions" not in item:
                    raise ProtocolError(INVALID_EVENT, f"transition {i} must be a map with 'actions'")
                ts = _opt_int(item.get("client_ts_ms"), f"transition {i} client_ts_ms", INVALID_EVENT)
                parsed.append(Transition(_tokens(item["actions"], f"transition {i} actions"), ts))
            return CameraState(tuple(parsed))
        raise ProtocolError(INVALID_EVENT, f"camera_actions must be a script list or a state map, "
                                           f"got {type(value).__name__}")
    except ProtocolError as exc:
        if exc.content == content:
            raise
        raise ProtocolError(content, exc.detail) from None


def camera_actions_wire(actions: CameraActions) -> list | dict:
    if isinstance(actions, CameraScript):
        return [list(frame) for frame in actions.frames]
    if isinstance(actions, CameraState):
        wire = []
        for transition in actions.transitions:
            item: dict[str, Any] = {"actions": list(transition.actions)}
            if transition.client_ts_ms is not None:
                item["client_ts_ms"] = transition.client_ts_ms
            wire.append(item)
        return {"mode": "state", "transitions": wire}
    raise TypeError(f"not camera actions: {type(actions).__name__}")


def _parse_payload(kind: str, payload: object) -> Any:
    if kind == "prompt":
        return _str(payload, "a prompt event's payload", INVALID_EVENT, non_empty=True)
    if kind == "camera_actions":
        return parse_camera_actions(payload)
    if kind == "heartbeat":
        return payload
    if kind == "composite_input":
        if not isinstance(payload, dict):
            raise ProtocolError(INVALID_EVENT, "a composite_input payload must be a map")
        types = payload.get("input_types")
        if not isinstance(types, list) or not types:
            raise ProtocolError(INVALID_EVENT, "composite_input needs a non-empty 'input_types' list")
        if len(set(map(repr, types))) != len(types):
            raise ProtocolError(INVALID_EVENT, f"composite_input lists an input type twice: {quote(types)}")
        inputs = []
        for kind_inside in types:
            if kind_inside not in COMPOSITE_KINDS:
                raise ProtocolError(INVALID_EVENT, f"composite_input type {quote(kind_inside)} is not one of "
                                                   f"{', '.join(COMPOSITE_KINDS)}")
            if kind_inside not in payload:
                raise ProtocolError(INVALID_EVENT, f"composite_input lists {kind_inside!r} but carries no payload")
            inputs.append((kind_inside, _parse_payload(kind_inside, payload[kind_inside])))
        unlisted = set(payload) - set(types) - {"input_types"}
        if unlisted:  # all-or-nothing: a payload the server would not apply must not pass silently
            raise ProtocolError(INVALID_EVENT, f"composite_input carries unlisted inputs {quote(sorted(unlisted))}")
        return CompositeInput(tuple(inputs))
    raise ProtocolError(INVALID_EVENT, f"unknown event kind {quote(kind)}")


def _payload_wire(kind: str, payload: Any) -> Any:
    if kind == "camera_actions":
        return camera_actions_wire(payload)
    if kind == "composite_input":
        wire: dict[str, Any] = {"input_types": [k for k, _ in payload.inputs]}
        for kind_inside, value in payload.inputs:
            wire[kind_inside] = _payload_wire(kind_inside, value)
        return wire
    return payload


# ---------------------------------------------------------------- client messages: decode / encode


def parse_init(raw: dict) -> InitRequest:
    c = INVALID_REQUEST
    if raw.get("type") != "init":
        raise ProtocolError(c, f"the first message must be type 'init', got {quote(raw.get('type'))}")
    if "prompt" not in raw:
        raise ProtocolError(c, "init needs a prompt")
    prompt = _str(raw["prompt"], "prompt", c, non_empty=True)
    first_frame = raw.get("first_frame")
    if isinstance(first_frame, (bytes, bytearray)):
        if not first_frame:
            raise ProtocolError(c, "first_frame holds no bytes")
        first_frame = bytes(first_frame)
    elif isinstance(first_frame, str):
        if not first_frame.startswith(("http://", "https://", "data:image/")):
            raise ProtocolError(c, f"first_frame must be image bytes, an http(s) URL or a data:image/ URL, "
                                   f"got {quote(first_frame)}")
    elif first_frame is not None:
        raise ProtocolError(c, f"first_frame must be image bytes or a URL, got {type(first_frame).__name__}")
    conditions = raw.get("condition_inputs")
    if conditions is not None:
        if not isinstance(conditions, dict):
            raise ProtocolError(c, f"condition_inputs must be a map, got {type(conditions).__name__}")
        conditions = dict(conditions)
        if conditions.get("camera_actions") is not None:
            conditions["camera_actions"] = parse_camera_actions(conditions["camera_actions"], c)
    size = _str(raw.get("size", "832x480"), "size", c)
    if not _SIZE.match(size):
        raise ProtocolError(c, f"size must be 'WxH' in pixels, e.g. '832x480'; got {quote(size)}")
    output_format = raw.get("realtime_output_format", "raw")
    if output_format is None:
        output_format = "raw"
    if output_format not in OUTPUT_FORMATS:
        raise ProtocolError(c, f"realtime_output_format must be one of {', '.join(OUTPUT_FORMATS)}, "
                               f"got {quote(output_format)}")
    pacing = raw.get("realtime_output_pacing")
    return InitRequest(
        prompt=prompt,
        first_frame=first_frame,
        condition_inputs=conditions,
        max_chunks=_opt_int(raw.get("max_chunks"), "max_chunks", c, 1),
        seed=_int(raw["seed"], "seed", c) if raw.get("seed") is not None else 42,
        guidance_scale=(_number(raw["guidance_scale"], "guidance_scale", c)
                        if raw.get("guidance_scale") is not None else 1.0),
        size=size,
        realtime_output_format=output_format,
        realtime_preview_max_width=_opt_int(raw.get("realtime_preview_max_width"), "realtime_preview_max_width",
                                            c, 1),
        realtime_output_pacing=None if pacing is None else _bool(pacing, "realtime_output_pacing", c),
        realtime_causal_sink_size=_opt_int(raw.get("realtime_causal_sink_size"), "realtime_causal_sink_size",
                                           c, 0),
        realtime_causal_kv_cache_num_frames=_opt_int(raw.get("realtime_causal_kv_cache_num_frames"),
                                                     "realtime_causal_kv_cache_num_frames", c, 1),
        num_inference_steps=(_int(raw["num_inference_steps"], "num_inference_steps", c, 1)
                             if raw.get("num_inference_steps") is not None else 4),
        fps=_opt_int(raw.get("fps"), "fps", c, 1),
        output_quality=_opt_int(raw.get("output_quality"), "output_quality", c, 0, 100),
        output_compression=_opt_int(raw.get("output_compression"), "output_compression", c, 0, 100),
        extra={k: v for k, v in raw.items() if k not in _INIT_FIELDS and k != "type"},
    )


def parse_event(raw: dict) -> EventMessage:
    if raw.get("type") != "event":
        raise ProtocolError(INVALID_EVENT, f"expected type 'event', got {quote(raw.get('type'))}")
    kind = raw.get("kind")
    if kind not in EVENT_KINDS:
        raise ProtocolError(INVALID_EVENT, f"unknown event kind {quote(kind)}")
    event_id = _opt_int(raw.get("event_id"), "event_id", INVALID_EVENT, 0)
    return EventMessage(kind, _parse_payload(kind, raw.get("payload")), event_id)


def decode_init(data: object) -> InitRequest:
    return parse_init(unpack_map(data, INVALID_REQUEST))


def decode_event(data: object) -> EventMessage:
    return parse_event(unpack_map(data, INVALID_EVENT))


def decode_client_message(data: object) -> ClientMessage:
    """Either message by its type (init errors say INVALID_REQUEST, everything else INVALID_EVENT)."""
    raw = unpack_map(data, INVALID_EVENT)
    return parse_init(raw) if raw.get("type") == "init" else parse_event(raw)


def init_wire(init: InitRequest) -> dict:
    wire: dict[str, Any] = dict(init.extra)
    wire["type"] = "init"
    for name in _INIT_FIELDS:
        value = getattr(init, name)
        if name == "condition_inputs" and value is not None:
            value = {k: camera_actions_wire(v) if k == "camera_actions" and v is not None else v
                     for k, v in value.items()}
        if value is not None:
            wire[name] = value
    return wire


def event_wire(event: EventMessage) -> dict:
    return {"type": "event", "kind": event.kind, "payload": _payload_wire(event.kind, event.payload),
            "event_id": event.event_id}


def encode_client_message(message: ClientMessage) -> bytes:
    if isinstance(message, InitRequest):
        return pack(init_wire(message))
    if isinstance(message, EventMessage):
        return pack(event_wire(message))
    raise TypeError(f"not a client message: {type(message).__name__}")


# ---------------------------------------------------------------- server messages: encode / decode


def frame_batch_header(batch: FrameBatch) -> dict:
    """The batch's map without its payload (type "frame_batch"; the header form renames it)."""
    wire: dict[str, Any] = {"type": "frame_batch"}
    for name in _BATCH_COMMON:
        wire[name] = getattr(batch, name)
    if batch.event_id is not None:
        wire["event_id"] = batch.event_id
    for name in (_RAW_FIELDS if batch.content_type == RAW_CONTENT_TYPE else _IMAGE_FIELDS):
        value = getattr(batch, name)
        wire[name] = list(value) if isinstance(value, tuple) else value
    return wire


def chunk_stats_wire(stats: ChunkStats) -> dict:
    wire: dict[str, Any] = dict(stats.extra)
    wire["type"] = "chunk_stats"
    for name in ("session_id", "request_id", "chunk_index", "event_id", *_STATS_MS, *_STATS_COUNTS,
                 "content_type"):
        wire[name] = getattr(stats, name)
    return wire


def error_message(exc: ProtocolError) -> ErrorMessage:
    return ErrorMessage(exc.content, exc.detail)


def encode_server_message(message: ServerMessage) -> list[bytes]:
    """The binary WebSocket messages for one server message, in sending order."""
    if isinstance(message, FrameBatch):
        header = frame_batch_header(message)
        if len(message.payload) >= SPLIT_PAYLOAD_BYTES:
            header["type"] = "frame_batch_header"
            return [pack(header), bytes(message.payload)]
        header["payload"] = bytes(message.payload)
        return [pack(header)]
    if isinstance(message, ChunkStats):
        return [pack(chunk_stats_wire(message))]
    if isinstance(message, ErrorMessage):
        wire = {"type": "error", "content": message.content}
        if message.detail is not None:
            wire["detail"] = message.detail
        return [pack(wire)]
    raise TypeError(f"not a server message: {type(message).__name__}")


SERVER_ERROR = "invalid server message"  # our client's content for a server that breaks the protocol


def parse_frame_batch(raw: dict, payload: bytes) -> FrameBatch:
    c = SERVER_ERROR
    missing = [name for name in _BATCH_COMMON if name not in raw]
    if missing:
        raise ProtocolError(c, f"frame batch lacks {', '.join(missing)}")
    if not isinstance(payload, (bytes, bytearray)):
        raise ProtocolError(c, f"frame batch payload must be bytes, got {type(payload).__name__}")
    payload = bytes(payload)
    content_type = _str(raw["content_type"], "content_type", c)
    num_frames = _int(raw["num_frames"], "num_frames", c, 0)
    total_size = _int(raw["total_size"], "total_size", c, 0)
    index = _int(raw["frame_batch_index"], "frame_batch_index", c, 0)
    count = _int(raw["num_frame_batches"], "num_frame_batches", c, 1)
    if index >= count:
        raise ProtocolError(c, f"frame_batch_index {index} is not below num_frame_batches {count}")
    final = _bool(raw["is_final_frame_batch"], "is_final_frame_batch", c)
    if final != (index == count - 1):
        raise ProtocolError(c, f"is_final_frame_batch is {final} for batch {index} of {count}")
    if total_size != len(payload):
        raise ProtocolError(c, f"total_size {total_size} but the payload holds {len(payload)} bytes")
    common = dict(request_id=_str(raw["request_id"], "request_id", c),
                  chunk_index=_int(raw["chunk_index"], "chunk_index", c, 0), content_type=content_type,
                  num_frames=num_frames, total_size=total_size, frame_batch_index=index, num_frame_batches=count,
                  is_final_frame_batch=final, event_id=_opt_int(raw.get("event_id"), "event_id", c),
                  payload=payload)
    if content_type == RAW_CONTENT_TYPE:
        missing = [name for name in _RAW_FIELDS if name not in raw]
        if missing:
            raise ProtocolError(c, f"raw frame batch lacks {', '.join(missing)}")
        width, height = _int(raw["width"], "width", c, 1), _int(raw["height"], "height", c, 1)
        channels = _int(raw["channels"], "channels", c)
        per_frame = _int(raw["bytes_per_frame"], "bytes_per_frame", c)
        if raw["format"] != "rgb24" or channels != RAW_CHANNELS or raw["encoding"] != "raw":
            raise ProtocolError(c, f"raw frames must be format rgb24, channels 3, encoding raw; got "
                                   f"{quote(raw['format'])}, {channels}, {quote(raw['encoding'])}")
        if per_frame != width * height * RAW_CHANNELS:
            raise ProtocolError(c, f"bytes_per_frame {per_frame} does not match {width}x{height} rgb24")
        raw_size = _int(raw["raw_size"], "raw_size", c)
        if raw_size != len(payload) or len(payload) != num_frames * per_frame:
            raise ProtocolError(c, f"a raw batch of {num_frames} frames of {per_frame} bytes holds "
                                   f"{len(payload)} bytes (raw_size {raw_size})")
        return FrameBatch(**common, format="rgb24", encoding="raw", width=width, height=height, channels=channels,
                          bytes_per_frame=per_frame, raw_size=raw_size)
    if content_type in IMAGE_CONTENT_TYPES.values():
        missing = [name for name in _IMAGE_FIELDS if name not in raw]
        if missing:
            raise ProtocolError(c, f"image frame batch lacks {', '.join(missing)}")
        lengths = raw["payload_lengths"]
        if (not isinstance(lengths, list) or len(lengths) != num_frames
                or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in lengths)
                or sum(lengths) != len(payload)):
            raise ProtocolError(c, f"payload_lengths {quote(lengths)} do not split {len(payload)} bytes into "
                                   f"{num_frames} images")
        sizes = {name: _int(raw[name], name, c, 1) for name in
                 ("source_width", "source_height", "preview_width", "preview_height", "width", "height")}
        return FrameBatch(**common, format=_str(raw["format"], "format", c),
                          encoding=_str(raw["encoding"], "encoding", c), payload_lengths=tuple(lengths), **sizes)
    raise ProtocolError(c, f"unknown frame content_type {quote(content_type)}")


def parse_chunk_stats(raw: dict) -> ChunkStats:
    c = SERVER_ERROR
    known = ("session_id", "request_id", "chunk_index", "event_id", *_STATS_MS, *_STATS_COUNTS, "content_type")
    missing = [name for name in known if name not in raw and name != "event_id"]
    if missing:
        raise ProtocolError(c, f"chunk_stats lacks {', '.join(missing)}")
    return ChunkStats(
        session_id=_str(raw["session_id"], "session_id", c), request_id=_str(raw["request_id"], "request_id", c),
        chunk_index=_int(raw["chunk_index"], "chunk_index", c, 0),
        event_id=_opt_int(raw.get("event_id"), "event_id", c),
        **{name: _number(raw[name], name, c) for name in _STATS_MS},
        **{name: _int(raw[name], name, c, 0) for name in _STATS_COUNTS},
        content_type=_str(raw["content_type"], "content_type", c),
        extra={k: v for k, v in raw.items() if k not in known and k != "type"},
    )


class ServerMessageReader:
    """Client side: binary messages in, typed server messages out. Holds the one piece of state the
    protocol has: a `frame_batch_header` whose payload is the next message."""

    def __init__(self) -> None:
        self._header: dict | None = None

    @property
    def awaiting_payload(self) -> bool:
        return self._header is not None

    def feed(self, data: object) -> ServerMessage | None:
        if self._header is not None:
            header, self._header = self._header, None
            if not isinstance(data, (bytes, bytearray)):
                raise ProtocolError(SERVER_ERROR, "a frame_batch_header must be followed by its binary payload")
            return parse_frame_batch(header, data)
        raw = unpack_map(data, SERVER_ERROR)
        kind = raw.get("type")
        if kind == "frame_batch":
            return parse_frame_batch(raw, raw.get("payload"))
        if kind == "frame_batch_header":
            self._header = raw  # checked with its payload, which is the next message
            return None
        if kind == "chunk_stats":
            return parse_chunk_stats(raw)
        if kind == "error":
            detail = raw.get("detail")
            return ErrorMessage(_str(raw.get("content"), "error content", SERVER_ERROR),
                                detail if isinstance(detail, str) else None)
        raise ProtocolError(SERVER_ERROR, f"unknown server message type {quote(kind)}")
