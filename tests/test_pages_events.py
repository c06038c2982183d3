"""Page bookkeeping and event parsing: running out is a value, double free raises, bad events are named."""

import pytest

from lingbot_core.boundary.events import EventError, KeyStateEvent, ScriptEvent, parse_event, parse_event_line, read_events
from lingbot_core.blocks.pages import PageAllocator, PageError


def test_allocator_running_out_is_a_value_and_takes_nothing():
    pages = PageAllocator(5)
    first = pages.allocate(3)
    assert sorted(first) == [0, 1, 2] and pages.num_free == 2
    assert pages.can_allocate(2) and not pages.can_allocate(3)
    assert pages.allocate(3) is None and pages.num_free == 2
    pages.free(first)
    assert pages.num_free == 5 and pages.num_in_use == 0 and pages.usage == 0.0


def test_allocator_double_free_raises_and_keeps_state():
    pages = PageAllocator(4)
    ids = pages.allocate(2)
    pages.free(ids[:1])
    with pytest.raises(PageError, match="not in use"):
        pages.free(ids)
    assert pages.num_in_use == 1
    with pytest.raises(PageError):
        pages.free([ids[1], ids[1]])
    assert pages.num_in_use == 1


def test_script_and_key_events_parse():
    event = parse_event({"event_id": 3, "frames": [["w"], ["w", "j"], []]}, 3)
    assert event == ScriptEvent(3, (frozenset("w"), frozenset("wj"), frozenset()))
    assert parse_event({"event_id": 4, "keys": ["a"], "prompt": "x"}, 3) == KeyStateEvent(4, frozenset("a"), "x")


@pytest.mark.parametrize("raw, message", [
    ([1, 2], "JSON object"),
    ({"event_id": "1", "keys": []}, "event_id"),
    ({"event_id": True, "keys": []}, "event_id"),
    ({"event_id": -1, "keys": []}, "event_id"),
    ({"event_id": 1}, "exactly one"),
    ({"event_id": 1, "keys": [], "frames": [[], [], []]}, "exactly one"),
    ({"event_id": 1, "frames": [[], []]}, "list of 3"),
    ({"event_id": 1, "frames": "www"}, "list of 3"),
    ({"event_id": 1, "frames": [["w"], ["x"], []]}, "unknown key 'x'"),
    ({"event_id": 1, "keys": [1]}, "strings"),
    ({"event_id": 1, "keys": "w"}, "list of keys"),
    ({"event_id": 1, "keys": [], "prompt": 5}, "prompt"),
    ({"event_id": 1, "keys": [], "speed": 2}, "unknown event fields"),
])
def test_bad_events_are_refused_with_a_reason(raw, message):
    with pytest.raises(EventError, match=message):
        parse_event(raw, 3)


def test_jsonl_script_checks_order_and_syntax():
    good = '{"event_id": 0, "keys": ["w"]}\n\n{"event_id": 2, "frames": [[], [], ["d"]]}\n'
    assert [e.event_id for e in read_events(good, 3)] == [0, 2]
    with pytest.raises(EventError, match="line 2: event_id 0 does not increase"):
        read_events('{"event_id": 0, "keys": []}\n{"event_id": 0, "keys": []}', 3)
    with pytest.raises(EventError, match="line 1: not valid JSON"):
        read_events("{event_id: 0}", 3)
    with pytest.raises(EventError, match="limited"):
        parse_event_line("x" * 70000, 3)
