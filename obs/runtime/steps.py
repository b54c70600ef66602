"""Training-step boundaries: explicit (``obs.step()``, ``obs.steps(loader)``) or detected (optimizer hooks).

Pure Python (no torch): the PyTorch adapter calls :meth:`StepTracker.auto_begin` /
:meth:`auto_end` from its optimizer and module hooks.  Once user code marks steps explicitly,
the detected boundaries are ignored so a step is never counted twice.

A step is a *training* step: it ends when ``optimizer.step()`` returns, and a forward under
``torch.no_grad()`` / ``torch.inference_mode()`` between steps (evaluation) opens none; what it
records carries the current (last) step's number.

Steps are detected while someone needs them: a subscriber of STEP_BEGIN / STEP_END / MEMORY,
or a feature that stamps records with ``tracker.step`` without subscribing (Print to file)
and says so with :meth:`StepTracker.require`.  With neither, nothing is installed.

Where a step begins depends on what is installed: with module events (or a compiled graph), at
its first forward; with the optimizer hooks alone (Print to file, RDR ``step`` granularity), at
``optimizer.step()``, unless a record made inside a module call with grad enabled begins it first
(``obs.Print`` does: see :meth:`StepTracker.auto_begin`), so a Print in step N's forward says N.
``obs.steps(loader)`` / ``with obs.step():`` mark exact boundaries.

MEMORY is sent at every step end by default (on the CPU the process's size, read at most every 10 ms by
:mod:`obs.runtime.resident`; on CUDA the allocator's counters); :data:`MEMORY_INTERVAL_NS` spaces the events.  Its
stats dict may be shared between step ends: handlers read it, never change it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from obs._core.events import Event, bus
from obs._core.hooks import HookHandle, Hooks
from obs._core.internal import report_internal_error

__all__ = ["MEMORY_INTERVAL_NS", "STEP_EVENTS", "StepDemand", "StepTracker", "step", "steps", "tracker"]

#: MEMORY is read at a step end when this long has passed since the last reading; 0 (the default): at every
#: step end.  Read at each step end, so setting ``obs.runtime.steps.MEMORY_INTERVAL_NS`` takes effect at once.
MEMORY_INTERVAL_NS = 0

#: the events whose subscribers make the runtime adapter detect steps
STEP_EVENTS = (Event.STEP_BEGIN, Event.STEP_END, Event.MEMORY)

T = TypeVar("T")


class StepDemand(HookHandle[str]):
    """One feature's need for step numbers; ``remove()`` (idempotent) or leave the ``with`` block to drop it."""

    __slots__ = ()

    @property
    def reason(self) -> str:
        return self.hook

    def __repr__(self) -> str:
        return f"StepDemand({self.reason!r}, active={self.active})"


class StepTracker:
    """Counts steps and emits STEP_BEGIN / STEP_END."""

    __slots__ = ("step", "in_step", "explicit", "memory_probe", "_began_ns", "_memory_ns", "_lock", "_demands",
                 "_watchers", "at_boundary")

    def __init__(self) -> None:
        self.step = 0  #: number of the current (or last) step, counting from 1
        self.in_step = False
        self.explicit = False
        #: set by a runtime adapter: returns memory statistics for the MEMORY event at step end
        self.memory_probe: Callable[[], dict[str, Any]] | None = None
        #: called on the training thread between steps (before a step begins, after one ended):
        #: where staged changes are applied (a hot-reloaded recorder swap, the rank's folder)
        self.at_boundary: Hooks[Callable[[], None]] = Hooks("step boundary hook")
        self._began_ns = 0
        self._memory_ns: int | None = None
        self._lock = threading.Lock()
        self._watchers: Hooks[Callable[[], None]] = Hooks("step demand watcher")
        self._demands: Hooks[str] = Hooks("step demand", on_change=self._watchers.call)

    # -- who needs steps ----------------------------------------------------------------------
    def require(self, reason: str) -> StepDemand:
        """Declare that a feature stamps records with :attr:`step` (e.g. ``"Print to file"``).

        While any demand is held, the runtime adapter detects steps even with no STEP subscriber.
        """
        if not isinstance(reason, str) or not reason:
            raise TypeError(f"reason must be a non-empty str naming the feature (got {reason!r})")
        return self._demands.attach(StepDemand(self._demands, reason))

    @property
    def demands(self) -> tuple[str, ...]:
        """The reasons of the demands held now."""
        return self._demands.snapshot

    @property
    def wanted(self) -> bool:
        """True while some feature declared it needs step numbers (see :meth:`require`)."""
        return bool(self._demands.snapshot)

    @property
    def detecting(self) -> bool:
        """True while steps are detected: a feature's demand (:attr:`wanted`) or a STEP_BEGIN / STEP_END / MEMORY
        subscriber."""
        return bool(self._demands.snapshot) or any(bus.has_subscribers(e) for e in STEP_EVENTS)

    def watch(self, watcher: Callable[[], None]) -> Callable[[], None]:
        """Call ``watcher()`` whenever the demands change; returns an undo."""
        return self._watchers.add(watcher).remove

    # -- boundaries ---------------------------------------------------------------------------

    def begin(self, *, explicit: bool = False) -> None:
        with self._lock:
            if explicit:
                self.explicit = True
            if self.in_step:
                return
        if self.at_boundary.snapshot:
            self.at_boundary.call()
        with self._lock:
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
        probe, interval = self.memory_probe, MEMORY_INTERVAL_NS
        if probe is not None and bus.has_subscribers(Event.MEMORY) and (interval <= 0 or self._memory_due(interval)):
            try:
                stats = probe()
            except Exception as exc:  # noqa: BLE001 - reported; a hook's bug must not break the training loop
                report_internal_error("memory probe", exc)
            else:
                bus.emit(Event.MEMORY, number, stats)
        if self.at_boundary.snapshot:
            self.at_boundary.call()

    def _memory_due(self, interval: int) -> bool:
        last, now = self._memory_ns, time.perf_counter_ns()
        if last is not None and now - last < interval:
            return False
        self._memory_ns = now
        return True

    def auto_begin(self) -> None:
        """A detected begin: the optimizer pre-hook, the first module / compiled-graph call with grad enabled, or a
        record made inside a module call with grad enabled (``obs.Print``, where no module hook is installed)."""
        if not self.explicit and not self.in_step:
            self.begin()

    def auto_end(self) -> None:
        """A detected end (optimizer.step returned)."""
        if not self.explicit:
            self.end()

    def reset(self) -> None:
        """Back to step 0 outside any step; demands and watchers are kept (their owners drop them)."""
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
    """Yield the items of ``iterable`` (a DataLoader), each inside its own step.

    The wait for each item is the step's ``data`` phase (a PHASE event, when someone subscribes)."""
    items, clock = iter(iterable), time.perf_counter_ns
    while True:
        began = clock()
        try:
            item = next(items)
        except StopIteration:
            return
        waited = clock()
        tracker.begin(explicit=True)
        if bus.has_subscribers(Event.PHASE):
            bus.emit(Event.PHASE, "data", began, waited)
        try:
            yield item
        finally:
            tracker.end(explicit=True)
