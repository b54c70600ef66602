"""Loads the PyTorch adapter the first time something needs what only it can detect.

That is a subscriber to an event only the adapter publishes, or a feature that declared it
needs step numbers (:meth:`obs.runtime.steps.StepTracker.require`, e.g. Print to file).
"""

from __future__ import annotations

import sys

from obs._core.events import Event, bus
from obs.runtime import torch_support
from obs.runtime.steps import tracker

__all__ = ["TORCH_EVENTS", "install"]

TORCH_EVENTS = frozenset({Event.STEP_BEGIN, Event.STEP_END, Event.MODULE_ENTER, Event.MODULE_EXIT, Event.OP,
                          Event.MEMORY, Event.COLLECTIVE, Event.PHASE,
                          Event.OP_OUTPUT, Event.COMPILE_RECORD, Event.GRAPH_STATS})


def _load_adapter() -> None:
    if "obs.runtime.torch" not in sys.modules and torch_support.importable():
        import obs.runtime.torch  # noqa: F401  (the adapter syncs itself with the bus and the tracker on import)


def _on_change(event: Event) -> None:
    if event in TORCH_EVENTS and bus.has_subscribers(event):
        _load_adapter()


def _on_demand() -> None:
    if tracker.wanted:
        _load_adapter()


def install() -> None:
    bus.watch(_on_change)
    tracker.watch(_on_demand)
