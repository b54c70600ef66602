"""Loads the PyTorch adapter the first time someone subscribes to an event only it can publish."""

from __future__ import annotations

import importlib.util
import sys

from obs._core.events import Event, bus

__all__ = ["TORCH_EVENTS", "install"]

TORCH_EVENTS = frozenset({Event.STEP_BEGIN, Event.STEP_END, Event.MODULE_ENTER, Event.MODULE_EXIT, Event.OP,
                          Event.MEMORY, Event.COLLECTIVE})


def _on_change(event: Event) -> None:
    if event in TORCH_EVENTS and bus.has_subscribers(event) and "obs.runtime.torch" not in sys.modules:
        if importlib.util.find_spec("torch") is not None:
            import obs.runtime.torch  # noqa: F401  (the adapter syncs itself with the bus on import)


def install() -> None:
    bus.watch(_on_change)
