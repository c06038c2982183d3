"""Server side: one connection's protocol events -> our engine's events, and each chunk's event_id echo.

`InboundEvents.add(message)` turns one protocol event into engine events (lingbot_core/boundary/events.py) under
ids of its own, strictly increasing per connection (the engine's rule), and queues them in a FIFO that
the server feeds to the engine as its event queue has room (so a 512-frame script is never refused for
the engine's queue cap). Each engine id remembers the protocol event_id it came from, so `applied(ids)`
(a Block's event_ids) gives the protocol id a chunk echoes.

    state transitions   -> one KeyStateEvent per change of the held set (the engine folds a press and
                           release between two blocks into the block's first frame, so a pulse lasts a frame);
                           an unchanged state (the web UI resends it every 100 ms) is queued at most once
                           a chunk: it changes nothing, but it is input, so a held key keeps the idle TTL away
    script              -> ScriptEvents of exactly frames_per_block key sets, the last padded with []
    prompt              -> KeyStateEvent(the held keys, prompt=...)
    composite_input     -> the same, the prompt riding on the first engine event (one event when the camera
                           part is one transition or at most one block of script); all checked before any
                           is queued, so it is all-or-nothing
    heartbeat           -> nothing

Unknown tokens are ignored (actions.tokens_to_keys). A script's frames join the engine's held keys (the
engine ORs them), where upstream's script replaces them while it runs.
"""

from __future__ import annotations

import itertools
import math
from collections import deque

from lingbot_core.boundary.events import Event, KeyStateEvent, ScriptEvent
from lingbot_core.boundary.prompt import clean_prompt
from lingbot_core.boundary.user_text import check_text
from lingbot_core.protocols.sglang.actions import tokens_to_keys
from lingbot_core.protocols.sglang.protocol import (INVALID_EVENT, MAX_SCRIPT_FRAMES, CameraActions, CameraScript, CameraState, CompositeInput,
                       EventMessage, ProtocolError)


class InboundEvents:
    def __init__(self, frames_per_block: int, max_prompt_chars: int, max_queued: int = 64) -> None:
        """max_queued: engine events this FIFO holds beyond a full-length script before an event is refused."""
        self.frames_per_block = frames_per_block
        self.max_prompt_chars = max_prompt_chars
        self.max_pending = math.ceil(MAX_SCRIPT_FRAMES / frames_per_block) + max_queued
        self.pending: deque[Event] = deque()
        self.held: frozenset[str] = frozenset()  # the held set once every queued event applies
        self._next_id = 0
        self._protocol_ids: dict[int, int | None] = {}  # engine id -> the protocol event_id it came from
        self._queued_since_chunk = False  # anything queued since the last chunk (see `chunk_done`)

    # -- protocol events in

    def add(self, message: EventMessage) -> int:
        """Queue one protocol event's engine events; how many. ProtocolError(INVALID_EVENT): nothing queued."""
        kind, payload = message.kind, message.payload
        if kind == "heartbeat":
            return 0
        if kind == "prompt":
            events = self._camera(None, self._prompt(payload))
        elif kind == "camera_actions":
            events = self._camera(payload, None)
        elif kind == "composite_input":
            inputs = dict(payload.inputs) if isinstance(payload, CompositeInput) else {}
            prompt = self._prompt(inputs["prompt"]) if "prompt" in inputs else None
            events = self._camera(inputs.get("camera_actions"), prompt)
        else:  # decode_event admits no other kind; a caller building messages by hand might
            raise ProtocolError(INVALID_EVENT, f"unknown event kind {kind!r}")
        if len(self.pending) + len(events) > self.max_pending:
            raise ProtocolError(INVALID_EVENT, f"{len(self.pending)} engine events already wait for the model; "
                                               f"this one would pass the limit of {self.max_pending}: wait for "
                                               "the next chunks")
        for event in events:  # commit: ids, held keys and the echo map move together
            self._protocol_ids[event.event_id] = message.event_id
            self.pending.append(event)
            if isinstance(event, KeyStateEvent):
                self.held = event.keys
        self._next_id += len(events)
        self._queued_since_chunk |= bool(events)
        return len(events)

    def _prompt(self, text: object) -> str:
        """The prompt cleaned, here at the protocol's boundary (the engine takes it as it is); one it cannot
        clean is refused here, so a composite is refused whole."""
        try:
            return clean_prompt(check_text(text, "the prompt"), self.max_prompt_chars)
        except (ValueError, TypeError) as exc:  # PromptError is a ValueError
            raise ProtocolError(INVALID_EVENT, str(exc)) from None

    def _camera(self, actions: CameraActions | None, prompt: str | None) -> list[Event]:
        """The engine events of one camera input (and a prompt riding on the first), ids not yet spent: the
        next ids from `_next_id` on, one each, whatever the input's length (the protocol bounds it)."""
        counter = itertools.count(self._next_id)
        ids = lambda: next(counter)  # noqa: E731  (an unbounded counter: never StopIteration)
        events: list[Event] = []
        if isinstance(actions, CameraScript):
            n = self.frames_per_block
            frames = [tokens_to_keys(frame) for frame in actions.frames]
            frames += [frozenset()] * (-len(frames) % n)  # the reference pads a short script with []
            for start in range(0, len(frames), n):
                events.append(ScriptEvent(ids(), tuple(frames[start:start + n]), prompt if not events else None))
        elif isinstance(actions, CameraState):
            held = self.held
            for transition in actions.transitions:
                keys = tokens_to_keys(transition.actions)
                if keys != held:
                    events.append(KeyStateEvent(ids(), keys, prompt if not events else None))
                    held = keys
            if not events and (prompt is not None or not self._queued_since_chunk):
                events.append(KeyStateEvent(ids(), held, prompt))  # a resend: still input, once a chunk
        elif actions is None:
            events.append(KeyStateEvent(ids(), self.held, prompt))
        else:
            raise ProtocolError(INVALID_EVENT, f"camera_actions of type {type(actions).__name__}")
        return events

    # -- engine events out

    def take(self, room: int) -> list[Event]:
        """Up to `room` queued engine events, first first, to post now."""
        return [self.pending.popleft() for _ in range(min(max(room, 0), len(self.pending)))]

    def chunk_done(self, engine_ids: tuple[int, ...]) -> int | None:
        """A chunk arrived that applied these engine events: the protocol event_id it echoes (that of the last
        one carrying an id), or None when it applied none."""
        self._queued_since_chunk = False
        echo = None
        for engine_id in engine_ids:
            protocol_id = self._protocol_ids.get(engine_id)
            echo = protocol_id if protocol_id is not None else echo
        if engine_ids:  # these and any earlier ones (dropped by a failed block) will not come again
            last = max(engine_ids)
            for engine_id in [i for i in self._protocol_ids if i <= last]:
                del self._protocol_ids[engine_id]
        return echo
