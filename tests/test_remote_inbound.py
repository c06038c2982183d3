"""lingbot_core.protocols.sglang.inbound: protocol events -> engine events (ids, padding, folding, all-or-nothing, echo)."""

from __future__ import annotations

import pytest

from lingbot_core.boundary.events import KeyStateEvent, ScriptEvent
from lingbot_core.protocols.sglang.protocol import (INVALID_EVENT, CameraScript, CameraState, CompositeInput, EventMessage,
                                          ProtocolError, Transition)
from lingbot_core.protocols.sglang.inbound import InboundEvents

F = 3  # latent frames per block


def state(*sets) -> CameraState:
    return CameraState(tuple(Transition(tuple(s)) for s in sets))


def test_a_script_becomes_whole_blocks_padded_with_empty_sets_and_unknown_tokens_are_ignored():
    inbound = InboundEvents(F, 100)
    assert inbound.add(EventMessage("camera_actions", CameraScript((("w", "x"), ("a",), (), ("d",))), 7)) == 2
    first, second = inbound.take(10)
    assert first == ScriptEvent(0, (frozenset("w"), frozenset("a"), frozenset()))
    assert second == ScriptEvent(1, (frozenset("d"), frozenset(), frozenset()))
    assert inbound.chunk_done((0,)) == 7 and inbound.chunk_done((1,)) == 7


def test_state_transitions_post_each_change_and_a_resend_once_a_chunk():
    inbound = InboundEvents(F, 100)
    inbound.add(EventMessage("camera_actions", state(["w"], [], ["w"]), 1))  # a tap and a press in one message
    assert [e.keys for e in inbound.take(10)] == [frozenset("w"), frozenset(), frozenset("w")]
    assert inbound.add(EventMessage("camera_actions", state(["w"]), 2)) == 0  # a resend, input already queued
    assert inbound.chunk_done((0, 1, 2)) == 1
    assert inbound.add(EventMessage("camera_actions", state(["w"]), 3)) == 1  # first input of this chunk
    assert inbound.take(10) == [KeyStateEvent(3, frozenset("w"))]
    assert inbound.chunk_done(()) is None  # a chunk that applied nothing echoes nothing


def test_a_prompt_keeps_the_held_keys_and_a_composite_is_one_event():
    inbound = InboundEvents(F, 100)
    inbound.add(EventMessage("camera_actions", state(["i"]), 0))
    inbound.add(EventMessage("prompt", "at night", 1))
    inbound.add(EventMessage("composite_input", CompositeInput((("prompt", "by day"),
                                                                ("camera_actions", state(["s"])))), 2))
    assert inbound.take(10) == [KeyStateEvent(0, frozenset("i")), KeyStateEvent(1, frozenset("i"), "at night"),
                                KeyStateEvent(2, frozenset("s"), "by day")]
    assert inbound.add(EventMessage("heartbeat", {}, None)) == 0


def test_a_bad_prompt_in_a_composite_queues_nothing():
    inbound = InboundEvents(F, 10)
    with pytest.raises(ProtocolError) as caught:
        inbound.add(EventMessage("composite_input", CompositeInput((("camera_actions", state(["w"])),
                                                                    ("prompt", "x" * 50)))))
    assert caught.value.content == INVALID_EVENT and "prompt" in caught.value.detail
    assert not inbound.pending and inbound.held == frozenset()
    inbound.add(EventMessage("camera_actions", state(["w"]), 5))
    assert inbound.take(1) == [KeyStateEvent(0, frozenset("w"))]  # no id was spent by the refused one


def test_a_full_length_script_fits_and_the_fifo_is_bounded():
    inbound = InboundEvents(F, 100, max_queued=1)
    assert inbound.add(EventMessage("camera_actions", CameraScript((("w",),) * 512), 0)) == 171
    inbound.add(EventMessage("prompt", "more", 1))
    with pytest.raises(ProtocolError, match="wait for the next chunks"):
        inbound.add(EventMessage("prompt", "too many", 2))
    ids = [e.event_id for e in inbound.take(1000)]
    assert ids == list(range(172))
