"""Control events: the JSON a client sends, checked strictly before anything acts on it.

Two forms, each with a strictly increasing integer `event_id`:
- a script event  {"event_id": 3, "frames": [["w"], ["w", "j"], []]}: key sets for one block's latent frames;
- a key-state event {"event_id": 4, "keys": ["w"]}: the keys now held (they act until released).
Either may carry "prompt": a new text from the next block on. A prompt is cleaned here, at the parse
(model/text.clean_prompt), and nowhere after: a typed event's prompt is the cleaned text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from lingbot_core.model.camera import VALID_KEYS
from lingbot_core.config import TextConfig
from lingbot_core.model.text import PromptError, clean_prompt
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


Event = ScriptEvent | KeyStateEvent


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


def parse_event(raw: object, frames_per_block: int, max_prompt_chars: int = MAX_PROMPT_CHARS) -> Event:
    """Check one decoded JSON object and turn it into an event, its prompt cleaned; raises EventError naming
    the problem."""
    if not isinstance(raw, dict):
        raise EventError(f"an event must be a JSON object, got {type(raw).__name__}")
    unknown = set(raw) - {"event_id", "frames", "keys", "prompt"}
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
    if ("frames" in raw) == ("keys" in raw):
        raise EventError(f"event {event_id} must have exactly one of 'frames' (a script) or 'keys' (held keys)")
    if "keys" in raw:
        return KeyStateEvent(event_id, _keys(raw["keys"], f"event {event_id} keys"), prompt)
    frames = raw["frames"]
    if not isinstance(frames, list) or len(frames) != frames_per_block:
        count = len(frames) if isinstance(frames, list) else type(frames).__name__
        raise EventError(f"event {event_id} frames must be a list of {frames_per_block} key lists, got {count}")
    return ScriptEvent(event_id, tuple(_keys(f, f"event {event_id} frame {i}") for i, f in enumerate(frames)), prompt)


def accept_event(raw: object, frames_per_block: int, max_prompt_chars: int) -> Event:
    """An event as a session takes it, local or remote: parsed (its prompt cleaned) unless already typed, whose
    prompt was cleaned at its own parse; a script exactly one block long. EventError names what is wrong."""
    event = raw if isinstance(raw, (ScriptEvent, KeyStateEvent)) else parse_event(raw, frames_per_block,
                                                                                  max_prompt_chars)
    if isinstance(event, ScriptEvent) and len(event.frames) != frames_per_block:
        raise EventError(f"event {event.event_id} frames must hold {frames_per_block} key sets, "
                         f"got {len(event.frames)}")
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
