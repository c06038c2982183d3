"""Control events: the JSON a client sends, checked strictly before anything acts on it.

Four forms, each with a strictly increasing integer `event_id`:
- a script event  {"event_id": 3, "frames": [["w"], ["w", "j"], []]}: key sets for one block's latent frames;
- a key-state event {"event_id": 4, "keys": ["w"]}: the keys now held (they act until released);
- a pose script {"event_id": 5, "poses": [4x4, 4x4, 4x4]}: one block's camera-to-world poses, relative to the
  world's start (a replay of a world driven by camera motion; the offline tab);
- a camera motion {"event_id": 6, "camera": {"mode": "velocity"|"target", "translation": [x, y, z],
  "rotation": [qx, qy, qz, qw], "steps": n}}: an SE(3) command in force until the next camera input
  (vLLM-Omni's camera interaction; lingbot_core/model/camera_motion.py integrates it at block boundaries).
Any may carry "prompt": a new text from the next block on; {"event_id": 7, "prompt": "..."} alone changes only
the text (the camera goes on as it was). A prompt is cleaned here, at the parse
(model/text.clean_prompt), and nowhere after: a typed event's prompt is the cleaned text.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lingbot_core.model.camera import VALID_KEYS
from lingbot_core.config import TextConfig
from lingbot_core.boundary.prompt import PromptError, clean_prompt
from lingbot_core.boundary.user_text import check_text, quote

MAX_EVENT_LINE_BYTES = 64 * 1024
MAX_EVENTS_PER_CALL = 64
MAX_PROMPT_CHARS = TextConfig.max_prompt_chars  # every model's bound unless its config says otherwise


class EventError(ValueError):
    """An event that cannot be applied; the message names the field and the problem."""


@dataclass(frozen=True)
class ScriptEvent:
    event_id: int
    frames: tuple[frozenset[str], ...]
    prompt: str | None = None


@dataclass(frozen=True)
class KeyStateEvent:
    event_id: int
    keys: frozenset[str]
    prompt: str | None = None


@dataclass(frozen=True)
class PoseEvent:
    """One block's camera-to-world poses [F, 4, 4] (rigid, relative to the world's start): a script of poses."""

    event_id: int
    poses: np.ndarray
    prompt: str | None = None

    def __post_init__(self) -> None:
        poses = np.array(self.poses, dtype=np.float64)  # a private, read-only copy: the event is a value
        poses.flags.writeable = False
        object.__setattr__(self, "poses", poses)


MOTION_MODES = ("velocity", "target")
MAX_MOTION_STEPS = 10_000  # a target reached over at most this many latent frames (upstream sets no bound)


@dataclass(frozen=True)
class MotionEvent:
    """An SE(3) camera command, in force until the next camera input. velocity: this motion each latent frame,
    composed in the camera's frame; target: glide to this pose (relative to the world's start) over `steps`
    latent frames (0: at once). rotation is a unit quaternion (x, y, z, w)."""

    event_id: int
    mode: str
    translation: tuple[float, float, float] = (0.0, 0.0, 0.0)
    rotation: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 1.0)
    steps: int = 0
    prompt: str | None = None


@dataclass(frozen=True)
class PromptEvent:
    """A new text from the next block on; the camera input in force goes on."""

    event_id: int
    prompt: str


Event = ScriptEvent | KeyStateEvent | PoseEvent | MotionEvent | PromptEvent
SCRIPTS = (ScriptEvent, PoseEvent)  # events that give a whole block's camera (and end its input)


def block_keys(held: frozenset[str], snapshots: list[frozenset[str]],
               frames_per_block: int) -> tuple[tuple[frozenset[str], ...], frozenset[str]]:
    """One block's key sets from the held keys and the key states posted since the last block, as upstream
    reduces them (vLLM-Omni's LingBotCameraControlReducer, whose clients the real checkpoint was trained
    with): the block holds the last state; if the last non-empty state differs from it (a key pressed and
    released between two blocks, or a switch), the first frame takes that state instead, one frame's pulse.
    So only one pulse survives a block: W held with a tap of D gives (W, W, W), a tap of A then of D gives
    (D, -, -). Returns the frames and the keys held after the block."""
    final = snapshots[-1] if snapshots else held
    pulse = next((keys for keys in reversed(snapshots) if keys), None)
    if pulse is not None and pulse != final:
        return (pulse,) + (final,) * (frames_per_block - 1), final
    return (final,) * frames_per_block, final


def _keys(value, where: str) -> frozenset[str]:
    if not isinstance(value, list):
        raise EventError(f"{where} must be a list of keys, got {type(value).__name__}")
    for key in value:
        if not isinstance(key, str):
            raise EventError(f"{where} holds {quote(key)}; keys are strings from {''.join(sorted(VALID_KEYS))}")
        if key not in VALID_KEYS:
            raise EventError(f"{where} holds unknown key {quote(key)}; valid keys are {', '.join(sorted(VALID_KEYS))}")
    return frozenset(value)


def _numbers(value, count: int, where: str) -> tuple[float, ...]:
    if not isinstance(value, (list, tuple)) or len(value) != count or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value):
        raise EventError(f"{where} must be {count} finite numbers")
    return tuple(float(v) for v in value)


def _poses(value, frames_per_block: int, where: str) -> np.ndarray:
    """[F, 4, 4] rigid camera-to-world poses: a rotation (orthonormal, det +1), a translation, last row 0 0 0 1."""
    if not isinstance(value, (list, tuple, np.ndarray)) or len(value) != frames_per_block:
        raise EventError(f"{where} must be {frames_per_block} 4x4 matrices")
    rows = [_numbers(row, 4, where) for pose in value for row in (pose if isinstance(pose, (list, tuple, np.ndarray))
                                                                  and len(pose) == 4 else [None])]
    poses = np.array(rows, dtype=np.float64).reshape(frames_per_block, 4, 4)
    rotation = poses[:, :3, :3]
    if (not np.allclose(rotation @ rotation.transpose(0, 2, 1), np.eye(3), atol=1e-6)
            or not np.allclose(np.linalg.det(rotation), 1.0, atol=1e-6)
            or not np.array_equal(poses[:, 3], np.broadcast_to([0.0, 0.0, 0.0, 1.0], (frames_per_block, 4)))):
        raise EventError(f"{where} must be rigid: an orthonormal rotation with determinant 1 and a last row 0 0 0 1")
    return poses


def _motion(raw, event_id: int, prompt: str | None) -> MotionEvent:
    where = f"event {event_id} camera"
    if not isinstance(raw, dict):
        raise EventError(f"{where} must be an object")
    unknown = set(raw) - {"mode", "translation", "rotation", "steps"}
    if unknown:
        raise EventError(f"unknown {where} fields: {quote(sorted(unknown))}")
    mode = raw.get("mode")
    if mode not in MOTION_MODES:
        raise EventError(f"{where} mode must be one of {', '.join(MOTION_MODES)}, got {quote(mode)}")
    translation = _numbers(raw.get("translation", [0, 0, 0]), 3, f"{where} translation")
    rotation = _numbers(raw.get("rotation", [0, 0, 0, 1]), 4, f"{where} rotation")
    norm = math.sqrt(sum(q * q for q in rotation))
    if not norm > 1e-12:
        raise EventError(f"{where} rotation must be a non-zero quaternion (x, y, z, w)")
    steps = raw.get("steps", 0)
    if isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps <= MAX_MOTION_STEPS:
        raise EventError(f"{where} steps must be a whole number from 0 to {MAX_MOTION_STEPS}")
    return MotionEvent(event_id, mode, translation, tuple(q / norm for q in rotation), steps, prompt)


def parse_event(raw: object, frames_per_block: int, max_prompt_chars: int = MAX_PROMPT_CHARS) -> Event:
    """Check one decoded JSON object and turn it into an event, its prompt cleaned; raises EventError naming
    the problem."""
    if not isinstance(raw, dict):
        raise EventError(f"an event must be a JSON object, got {type(raw).__name__}")
    unknown = set(raw) - {"event_id", "frames", "keys", "poses", "camera", "prompt"}
    if unknown:
        raise EventError(f"unknown event fields: {quote(sorted(unknown))}")
    event_id = raw.get("event_id")
    if isinstance(event_id, bool) or not isinstance(event_id, int) or event_id < 0:
        raise EventError(f"event_id must be a non-negative integer, got {quote(event_id)}")
    prompt = raw.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise EventError(f"prompt must be a string, got {type(prompt).__name__}")
    if prompt is not None:
        try:  # text no encoder can write would fail in the tokenizer on every later block
            prompt = clean_prompt(check_text(prompt, f"event {event_id} prompt"), max_prompt_chars)
        except PromptError as exc:
            raise EventError(f"event {event_id} prompt: {exc}") from None
        except ValueError as exc:
            raise EventError(str(exc)) from None
    camera_fields = sum(field in raw for field in ("frames", "keys", "poses", "camera"))
    if camera_fields == 0 and prompt is not None:
        return PromptEvent(event_id, prompt)
    if camera_fields != 1:
        raise EventError(f"event {event_id} must have exactly one of 'frames' (a script), 'keys' (held keys), "
                         "'poses' (a block's poses) or 'camera' (a camera motion), or only a 'prompt'")
    if "keys" in raw:
        return KeyStateEvent(event_id, _keys(raw["keys"], f"event {event_id} keys"), prompt)
    if "poses" in raw:
        return PoseEvent(event_id, _poses(raw["poses"], frames_per_block, f"event {event_id} poses"), prompt)
    if "camera" in raw:
        return _motion(raw["camera"], event_id, prompt)
    frames = raw["frames"]
    if not isinstance(frames, list) or len(frames) != frames_per_block:
        count = len(frames) if isinstance(frames, list) else type(frames).__name__
        raise EventError(f"event {event_id} frames must be a list of {frames_per_block} key lists, got {count}")
    return ScriptEvent(event_id, tuple(_keys(f, f"event {event_id} frame {i}") for i, f in enumerate(frames)), prompt)


def accept_event(raw: object, frames_per_block: int, max_prompt_chars: int) -> Event:
    """An event as a session takes it, local or remote: parsed (its prompt cleaned) unless already typed, whose
    prompt was cleaned at its own parse; a script exactly one block long. EventError names what is wrong."""
    event = raw if isinstance(raw, Event) else parse_event(raw, frames_per_block, max_prompt_chars)
    if isinstance(event, ScriptEvent) and len(event.frames) != frames_per_block:
        raise EventError(f"event {event.event_id} frames must hold {frames_per_block} key sets, "
                         f"got {len(event.frames)}")
    if isinstance(event, PoseEvent):  # a typed one was built in code: checked as the JSON one is
        _poses(event.poses.tolist(), frames_per_block, f"event {event.event_id} poses")
    return event


def parse_event_line(line: str | bytes, frames_per_block: int, max_prompt_chars: int = MAX_PROMPT_CHARS) -> Event:
    if len(line) > MAX_EVENT_LINE_BYTES:
        raise EventError(f"an event line is limited to {MAX_EVENT_LINE_BYTES} bytes")
    return parse_event(decode_json(line), frames_per_block, max_prompt_chars)


def decode_json(text: str | bytes) -> object:
    """json.loads with every failure as an EventError that says what is wrong in plain words."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise EventError(f"not valid JSON: {exc}") from None
    except UnicodeDecodeError:
        raise EventError("not valid JSON: the text is not UTF-8") from None
    except RecursionError:
        raise EventError("the JSON is nested too deeply to read") from None
    except ValueError:  # Python's cap on integer digits (int_max_str_digits)
        raise EventError("the JSON holds a number with too many digits") from None


