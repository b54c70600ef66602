"""The NaN/Inf check's gates on a device: one per checked tensor, kept on the device, read once per step off-thread.

:meth:`DeviceFlags.check` takes a tensor's ``torch.aminmax`` (one reduction kernel, no read-back; NaN propagates to
both, +Inf shows in the max and -Inf in the min, and no sum can overflow) and keeps the two 0-dim results in a
:class:`~obs.runtime.device_readback.DeviceBatch` with a label saying where the tensor came from.  At the step's
end :meth:`DeviceFlags.end_step` sends the batch (one copy per device into pinned memory, then an event) and hands it
to a :class:`~obs.runtime.device_readback.Poller`: once the event is done, on the poller's thread, the labels are
walked in the order the checks were made and ``found(step, label, low, high)`` is called for each one whose gate is
not finite; it returns False to stop the walk (nothing more to report).  :meth:`DeviceFlags.check_values` keeps a
whole vector the same way (the statistics of a compiled graph's tensors, which the graph computed on the device): its
own ``walk`` reads it at its place in that order.

Nothing here waits for a device on the calling thread.  Which devices are deferred: CUDA always; the tests add the
CPU (``cpu=True``) to drive the same logic without a GPU.  Other tensors (another device, a tensor subclass, sparse)
are left to the caller (:meth:`check` returns False).  Without a step end, a batch is sent every
:data:`MAX_PENDING` checks.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

import torch

from obs._core.internal import suppressed
from obs.features.dump._tensors import read_after_the_step
from obs.runtime.device_readback import DeviceBatch, Poller, Sent

__all__ = ["MAX_PENDING", "DeviceFlags"]

#: checks kept before a batch is sent without a step end (a loop that never ends a step)
MAX_PENDING = 8192

#: found(step, label, low, high) -> whether to go on walking the batch
Found = Callable[[int, Any, float, float], bool]
#: walk(step, values) -> whether to go on walking the batch (check_values)
Walk = Callable[[int, list[float]], bool]


class DeviceFlags:
    """Per-tensor gates of the steps in flight; ``found`` is called on the poller's thread."""

    def __init__(self, found: Found, *, cpu: bool = False, name: str = "nan-check") -> None:
        self._found = found
        self._cpu = cpu
        self._lock = threading.Lock()
        self._batch = DeviceBatch()
        self._labels: list[tuple[int, Any, int]] = []  # (step, label, first value's index) per check, in order
        self.poller = Poller(name)
        self.checks = 0  # tensors gated on their device so far
        self.reads = 0  # batches read back so far
        self._closed = False

    @property
    def pending(self) -> int:
        """Checks made since the last batch was sent."""
        return len(self._labels)

    def takes(self, tensor: torch.Tensor) -> bool:
        """Whether :meth:`check` gates ``tensor`` on its device."""
        return read_after_the_step(tensor, self._cpu)

    def check(self, tensor: torch.Tensor, step: int, label: Any) -> bool:
        """Gate ``tensor`` on its device for ``step`` (True; also when there is nothing to check: not a floating
        dtype, no element), or False where the caller must check it itself."""
        if not self.takes(tensor):
            return False
        if self._closed or not (tensor.is_floating_point() or tensor.is_complex()) or tensor.numel() == 0:
            return True  # closed: a gradient hook left from before the check was turned off
        with suppressed():
            t = tensor.detach()
            if t.is_complex():  # a NaN or Inf in either part; aminmax takes no complex
                t = torch.view_as_real(t.resolve_conj())
            low, high = torch.aminmax(t)
        with self._lock:
            self._labels.append((step, label, self._batch.add_all((low, high))))
            self.checks += 1
            full = len(self._labels) >= MAX_PENDING
        if full:
            self.end_step()
        return True

    def check_values(self, values: torch.Tensor, step: int, walk: Walk) -> None:
        """Keep ``values`` (1-D, on its device; nothing writes them again) for ``step``, in the order of the checks;
        the walk calls ``walk(step, values read back)`` at their place (it returns False to stop the walk)."""
        with self._lock:
            self._labels.append((step, _Values(walk, len(values)), self._batch.add_vector(values)))
            self.checks += 1
            full = len(self._labels) >= MAX_PENDING
        if full:
            self.end_step()

    def end_step(self) -> None:
        """Send the checks made so far to the host; they are walked once they arrive."""
        with self._lock:
            if not self._labels:
                return
            batch, labels = self._batch, self._labels
            self._batch, self._labels = DeviceBatch(), []
        sent = batch.send()
        if sent is not None:
            self.poller.submit(sent.markers, lambda: self._walk(sent, labels))

    def flush(self, timeout: float | None = None) -> bool:
        """Send what is pending and wait (on this thread) until every batch sent has been walked."""
        self.end_step()
        return self.poller.drain(timeout)

    def close(self) -> None:
        """:meth:`flush`, then stop the poller's thread; later checks are ignored."""
        self.end_step()
        self._closed = True
        self.poller.close()

    def _walk(self, sent: Sent, labels: list[tuple[int, Any, int]]) -> None:
        values = sent.values()
        self.reads += 1
        isfinite = math.isfinite
        for step, label, first in labels:
            if label.__class__ is _Values:
                if not label.walk(step, values[first:first + label.count]):
                    return
                continue
            low, high = values[first], values[first + 1]
            if not (isfinite(low) and isfinite(high)) and not self._found(step, label, low, high):
                return


class _Values:
    """The label of :meth:`DeviceFlags.check_values`: its walk and how many values it has."""

    __slots__ = ("count", "walk")

    def __init__(self, walk: Walk, count: int) -> None:
        self.walk, self.count = walk, count
