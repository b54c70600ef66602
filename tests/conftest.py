"""Autouse guards: reset global state, make internal errors loud, catch leaked threads."""

from __future__ import annotations

import signal
import threading

import pytest

import obs
from obs._core.internal import set_raise_internal_errors
from obs.runtime.steps import tracker


def pytest_configure():
    # A suite started in the background by a shell without job control (`(cmd &)` in a script) inherits SIGINT
    # ignored, and an ignored signal stays ignored across exec: the signal tests' children, and their "as
    # without obs" baselines, would never see it. Give the suite the handler an interactive start has.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _reset_obs():
    """Every test starts and ends with default settings, no subscriptions and no open step."""
    old = set_raise_internal_errors(True)
    obs.reset_context()
    obs.reset_auto_parallel_context()
    obs.reset_ps_context()
    tracker.reset()
    yield
    obs.reset_context()
    obs.bus.clear()
    tracker.reset()
    set_raise_internal_errors(old)


@pytest.fixture(autouse=True)
def _no_thread_leaks():
    """A test must stop every thread it started (watchers, workers)."""
    before = {t.ident for t in threading.enumerate()}
    yield
    obs.reset_context()
    leaked = [t for t in threading.enumerate() if t.ident not in before and t.is_alive() and not t.daemon
              or t.name.startswith("obs-") and t.ident not in before and t.is_alive()]
    assert not leaked, f"threads left running: {leaked}"
