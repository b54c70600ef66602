"""Device time: CUDA events around steps, phases, modules and collectives, resolved off the training thread.

Pure Python (no torch): events come from ``factory`` (the profiler passes ``torch.cuda.Event(enable_timing=True,
blocking=True)``, the tests a fake) and need ``record()`` (on the current stream), ``query()``, ``synchronize()`` and
``elapsed_time(other)`` (ms).

- On the thread that runs the span (the training thread, autograd's, a collective's caller): an event is recorded
  where the span begins and one where it ends, on the current stream; the pair joins a queue.  Nothing here waits
  for the device, and nothing is resolved on that thread.
- Each step records a reference event (``ref``) at its begin.  Every pair of the step is written relative to it, and
  the step itself with the device time since the previous step's ref, so a reader can lay the steps end to end.
- Phases are marks: each phase end records one event; a phase runs on the device from the mark before it (the ref,
  or the end of the phase before) to its own: device work enqueued between two phases counts to the later one.
- Events come from a bounded pool and go back once their pair is resolved.  With the pool empty a span is not
  timed, and its step counts it (``a`` of the step's record).
- The device read-back's poller (:class:`obs.runtime.device_readback.Poller`, thread ``obs-device-time``) waits,
  off the training thread, for each step's end event (and a late phase's, and :meth:`DeviceTimer.when_done`'s),
  then takes the queue in order: a pair whose end event has completed (``query()``) is measured with
  ``elapsed_time`` (no sync: both events are done) and handed to ``write``; the first one not done stops the pass
  (on one stream the later ones are not done either).  It takes ``batch`` pairs at a time, letting the training
  thread have the GIL in between.

``write(target, a, b, c, d)`` gets a :class:`recorder.layout.DeviceTarget`, and the fields of a DEVICE_TIME slot as
``recorder.ring`` describes them (``a`` may be a str, for the writer to intern).  :data:`current` is the timer in
force: the collectives' wrappers (``obs.runtime.torch._collectives``) read it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from obs.runtime.device_readback import Poller
from recorder.layout import DeviceTarget

__all__ = ["DeviceTimer", "EventPool", "current"]

#: the timer in force (the profiler's, while it times on the device), or None
current: DeviceTimer | None = None

_STEP, _PHASE = DeviceTarget.STEP, DeviceTarget.PHASE


class EventPool:
    """At most ``capacity`` events, made on demand and reused: :meth:`take` (None when all are in use), :meth:`give`."""

    def __init__(self, factory: Callable[[], Any], capacity: int) -> None:
        self._factory, self.capacity = factory, capacity
        self._free: list[Any] = []
        self._lock = threading.Lock()  # only where one is made: taking and giving are single list operations
        self.created = 0

    def take(self) -> Any:
        free = self._free
        if free:
            try:
                return free.pop()
            except IndexError:  # another thread took the last one
                pass
        with self._lock:
            if self.created >= self.capacity:
                return None
            self.created += 1
        return self._factory()

    def give(self, event: Any) -> None:
        self._free.append(event)

    @property
    def free(self) -> int:
        return len(self._free)


class _Item:
    """One entry of the queue: a pair to measure (``target`` not 0), the events to give back once it is done, and
    what to call then."""

    __slots__ = ("target", "a", "b", "ref", "start", "end", "release", "then")

    def __init__(self, target: int, a: Any, b: int, ref: Any, start: Any, end: Any, release: tuple[Any, ...],
                 then: Callable[[], None] | None = None) -> None:
        self.target, self.a, self.b, self.ref, self.start, self.end = target, a, b, ref, start, end
        self.release, self.then = release, then


class DeviceTimer:
    """Times steps, phases and spans on the device; see the module's docstring.

    ``capturing()`` says whether the current stream is being captured into a CUDA graph (nothing is recorded
    then).  ``flush_s``: a step's own record waits this long after its end for a phase that ends after the step
    (the optimizer hooks end a detected step before the optimizer phase).  ``start=False``: no poller (the tests call
    :meth:`resolve` themselves)."""

    def __init__(self, write: Callable[[int, Any, int, int, int], None], factory: Callable[[], Any], *,
                 capacity: int = 4096, batch: int = 64, capturing: Callable[[], bool] | None = None,
                 flush_s: float = 0.02, start: bool = True) -> None:
        self.pool = EventPool(factory, capacity)
        self._write = write
        self.batch, self.flush_s = batch, flush_s
        self._capturing = capturing or (lambda: False)
        self._queue: deque[_Item] = deque()
        #: the step record waiting for a late phase (training thread and poller); notified when it is queued
        self._lock = threading.Condition()
        self._pending: _Item | None = None
        self._pending_at = 0.0
        self._open = False  #: inside a step: spans are timed
        self._step = 0
        self._ref: Any = None  # this (or the last) step's reference event
        self._mark: Any = None  # the last phase mark of the step (the ref at its begin)
        self._prev: Any = None  # the step before's ref, while the steps are consecutive
        self._skipped = 0  # spans of this step not timed: the pool was empty
        self.skipped = 0  #: spans not timed in all, the pool being empty
        self.written = 0  #: records handed to ``write``
        self.poller = Poller("device-time") if start else None

    # -- the training thread (and any thread running a span) -----------------------------------------------------
    def begin(self) -> Any:
        """Record a span's start event; None (nothing to end) outside a step, in a CUDA graph capture or with the pool
        empty (counted)."""
        if not self._open or self._ref is None or self._capturing():
            return None
        event = self.pool.take()
        if event is None:
            self._skipped += 1
            self.skipped += 1
            return None
        event.record()
        return event

    def end(self, start: Any, target: int, a: Any, b: int) -> None:
        """Record the end event of the span ``start`` began and queue the pair (``a``, ``b``: the record's fields)."""
        if start is None:
            return
        end, ref = self.pool.take(), self._ref
        if end is None or ref is None:
            self.pool.give(start)  # recorded, but nothing will read it: recording it again later is fine
            if end is None:
                self._skipped += 1
                self.skipped += 1
            return
        end.record()
        self._queue.append(_Item(target, a, b, ref, start, end, (start, end)))

    def cancel(self, start: Any) -> None:
        """A span that began and will not end (its call raised): its event goes back."""
        if start is not None:
            self.pool.give(start)

    def step_begins(self, step: int) -> None:
        """Record the step's reference event (call it after the STEP_BEGIN slot is written: the device reaches the
        event after the host wrote the slot, which is what lets a reader place the device's times)."""
        if self._open:  # the step before never ended (the session began timing inside it)
            self.step_ends(self._step)
        with self._lock:
            self._flush()
        old, mark, last = self._ref, self._mark, self._step
        ref = None if self._capturing() else self.pool.take()
        if ref is not None:
            ref.record()
        chained = ref is not None and old is not None and step == last + 1
        leftover = tuple(e for e in (mark if mark is not old else None, None if chained else old) if e is not None)
        if leftover:
            self._queue.append(_Item(0, 0, 0, None, None, None, leftover))
        self._prev = old if chained else None
        self._ref = self._mark = ref
        self._step, self._open, self._skipped = step, True, 0 if ref is not None else 1
        if ref is None:
            self.skipped += 1

    def mark(self, a: Any, b: int) -> None:
        """A phase ended (``a`` its code, ``b`` its PHASE slot's seq): it ran on the device from the mark before."""
        ref = self._ref
        if ref is None or self._capturing():
            return
        event = self.pool.take()
        if event is None:
            self._skipped += 1
            self.skipped += 1
            start, self._mark = self._mark, None  # the next phase has no start: it goes untimed too
            if start is not None and start is not ref:
                self._queue.append(_Item(0, 0, 0, None, None, None, (start,)))
        else:
            event.record()
            start, self._mark = self._mark, event
            if start is not None:
                self._queue.append(_Item(_PHASE, a, b, ref, start, event, () if start is ref else (start,)))
        if self._pending is not None:  # a phase that ended after its step (detected steps: the optimizer)
            with self._lock:
                self._flush()
            self._resolve_after(event)

    def step_ends(self, step: int) -> None:
        """Record the step's end event; its record is queued at the next call (or ``flush_s`` later, by the poller)."""
        if not self._open:
            return
        self._open = False
        end = self.pool.take() if self._ref is not None else None
        if end is not None:
            end.record()
        release = tuple(e for e in (self._prev, end) if e is not None)
        item = _Item(_STEP, self._skipped, step, self._prev, self._ref, end, release)
        self._prev = None  # given to the record
        with self._lock:
            self._flush()
            self._pending, self._pending_at = item, time.monotonic()
        self._resolve_after(end)

    def when_done(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (on the poller's thread) once the device has run what the current stream holds now."""
        event = self.pool.take()
        pooled = event is not None
        if event is None:  # not a span's time: an event beyond the pool's bound, just for this
            event = self.pool._factory()
        event.record()
        self._queue.append(_Item(0, 0, 0, None, None, event, (event,) if pooled else (), callback))
        self._resolve_after(event)

    def _flush(self) -> None:
        """Queue the step record waiting for a late phase (hold ``_lock``)."""
        item, self._pending = self._pending, None
        if item is not None:
            self._queue.append(item)
            self._lock.notify_all()

    def _resolve_after(self, event: Any) -> None:
        """Have the poller resolve the queue once the device has run ``event`` (None: what is done now)."""
        if self.poller is not None:
            self.poller.submit(() if event is None else (event,), self._settle)

    # -- the poller thread -------------------------------------------------------------------------------------------
    def resolve(self, limit: int | None = None) -> int:
        """Write the records of the queued pairs that are done, in order (at most ``limit``); how many were taken."""
        queue, done = self._queue, 0
        while queue and (limit is None or done < limit):
            item = queue[0]
            last = item.end if item.end is not None else item.start
            if last is not None and not last.query():
                break
            queue.popleft()
            done += 1
            try:
                if item.target:
                    self._write(item.target, item.a, item.b, _elapsed(item.ref, item.start),
                                _elapsed(item.start, item.end))
                    self.written += 1
            finally:
                give = self.pool.give
                for event in item.release:
                    give(event)
            if item.then is not None:
                item.then()
        return done

    def _settle(self) -> None:
        """A poller job, once the device has run what it waited for: the step record waiting for a late phase is
        queued (at once where one came, else ``flush_s`` after the step's end), then every pair done is written."""
        with self._lock:
            item = self._pending
            if item is not None:
                left = self._pending_at + self.flush_s - time.monotonic()
                self._lock.wait_for(lambda: self._pending is not item, left)
                if self._pending is item:
                    self._flush()
        while self.resolve(self.batch) == self.batch:
            time.sleep(0)  # a full batch: the training thread gets the GIL before the next one

    # -- lifecycle --------------------------------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        """Queued entries not resolved yet."""
        return len(self._queue) + (self._pending is not None)

    def close(self, wait_s: float = 1.0) -> None:
        """Stop timing; the poller writes what the device completes within ``wait_s``, then ends.  What is still
        queued then is dropped."""
        if self._open:
            self.step_ends(self._step)
        with self._lock:
            self._flush()
        held = tuple(e for e in (self._mark if self._mark is not self._ref else None, self._ref, self._prev)
                     if e is not None)
        if held:
            self._queue.append(_Item(0, 0, 0, None, None, None, held))
        self._ref = self._mark = self._prev = None
        if self.poller is not None:
            self._resolve_after(None)  # after every job before it: the events held above go back
            self.poller.close(wait_s)
        self._queue.clear()

    def abandon(self) -> None:
        """In a forked child: forget the parent's events, queue and poller (touching no device)."""
        self._open = False
        if self.poller is not None:
            self.poller.abandon()
        self._lock = threading.Condition()
        self._queue.clear()
        self._pending = self._ref = self._mark = self._prev = None


def _elapsed(first: Any, second: Any) -> int:
    """ns from ``first`` to ``second`` as the device measured it; -1 where either is missing or it cannot say."""
    if first is None or second is None:
        return -1
    try:
        ms: float = first.elapsed_time(second)
        return round(ms * 1e6)
    except (RuntimeError, ValueError):  # another device's event, or one never recorded
        return -1
