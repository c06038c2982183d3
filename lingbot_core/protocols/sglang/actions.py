"""Our keys and events <-> the protocol's camera actions.

Our engine's tokens (model/camera.py VALID_KEYS: w a s d move, i j k l look) are the protocol's tokens, so
the mapping is about *timing*, not names:
- client side, `event_to_message` turns one of our events into one protocol event under the same event_id:
  held keys -> a `state` with one transition, a script -> one token list per latent frame, and an event that
  also switches the prompt -> a `composite_input` of both (applied all-or-nothing, as ours is);
- server side, `CameraInput` keeps one session's camera input between blocks: script frames queue FIFO (at
  most MAX_SCRIPT_FRAMES), state transitions are level-triggered, and `next_block(n)` hands out the key sets
  of the next n latent frames. Unknown tokens are ignored; opposite keys are kept (camera.py cancels them).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from lingbot_core.boundary.events import Event, KeyStateEvent, PromptEvent, ScriptEvent
from lingbot_core.model.camera import VALID_KEYS
from lingbot_core.protocols.sglang.protocol import (MAX_SCRIPT_FRAMES, CameraActions, CameraScript, CameraState, CompositeInput,
                       EventMessage, Transition)


def tokens_to_keys(tokens: Iterable[str]) -> frozenset[str]:
    """Protocol tokens -> our key set; tokens we have no key for are ignored, as the reference says."""
    return frozenset(token for token in tokens if token in VALID_KEYS)


def state_payload(keys: Iterable[str], client_ts_ms: int | None = None) -> CameraState:
    """Held keys as a state payload: one transition to exactly this set (an empty set releases all)."""
    return CameraState((Transition(tuple(sorted(keys)), client_ts_ms),))


def script_payload(frames: Iterable[Iterable[str]]) -> CameraScript:
    """Per-latent-frame key sets as a script payload."""
    return CameraScript(tuple(tuple(sorted(keys)) for keys in frames))


def event_to_message(event: Event) -> EventMessage:
    """One of our events as one protocol event with the same event_id."""
    if isinstance(event, PromptEvent):
        return EventMessage("prompt", event.prompt, event.event_id)
    if isinstance(event, KeyStateEvent):
        camera: CameraActions = state_payload(event.keys)
    elif isinstance(event, ScriptEvent):
        camera = script_payload(event.frames)
    else:
        raise TypeError(f"not an event: {type(event).__name__}")
    if event.prompt is None:
        return EventMessage("camera_actions", camera, event.event_id)
    return EventMessage("composite_input", CompositeInput((("prompt", event.prompt), ("camera_actions", camera))),
                        event.event_id)


class CameraInput:
    """Server side: one session's camera input between blocks.

    A queued script takes precedence over held keys until it runs out. Held keys change on state
    transitions; each latent frame consumes pending transitions up to and including the first that changes
    the held set, so every change (a short press included) lasts at least one frame, while the web UI's
    resends of an unchanged state every 100 ms cost nothing."""

    def __init__(self, held: Iterable[str] = ()) -> None:
        self.held: frozenset[str] = tokens_to_keys(held)
        self._script: deque[frozenset[str]] = deque()
        self._pending: deque[frozenset[str]] = deque()

    @property
    def queued_script_frames(self) -> int:
        return len(self._script)

    def apply(self, actions: CameraActions) -> int:
        """Take one camera_actions payload; returns how many script frames were dropped by the queue cap."""
        if isinstance(actions, CameraScript):
            room = MAX_SCRIPT_FRAMES - len(self._script)
            self._script.extend(tokens_to_keys(frame) for frame in actions.frames[:max(room, 0)])
            return max(len(actions.frames) - max(room, 0), 0)
        if isinstance(actions, CameraState):
            self._pending.extend(tokens_to_keys(t.actions) for t in actions.transitions)
            return 0
        raise TypeError(f"not camera actions: {type(actions).__name__}")

    def _advance_state(self) -> frozenset[str]:
        while self._pending:
            keys = self._pending.popleft()
            if keys != self.held:
                self.held = keys
                break
        return self.held

    def next_block(self, latent_frames: int) -> tuple[frozenset[str], ...]:
        """The key sets of the next `latent_frames` latent frames. A block that starts on a queued script
        takes its frames from the script, padded with [] when it runs short (the reference's padding);
        otherwise each frame follows the held keys."""
        if latent_frames < 1:
            raise ValueError(f"a block has at least one latent frame, got {latent_frames}")
        if self._script:
            return tuple(self._script.popleft() if self._script else frozenset() for _ in range(latent_frames))
        return tuple(self._advance_state() for _ in range(latent_frames))
