"""The profiler's device time: its ring's DEVICE_TIME and MEMORY_PEAK slots, while the model runs on CUDA.

A session times on the device once CUDA is in use in the process (``torch.cuda.is_initialized()``, read at step
boundaries until it is: a CPU-only build of torch is never asked).  From then on (:meth:`DeviceRecording.activate`):

- an :class:`obs.runtime.device_time.DeviceTimer` with a pool of ``torch.cuda.Event(enable_timing=True)``, writing
  DEVICE_TIME slots into the ring's ``device`` ring from its poller thread; it is
  :data:`obs.runtime.device_time.current`, so the collectives' wrappers time blocking collectives with it;
- the session's step and phase handlers record the step's reference and the phase marks, its module handlers time
  module calls (:func:`recorder.ring_handlers.timed_module_handlers`);
- at each step end, the step's peaks (CUDA's allocated and reserved, from the MEMORY reading) as a MEMORY_PEAK slot;
- an ``op_trace`` window also captures the kernels of its steps (:mod:`obs.features.profiling.kernels`).

On CPU none of this exists: the session's handlers test one attribute for None.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

from obs._core.events import Event
from obs.features.profiling.kernels import KernelCapture
from obs.runtime import device_time, torch_support
from recorder.layout import Kind
from recorder.ring import RingWriter
from recorder.ring_handlers import RingSubscriptions

__all__ = ["DEVICE_SLOTS", "DeviceRecording", "cuda_build", "cuda_events", "cuda_in_use"]

#: slots of the profile ring's ``device`` ring where CUDA may be used (the exporter reads it every 0.1 s)
DEVICE_SLOTS = 65536


def cuda_build() -> bool:
    """torch is installed and built with CUDA (imported if it was not: the profiler's adapter imports it anyway;
    nothing of CUDA is initialised by asking)."""
    if not torch_support.importable():
        return False
    import torch

    return getattr(torch.version, "cuda", None) is not None


def cuda_events() -> tuple[Callable[[], Any], Callable[[], bool], Any]:
    """(event factory, whether the current stream is being captured, Kineto backend) on CUDA: what the tests
    replace with fakes."""
    import torch

    # blocking: the poller that waits on them sleeps instead of spinning (obs.runtime.device_readback)
    return functools.partial(torch.cuda.Event, enable_timing=True, blocking=True), \
        torch.cuda.is_current_stream_capturing, None


def cuda_in_use() -> bool:
    """CUDA is initialised in this process: the model (or something) is on the GPU."""
    torch = sys.modules.get("torch")
    return torch is not None and bool(torch.cuda.is_initialized())


class DeviceRecording:
    """Device time for one session's ring (see the module's docstring); ``timer`` is None until :meth:`activate`."""

    def __init__(self, ring: RingWriter, *, watch: bool) -> None:
        self.ring = ring
        #: CUDA may come into use: :meth:`ready` is asked at each step boundary until it is
        self.watch = watch and "device" in ring.rings
        self.timer: device_time.DeviceTimer | None = None
        self.kernels: KernelCapture | None = None
        self._finished: list[KernelCapture] = []  # stopped captures whose results are being read
        self._kineto: Any = None
        self._subs = RingSubscriptions(ring)
        self.write: Callable[[int, Any, int, int, int], None] = _no_write
        if self.watch:
            append, intern, kind = ring.appender("device"), ring.intern, int(Kind.DEVICE_TIME)

            def write(target: int, a: Any, b: int, c: int, d: int) -> None:
                if a.__class__ is str:
                    a = intern(a)
                append(kind, int(target), a, b, c, d)

            self.write = write

    def ready(self) -> bool:
        """At a step boundary while watching: whether CUDA came into use (then call :meth:`activate`)."""
        return self.timer is None and self.watch and cuda_in_use()

    def activate(self) -> None:
        """Start timing on the device (on the training thread, at a step boundary)."""
        factory, capturing, self._kineto = cuda_events()
        self.timer = device_time.DeviceTimer(self.write, factory, capturing=capturing)
        device_time.current = self.timer
        memory_ring, intern, peak = self.ring.appender("memory"), self.ring.intern, int(Kind.MEMORY_PEAK)

        def on_memory(number: int, stats: dict[str, Any]) -> None:
            if "reserved_bytes.all.peak" in stats:  # CUDA's allocator statistics (on CPU: resident size only)
                memory_ring(peak, 0, intern(str(stats.get("device", "?"))), number,
                            int(stats.get("allocated_bytes.all.peak", 0)), int(stats["reserved_bytes.all.peak"]))

        self._subs.add(Event.MEMORY, on_memory)

    # -- kernel capture (op_trace windows) -------------------------------------------------------------------------
    def kernels_start(self, first: int) -> None:
        if self.timer is None or self.kernels is not None:
            return
        capture = KernelCapture(self.write, self.timer.when_done, self._kineto)
        if capture.start(first):
            self.kernels = capture

    def kernels_step(self, step: int) -> None:
        if self.kernels is not None:
            self.kernels.step_begins(step)

    def kernels_finish(self, last: int) -> None:
        """The op_trace window ended with step ``last``: its capture stops once the device has run that step."""
        capture, self.kernels = self.kernels, None
        if capture is not None:
            capture.finish(last)
            self._finished.append(capture)

    def poll(self) -> None:
        """At each step boundary: stop the captures whose steps the device has run."""
        keep = []
        for capture in self._finished:
            if not capture.poll() or (capture.thread is not None and capture.thread.is_alive()):
                keep.append(capture)
        self._finished = keep

    # -- lifecycle ------------------------------------------------------------------------------------------------
    def close(self, wait_s: float = 1.0) -> None:
        """Stop timing: the poller writes what the device completes within ``wait_s``; captures are stopped."""
        self._subs.close()
        for capture in [*self._finished, *([self.kernels] if self.kernels is not None else [])]:
            capture.close()
        self._finished, self.kernels = [], None
        timer, self.timer = self.timer, None
        if timer is not None:
            if device_time.current is timer:
                device_time.current = None
            timer.close(wait_s)

    def detach(self) -> None:
        """In a forked child: drop the parent's timer and captures without touching the device."""
        self._subs.close()
        timer, self.timer, self.kernels, self._finished = self.timer, None, None, []
        if timer is not None:
            timer.abandon()
            if device_time.current is timer:
                device_time.current = None


def _no_write(target: int, a: Any, b: int, c: int, d: int) -> None:
    """No ``device`` ring: nothing is timed."""
