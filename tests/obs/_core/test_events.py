"""The event bus: declared events, validated subscriptions, removable handles, isolation of failures."""

from __future__ import annotations

import pytest

import obs
from obs._core.events import Event, EventBus, HookValidationError
from obs._core.internal import internal_error_counts, set_raise_internal_errors


def test_every_event_declares_name_args_and_meaning():
    assert {e.spec.name for e in Event} >= {"step_begin", "step_end", "module_enter", "module_exit", "op",
                                            "graph_compiled", "memory", "collective", "print", "fault"}
    assert all(e.spec.doc and isinstance(e.spec.args, tuple) for e in Event)


def test_handlers_get_positional_arguments_until_removed():
    bus = EventBus()
    seen = []
    sub = bus.subscribe(Event.STEP_END, lambda step, duration_ns: seen.append((step, duration_ns)))
    bus.emit(Event.STEP_END, 1, 10)
    sub.remove()
    sub.remove()  # idempotent
    bus.emit(Event.STEP_END, 2, 20)
    assert seen == [(1, 10)] and not sub.active and not bus.has_subscribers(Event.STEP_END)


def test_subscription_is_a_context_manager():
    bus = EventBus()
    with bus.subscribe(Event.PRINT, lambda values, meta: None):
        assert bus.has_subscribers(Event.PRINT)
    assert not bus.has_subscribers(Event.PRINT)


def test_handler_with_wrong_arity_is_rejected_at_subscription():
    with pytest.raises(HookValidationError, match=r"STEP_END.*2 positional argument\(s\) \(step, duration_ns\)"):
        EventBus().subscribe(Event.STEP_END, lambda step: None)


def test_non_event_is_rejected():
    with pytest.raises(TypeError, match=r"obs\.Event member"):
        EventBus().subscribe("step_end", lambda *a: None)  # type: ignore[arg-type]


def test_failing_handler_is_counted_and_does_not_reach_the_caller():
    bus = EventBus()
    seen = []

    def broken(step):
        raise RuntimeError("subscriber bug")

    bus.subscribe(Event.STEP_BEGIN, broken)
    bus.subscribe(Event.STEP_BEGIN, seen.append)
    old = set_raise_internal_errors(False)
    try:
        before = sum(internal_error_counts().values())
        bus.emit(Event.STEP_BEGIN, 7)
        bus.emit(Event.STEP_BEGIN, 8)
    finally:
        set_raise_internal_errors(old)
    assert seen == [7, 8]
    assert sum(internal_error_counts().values()) == before + 2


def test_failing_handler_raises_in_test_mode():
    bus = EventBus()
    bus.subscribe(Event.STEP_BEGIN, lambda step: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        bus.emit(Event.STEP_BEGIN, 1)


def test_watchers_hear_about_subscription_changes():
    bus = EventBus()
    heard = []
    undo = bus.watch(heard.append)
    sub = bus.subscribe(Event.OP, lambda *a: None)
    sub.remove()
    undo()
    bus.subscribe(Event.OP, lambda *a: None)
    assert heard == [Event.OP, Event.OP]


def test_public_subscribe_uses_the_global_bus():
    sub = obs.subscribe(obs.Event.FAULT, lambda kind, detail, error: None)
    assert obs.bus.has_subscribers(obs.Event.FAULT)
    sub.remove()
