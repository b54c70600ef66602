"""Kernel spans for chosen steps: torch.profiler's CUDA activities (CUPTI, through Kineto) in an ``op_trace`` window.

While a capture window at ``op_trace`` covers a step on CUDA, Kineto records every kernel, memcpy and memset the
device runs.  The capture starts at the window's first step boundary.  At its end an event is recorded on the
current stream (the device timer's poller sees it complete), and Kineto is stopped at the first step boundary after
that: the window's kernels are all done by then, so no ``torch.cuda.synchronize`` is needed (``torch.profiler``'s
own stop synchronizes: this uses the autograd profiler's enable and disable beneath it).  The results are read on a
thread (``obs-kernel-spans``), each kernel given the step whose host time its launch (the CUDA runtime call of the
same correlation id) fell in, and written as DEVICE_TIME slots of target KERNEL between a KERNELS_BEGIN and a
KERNELS_END (``recorder.ring``).

Kineto serves one profiler at a time: where the user's own ``torch.profiler`` runs (or Kineto cannot start) the
window has no kernel spans, said once in the log.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from obs._core.internal import report_internal_error
from recorder.layout import DeviceTarget

__all__ = ["KernelCapture", "MAX_KERNELS"]

logger = logging.getLogger("obs")

#: kernel slots written per capture at most (the rest counted in KERNELS_END's ``a``): the ring is the buffer
MAX_KERNELS = 16384
_NAME_CHARS = 1024  # kernel names (C++ templates) are cut to this many characters
_NOT_KERNELS = frozenset({"cuda_sync", "gpu_user_annotation", "overhead"})  # on the device's timeline, not work
_said: set[str] = set()

Write = Callable[[int, Any, int, int, int], None]


class KernelCapture:
    """One capture: :meth:`start` at the window's first step boundary, :meth:`step_begins` per step, :meth:`finish`
    after its last, :meth:`poll` at each boundary after that until it returns True; :meth:`close` at the session's
    end.  ``when_done(callback)`` calls back once the device has run what the stream holds (the device timer's
    :meth:`~obs.runtime.device_time.DeviceTimer.when_done`); ``backend`` is Kineto's enable / disable (a fake in
    the tests)."""

    def __init__(self, write: Write, when_done: Callable[[Callable[[], None]], None], backend: Any = None) -> None:
        self._write, self._when_done = write, when_done
        self._backend = backend if backend is not None else _Kineto()
        self.first = self.last = 0
        self._begins: list[tuple[int, int]] = []  # (wall ns, step) of each step begin in the window
        self.finished = False  # the window's last step ended
        self.ran = False  # the device has run it (set from the poller's thread)
        self.running = False
        self.thread: threading.Thread | None = None

    def start(self, first: int) -> bool:
        """Start Kineto for the window beginning with step ``first`` (on the training thread, at a boundary)."""
        try:
            self._backend.start()
        except Exception as exc:  # noqa: BLE001 - another profiler runs, or no CUPTI: no kernel spans, said once
            _say_once("start", f"obs profiler: no kernel spans for the op_trace window at step {first}: torch.profiler "
                               f"could not start ({type(exc).__name__}: {exc})")
            return False
        self.first = self.last = first
        self.running = True
        self._write(DeviceTarget.KERNELS_BEGIN, 0, first, first, 0)
        return True

    def step_begins(self, step: int) -> None:
        if not self.finished:
            self._begins.append((time.time_ns(), step))  # Kineto's times are the wall clock's

    def finish(self, last: int) -> None:
        """The window's last step ended: mark the stream (its kernels are done once the mark is)."""
        self.last, self.finished = last, True
        self._begins.append((time.time_ns(), last + 1))  # launches from here on are after the window
        self._when_done(self._ran)

    def _ran(self) -> None:
        self.ran = True

    def poll(self) -> bool:
        """At a step boundary: once the device has run the window, stop Kineto and read its results on a thread;
        True once stopped."""
        if self.running and self.ran:
            self._stop()
        return not self.running

    def _stop(self) -> None:
        self.running = False
        try:
            result = self._backend.stop()
        except Exception as exc:  # noqa: BLE001 - reported; the window's spans go without kernels
            report_internal_error("kernel capture stop", exc)
            self._write(DeviceTarget.KERNELS_END, 0, self.last, self.first, -1)
            return
        self.thread = threading.Thread(target=self._read, args=(result,), name="obs-kernel-spans", daemon=True)
        self.thread.start()

    def close(self, wait_s: float = 5.0) -> None:
        """The session ends: a capture still running is stopped now (kernels not done yet are missing)."""
        if self.running:
            self._stop()
        thread, self.thread = self.thread, None
        if thread is not None:
            thread.join(wait_s)

    def _read(self, result: Any) -> None:
        try:
            written, left = self.write_kernels(result)
        except Exception as exc:  # noqa: BLE001 - reported; the window's spans go without kernels
            report_internal_error("kernel spans", exc)
            written, left = -1, 0
        self._write(DeviceTarget.KERNELS_END, left, self.last, self.first, written)

    def write_kernels(self, result: Any) -> tuple[int, int]:
        """One KERNEL slot per device activity of ``result`` launched in the window's steps; (written, left out)."""
        import torch

        cuda = torch._C._autograd.DeviceType.CUDA
        launches: dict[int, int] = {}
        device = []
        for e in result.events():
            if e.device_type() == cuda:
                kind = getattr(e, "activity_type", None)
                if kind is None or kind() not in _NOT_KERNELS:
                    device.append(e)
            else:  # with the CUDA activities only, the host events are the runtime's (cudaLaunchKernel, ...)
                launches[e.correlation_id()] = e.start_ns()
        times = [t for t, _ in self._begins]
        written = left = 0
        for e in device:
            start = e.start_ns()
            at = bisect.bisect_right(times, launches.get(e.correlation_id(), start)) - 1
            if at < 0 or not self.first <= self._begins[at][1] <= self.last:
                continue
            if written >= MAX_KERNELS:
                left += 1
                continue
            self._write(DeviceTarget.KERNEL, e.name()[:_NAME_CHARS], self._begins[at][1], start, e.duration_ns())
            written += 1
        return written, left


class _Kineto:
    """torch.profiler's Kineto with the CUDA activities, started and stopped without a device synchronize."""

    def __init__(self) -> None:
        self._profile: Any = None

    def start(self) -> None:
        import torch

        profile: Any = torch.autograd.profiler.profile(use_cpu=False, use_device="cuda", use_kineto=True)
        profile._prepare_trace()
        profile._start_trace()
        self._profile = profile

    def stop(self) -> Any:
        import torch

        self._profile = None
        result = torch._C._autograd._disable_profiler()
        stopped = getattr(torch.autograd.profiler, "_run_on_profiler_stop", None)  # what profile.__exit__ runs
        if stopped is not None:
            stopped()
        return result


def _say_once(key: str, message: str) -> None:
    if key not in _said:
        _said.add(key)
        logger.warning("%s", message)
