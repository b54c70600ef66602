"""Device values read by the host without a host sync: a pinned copy, a marker, and a poller that waits for them.

One mechanism, three users: the dumps' per-step read-backs (the NaN check's gates, statistic.csv's statistics, tensor
files), ``obs.scalar``'s CUDA values, and the profiler's device time (its events, resolved off the training thread).

- :func:`pinned_copy` starts the copy of a tensor into pinned host memory (``non_blocking``: the CPU goes on at once).
- :func:`marker` records an event on a device's current stream: once it is done, so is everything queued before it,
  the copies included.  Events are ``blocking``: a thread that waits on one sleeps (GIL released) instead of spinning
  on a core the training loop may need.
- :class:`DeviceBatch` gathers 0-dim device tensors (reductions a dump made of its tensors) as a step runs, and 1-D
  ones (:meth:`DeviceBatch.add_vector`: the statistics a compiled graph computed of its tensors,
  :mod:`obs.runtime.torch._graph_taps`); :meth:`DeviceBatch.send` stacks them on their device as float64 and starts
  one copy and one marker per device (:class:`Sent`).
- :class:`Poller` runs ``then()`` on its own thread once a job's markers are done, in submission order.

Neither ``.item()`` nor a blocking copy on the training thread, so ``torch.cuda.set_sync_debug_mode("error")`` sees no
host synchronisation.  Any device works: on the CPU the "pinned buffer" is a copy made now and the marker is
:data:`DONE`, which is how the tests drive this without a GPU.  Work is assumed to be on each device's current stream
at :func:`marker` (autograd joins its backward streams to it); values a side stream made that the current one does
not wait for could be read before they are written.  Pure Python until a tensor is handed in: torch is imported
then, not here.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from obs._core.internal import report_internal_error, suppressed

if TYPE_CHECKING:
    import torch

    #: (device, dtype, whether its tensors are 1-D vectors): the tensors stacked (or concatenated) together
    _Key = tuple[torch.device, torch.dtype, bool]

__all__ = ["DONE", "DeviceBatch", "Poller", "Sent", "marker", "pinned_copy"]


class _Done:
    """The marker of work that is complete already (a CPU tensor's)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


DONE = _Done()


def marker(device: torch.device) -> Any:
    """Something whose ``query()`` / ``synchronize()`` tell when the work queued so far on ``device``'s current stream
    is done: a CUDA event recorded now, or :data:`DONE` for a device whose work is done when queued (the CPU)."""
    if device.type != "cuda":
        return DONE
    import torch

    # blocking: a thread that waits on it sleeps instead of spinning on a core the training loop may need
    event = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
    event.record(torch.cuda.current_stream(device))
    return event


def pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A host tensor that receives ``tensor``'s values as they are now, once the work queued on its device so far is
    done (read it after a :func:`marker` of that device recorded later is); a CPU tensor's values are copied now."""
    if tensor.device.type == "cpu":
        return tensor.clone()
    import torch

    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


class Sent:
    """One batch on its way to the host: ``done()`` without waiting, ``wait()`` (off the training thread), then
    ``values()``: one float per :meth:`DeviceBatch.add` (``n`` per :meth:`DeviceBatch.add_vector`), in that order."""

    def __init__(self, markers: list[Any], hosts: list[torch.Tensor], where: list[tuple[int, int, int]]) -> None:
        self.markers = markers
        self._hosts = hosts  # one float64 tensor per device
        self._where = where  # per add: (host index, position, how many values)

    def done(self) -> bool:
        return all(m.query() for m in self.markers)

    def wait(self) -> None:
        for m in self.markers:
            m.synchronize()

    def values(self) -> list[float]:
        """The values (call after :meth:`wait`, or once :meth:`done`)."""
        lists = [host.tolist() for host in self._hosts]
        out: list[float] = []
        for h, i, n in self._where:
            if n == 1:
                out.append(lists[h][i])
            else:
                out += lists[h][i:i + n]
        return out


class DeviceBatch:
    """0-dim tensors (and 1-D ones) added while a step runs (from any thread: autograd runs gradient hooks on its own),
    sent to the host together by :meth:`send`.  Each keeps its device and dtype; none is read before :meth:`send`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._groups: dict[_Key, list[torch.Tensor]] = {}
        self._where: list[tuple[_Key, int, int]] = []  # per add: its key, position in the key's values, how many
        self._sizes: dict[_Key, int] = {}  # values of each vector key so far
        self._size = 0  # values added

    def __len__(self) -> int:
        return self._size

    def add(self, value: torch.Tensor) -> int:
        """Keep ``value`` (0-dim, on its device) for the next :meth:`send`; returns its index in :meth:`Sent.values`."""
        key = (value.device, value.dtype, False)
        with self._lock:
            group = self._groups.get(key)
            if group is None:
                group = self._groups[key] = []
            group.append(value)
            self._where.append((key, len(group) - 1, 1))
            self._size += 1
            return self._size - 1

    def add_all(self, values: Sequence[torch.Tensor]) -> int:
        """:meth:`add` each of ``values``, consecutively; returns the index of the first."""
        with self._lock:
            first = self._size
            for value in values:
                key = (value.device, value.dtype, False)
                group = self._groups.get(key)
                if group is None:
                    group = self._groups[key] = []
                group.append(value)
                self._where.append((key, len(group) - 1, 1))
            self._size += len(values)
            return first

    def add_vector(self, values: torch.Tensor) -> int:
        """Keep the 1-D ``values`` (on its device; nothing may write them before :meth:`send` has) for the next
        :meth:`send`: ``len(values)`` consecutive values of :meth:`Sent.values`; returns the index of the first."""
        key, n = (values.device, values.dtype, True), len(values)
        with self._lock:
            group = self._groups.get(key)
            if group is None:
                group = self._groups[key] = []
            group.append(values)
            at = self._sizes.get(key, 0)
            self._sizes[key] = at + n
            self._where.append((key, at, n))
            self._size += n
            return self._size - n

    def send(self) -> Sent | None:
        """Start the copies of everything added (one per device) and empty the batch; None when it was empty."""
        with self._lock:
            groups, where, sizes = self._groups, self._where, self._sizes
            self._groups, self._where, self._sizes, self._size = {}, [], {}, 0
        if not where:
            return None
        import torch

        devices: dict[torch.device, list[_Key]] = {}
        for key in groups:
            devices.setdefault(key[0], []).append(key)
        markers, hosts, offsets = [], [], {}
        with suppressed():  # obs's own ops: no hook of obs sees them
            for index, (device, keys) in enumerate(devices.items()):
                parts, at = [], 0
                for key in keys:
                    offsets[key] = (index, at)
                    if key[2]:
                        at += sizes[key]
                        parts.append(torch.cat(groups[key]).to(torch.float64))
                    else:
                        at += len(groups[key])
                        parts.append(torch.stack(groups[key]).to(torch.float64))
                hosts.append(pinned_copy(parts[0] if len(parts) == 1 else torch.cat(parts)))
                markers.append(marker(device))
        return Sent(markers, hosts, [(offsets[key][0], offsets[key][1] + i, n) for key, i, n in where])


class Poller:
    """Jobs ``(markers, then)`` run in order on one thread (named ``obs-{name}``) once their markers are done.

    The thread waits with ``synchronize()`` on each marker (on :func:`marker`'s blocking events it sleeps, GIL
    released), starts with the first job and stops at :meth:`close`.  :meth:`drain` waits for every job submitted so
    far (a feature's ``remove``, process exit, tests).  A job that fails is reported
    (:func:`obs._core.internal.report_internal_error`); where that raises (the tests), the error is kept and raised by
    the next :meth:`drain` on the caller's thread."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: deque[tuple[Sequence[Any], Callable[[], None]]] = deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._running = 0  # jobs taken by the thread and not finished
        self._stop = False
        self._error: BaseException | None = None
        self._waiting = False  # the thread waits for a job's markers
        self.completed = 0  # jobs done so far (the tests read it)

    @property
    def pending(self) -> int:
        """Jobs submitted and not finished."""
        with self._cond:
            return len(self._jobs) + self._running

    def submit(self, markers: Sequence[Any], then: Callable[[], None]) -> None:
        """Run ``then()`` on the poller's thread once every marker of ``markers`` is done."""
        with self._cond:
            self._jobs.append((markers, then))
            if self._thread is None or not self._thread.is_alive():
                self._stop = False
                self._thread = threading.Thread(target=self._run, name=f"obs-{self.name}", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every job submitted so far is done (False when ``timeout`` seconds passed first); raise the
        error of a job that failed where internal errors are raised."""
        with self._cond:
            done = self._cond.wait_for(lambda: not self._jobs and not self._running, timeout)
            error, self._error = self._error, None
        if error is not None:
            raise error
        return done

    def close(self, timeout: float | None = 30.0) -> None:
        """:meth:`drain`, then stop the thread, within ``timeout`` seconds: the jobs not begun by then are dropped (a
        device that has not run their work by then is not waited for); a job past its markers is let finish."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            self.drain(timeout)
        finally:
            with self._cond:
                self._jobs.clear()
                self._stop = True
                self._cond.notify_all()
                thread, self._thread = self._thread, None
            if thread is not None and thread is not threading.current_thread():
                thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
                if thread.is_alive() and not self._waiting:  # in a job's own work, not waiting for a device
                    thread.join()

    def abandon(self) -> None:
        """In a forked child: forget the parent's jobs and thread (they are not this process's), touching no device."""
        self._jobs, self._cond, self._thread = deque(), threading.Condition(), None
        self._running, self._stop, self._error, self._waiting = 0, False, None, False

    def _run(self) -> None:
        me = threading.current_thread()
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._jobs or self._stop or self._thread is not me)
                if not self._jobs or self._thread is not me:
                    return  # stopped (a thread close gave up on has no more jobs, even when another has begun)
                markers, then = self._jobs.popleft()
                self._running += 1
                self._waiting = True
            try:
                for m in markers:
                    m.synchronize()  # this thread waits, with the GIL released
                self._waiting = False
                then()
            except Exception as exc:  # noqa: BLE001 - reported; the next jobs still run
                try:
                    report_internal_error(f"{self.name} job", exc)
                except Exception as kept:  # noqa: BLE001 - raised where internal errors are: for drain() to raise
                    with self._cond:
                        self._error = self._error or kept
            finally:
                self._waiting = False
                with self._cond:
                    self._running -= 1
                    self.completed += 1
                    self._cond.notify_all()
