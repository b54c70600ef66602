"""Training-step boundaries: explicit (``obs.step()``, ``obs.steps(loader)``) or detected (optimizer hooks).

Pure Python (no torch): the PyTorch adapter calls :meth:`StepTracker.auto_begin` /
:meth:`auto_end` from its optimizer and module hooks.  Once user code marks steps explicitly,
the detected boundaries are ignored so a step is never counted twice.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from obs._core.events import Event, bus
from obs._core.internal import report_internal_error

__all__ = ["MEMORY_INTERVAL_NS", "StepTracker", "step", "steps", "tracker"]

#: MEMORY is sampled at a step end at most this often: reading RSS or CUDA allocator statistics
#: costs 15-50 µs, a few percent of a millisecond step.
MEMORY_INTERVAL_NS = 50_000_000

T = TypeVar("T")


class StepTracker:
    """Counts steps and emits STEP_BEGIN / STEP_END."""

    __slots__ = ("step", "in_step", "explicit", "memory_probe", "_began_ns", "_memory_ns", "_lock")

    def __init__(self) -> None:
        self.step = 0  #: number of the current (or last) step, counting from 1
        self.in_step = False
        self.explicit = False
        #: set by a runtime adapter: returns memory statistics for the MEMORY event at step end
        self.memory_probe: Callable[[], dict[str, Any]] | None = None
        self._began_ns = 0
        self._memory_ns: int | None = None
        self._lock = threading.Lock()

    def begin(self, *, explicit: bool = False) -> None:
        with self._lock:
            if explicit:
                self.explicit = True
            if self.in_step:
                return
            self.in_step = True
            self.step += 1
            self._began_ns = time.perf_counter_ns()
            number = self.step
        bus.emit(Event.STEP_BEGIN, number)

    def end(self, *, explicit: bool = False) -> None:
        with self._lock:
            if not self.in_step:
                return
            self.in_step = False
            number, duration = self.step, time.perf_counter_ns() - self._began_ns
        bus.emit(Event.STEP_END, number, duration)
        probe, last, now = self.memory_probe, self._memory_ns, time.perf_counter_ns()
        due = last is None or now - last >= MEMORY_INTERVAL_NS
        if probe is not None and due and bus.has_subscribers(Event.MEMORY):
            self._memory_ns = now
            try:
                stats = probe()
            except Exception as exc:
                report_internal_error("memory probe", exc)
            else:
                bus.emit(Event.MEMORY, number, stats)

    def auto_begin(self) -> None:
        """A detected begin (first module call or optimizer pre-hook of a step)."""
        if not self.explicit and not self.in_step:
            self.begin()

    def auto_end(self) -> None:
        """A detected end (optimizer.step returned)."""
        if not self.explicit:
            self.end()

    def reset(self) -> None:
        with self._lock:
            self.step, self.in_step, self.explicit = 0, False, False
            self._memory_ns = None


tracker = StepTracker()


@contextlib.contextmanager
def step() -> Iterator[int]:
    """Mark one training step: ``with obs.step(): ...``; yields the step number."""
    tracker.begin(explicit=True)
    try:
        yield tracker.step
    finally:
        tracker.end(explicit=True)


def steps(iterable: Iterable[T]) -> Iterator[T]:
    """Yield the items of ``iterable`` (a DataLoader), each inside its own step."""
    for item in iterable:
        tracker.begin(explicit=True)
        try:
            yield item
        finally:
            tracker.end(explicit=True)