def parse_actions(events: str | dict | list, frames_per_block: int,
                  max_prompt_chars: int = MAX_PROMPT_CHARS) -> list[Event]:
    """The events of one live call (an app's /act): one event object or a list of them, as JSON text or
    already decoded, each parsed by `parse_event`; all are checked before any is used."""
    if isinstance(events, str):
        if not events.strip():
            return []
        if len(events) > MAX_EVENTS_PER_CALL * MAX_EVENT_LINE_BYTES:
            raise EventError(f"the events text is {len(events)} characters; at most "
                             f"{MAX_EVENTS_PER_CALL * MAX_EVENT_LINE_BYTES} are accepted in one call")
        try:
            events = decode_json(events)
        except EventError as exc:
            raise EventError(f"the events cannot be read: {exc}") from None
    if isinstance(events, dict):
        events = [events]
    if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
        raise EventError('events must be a JSON object like {"event_id": 1, "keys": ["w"]} or a list of them')
    if len(events) > MAX_EVENTS_PER_CALL:
        raise EventError(f"at most {MAX_EVENTS_PER_CALL} events per call, got {len(events)}")
    return [parse_event(raw, frames_per_block, max_prompt_chars) for raw in events]


def read_events(text: str, frames_per_block: int, max_prompt_chars: int = MAX_PROMPT_CHARS,
                max_events: int | None = None) -> list[Event]:
    """Parse a JSONL action script; blank lines are skipped, ids must increase strictly. With `max_events`, a
    script of more events is refused at the first one past it, before the rest is read."""
    events: list[Event] = []
    for number, line in enumerate(_lines(text), start=1):
        if not line.strip():
            continue
        if max_events is not None and len(events) >= max_events:
            raise EventError(f"line {number}: the script holds more than {max_events} events; this server makes at "
                             f"most {max_events} blocks a request")
        try:
            event = parse_event_line(line, frames_per_block, max_prompt_chars)
        except EventError as exc:
            raise EventError(f"line {number}: {exc}") from None
        if events and event.event_id <= events[-1].event_id:
            raise EventError(f"line {number}: event_id {event.event_id} does not increase "
                             f"(previous {events[-1].event_id})")
        events.append(event)
    return events


def _lines(text: str):
    """The lines of `text` one at a time (str.splitlines would split all of a huge script first)."""
    start = 0
    while start < len(text):
        end = text.find("\n", start)
        if end < 0:
            end = len(text)
        yield text[start:end].rstrip("\r")
        start = end + 1


def read_events_file(path: str | Path, frames_per_block: int) -> list[Event]:
    path = Path(path)
    if not path.is_file():
        raise EventError(f"no events file at {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise EventError(f"{path} is not UTF-8 text") from None
    return read_events(text, frames_per_block)
