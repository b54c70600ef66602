"""The hook registry: order, removable handles, copy-on-write calls, and a failing hook kept from the caller."""

from __future__ import annotations

import gc

import pytest

from obs._core.hooks import HookHandle, Hooks
from obs._core.internal import internal_error_counts, set_raise_internal_errors
from obs.runtime.steps import StepTracker


@pytest.fixture
def production():
    """Internal errors swallowed and counted, as in a user's process (the suite raises them)."""
    old = set_raise_internal_errors(False)
    yield
    set_raise_internal_errors(old)


def test_hooks_run_in_the_order_added_until_their_handle_removes_them():
    hooks, seen = Hooks("test hook"), []
    first = hooks.add(lambda x: seen.append(("first", x)))
    hooks.add(lambda x: seen.append(("second", x)))
    hooks.call(1)
    first.remove()
    first.remove()  # idempotent
    hooks.call(2)
    assert seen == [("first", 1), ("second", 1), ("second", 2)]
    assert not first.active and len(hooks) == 1


def test_a_handle_is_a_context_manager():
    hooks = Hooks("test hook")
    with hooks.add(print) as handle:
        assert print in hooks and handle.active
    assert not hooks.snapshot and not handle.active


def test_remove_by_value_takes_every_copy_and_is_idempotent():
    hooks = Hooks("test hook")
    handles = [hooks.add(print), hooks.add(len), hooks.add(print)]
    hooks.remove(print)
    hooks.remove(print)
    assert hooks.snapshot == (len,) and [h.active for h in handles] == [False, True, False]
    hooks.clear()
    assert hooks.snapshot == () and not handles[1].active


def test_the_snapshot_is_replaced_not_changed_so_a_call_finishes_with_the_hooks_it_started_with():
    hooks, seen = Hooks("test hook"), []
    later = []

    def first():
        seen.append("first")
        later.append(hooks.add(lambda: seen.append("added while called")))
        second_handle.remove()

    hooks.add(first)
    second_handle = hooks.add(lambda: seen.append("second"))
    before = hooks.snapshot
    hooks.call()
    assert seen == ["first", "second"] and before == (first, second_handle.hook) and hooks.snapshot != before
    later[0].remove()


def test_on_change_hears_each_add_and_remove_but_not_a_remove_of_nothing():
    heard = []
    hooks = Hooks("test hook", on_change=lambda: heard.append(len(hooks)))
    handle = hooks.add(print)
    hooks.remove(len)
    handle.remove()
    handle.remove()
    hooks.clear()
    assert heard == [1, 0]


def test_a_failing_hook_is_reported_by_name_and_the_next_one_still_runs(production):
    hooks, seen = Hooks("test hook"), []

    def broken(x):
        raise RuntimeError("hook bug")

    hooks.add(broken)
    hooks.add(seen.append)
    site = f"test hook {broken.__qualname__}"
    before = internal_error_counts().get(site, 0)
    hooks.call(1)
    hooks.call(2)
    assert seen == [1, 2] and internal_error_counts()[site] == before + 2


def test_a_failing_hook_raises_in_the_test_suite():
    hooks = Hooks("test hook")
    hooks.add(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        hooks.call()


def test_only_a_handle_made_for_the_registry_is_attached():
    hooks, other = Hooks("test hook"), Hooks("other hook")
    with pytest.raises(ValueError, match=r"handle of <built-in function print> was made for another registry "
                                         r"than 'test hook'"):
        hooks.attach(HookHandle(other, print))
    assert not hooks.snapshot


def test_a_handle_does_not_keep_its_registry_alive():
    handle = Hooks("test hook").add(print)
    gc.collect()
    handle.remove()  # its registry is gone: nothing to do
    assert not handle.active


def test_a_failing_step_boundary_hook_never_breaks_the_step(production):
    tracker, seen = StepTracker(), []

    def broken():
        raise RuntimeError("boundary bug")

    tracker.at_boundary.add(broken)
    with tracker.at_boundary.add(lambda: seen.append(tracker.step)):
        tracker.begin(explicit=True)
        tracker.end(explicit=True)
    assert seen == [0, 1] and tracker.step == 1 and not tracker.in_step
    assert internal_error_counts()[f"step boundary hook {broken.__qualname__}"] >= 2
