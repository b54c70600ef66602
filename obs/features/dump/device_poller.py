"""A thread that waits for device work instead of the training thread, then runs what reads its results.

``submit(markers, then)``: once every marker (:func:`obs.features.dump.device_batch.marker`) is done, ``then()``
runs on the poller's thread, in submission order.  The thread waits with ``event.synchronize()`` on events made
``blocking`` (it sleeps, with the GIL released), so the training thread never waits for a device and the waiting
costs no core.  It starts with the first job and stops at :meth:`Poller.close`.

:meth:`Poller.drain` waits for every job submitted so far (a feature's ``remove``, process exit, tests).  A job that
fails is reported (:func:`obs._core.internal.report_internal_error`); where that raises (the tests), the error is
kept and raised by the next :meth:`Poller.drain` on the caller's thread.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from obs._core.internal import report_internal_error

__all__ = ["Poller"]


class Poller:
    """Jobs ``(markers, then)`` run in order on one thread (named ``obs-{name}``) once their markers are done."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: deque[tuple[Sequence[Any], Callable[[], None]]] = deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._running = 0  # jobs taken by the thread and not finished
        self._stop = False
        self._error: BaseException | None = None
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
        """:meth:`drain`, then stop the thread."""
        try:
            self.drain(timeout)
        finally:
            with self._cond:
                self._stop = True
                self._cond.notify_all()
                thread, self._thread = self._thread, None
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._jobs or self._stop)
                if not self._jobs:
                    return  # stopped, nothing left
                markers, then = self._jobs.popleft()
                self._running += 1
            try:
                for m in markers:
                    m.synchronize()  # this thread waits, with the GIL released
                then()
            except Exception as exc:  # noqa: BLE001 - reported; the next jobs still run
                try:
                    report_internal_error(f"{self.name} job", exc)
                except Exception as kept:  # noqa: BLE001 - raised where internal errors are: for drain() to raise
                    with self._cond:
                        self._error = self._error or kept
            finally:
                with self._cond:
                    self._running -= 1
                    self.completed += 1
                    self._cond.notify_all()
