"""A step's values on their way to the worker thread, with no host read on the training thread.

The step's values (:class:`obs.features.monitor.writer.Packet`'s ``values``) are parts: Python numbers or lists
(the CPU's native norms), CPU tensors (read by the worker as they are), and tensors on an accelerator.  On CUDA,
:func:`to_host` joins a step's device tensors into one device batch (one ``torch.cat``), copies it once into pinned
host memory without blocking (``copy_(non_blocking=True)``) and records an event after the copy on the current
stream.  Each device part is replaced by a :class:`HostSlice` of that copy: the worker's ``tolist()`` waits for the
event (the first slice read waits, the others find the values read) and never the training thread.  The pinned
buffer comes from torch's caching host allocator, which does not hand it out again before the copy's event.

Other accelerators (no pinned copy here) keep their tensors as parts: the worker's read of them is its own wait.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from obs._core.internal import suppressed

__all__ = ["HostCopy", "HostSlice", "join", "to_host"]


class HostCopy:
    """One step's device batch in host memory once ``event`` has passed (None: already there)."""

    __slots__ = ("host", "event", "_values")

    def __init__(self, host: torch.Tensor, event: Any) -> None:
        self.host, self.event = host, event
        self._values: list[float] | None = None

    def values(self) -> list[float]:
        """The batch as floats: waits for the copy (on the worker thread), once."""
        if self._values is None:
            if self.event is not None:
                self.event.synchronize()
            self._values = self.host.tolist()
        return self._values


class HostSlice:
    """A part of a packet's values: ``copy``'s elements ``start:stop``, read with ``tolist()`` as a tensor is."""

    __slots__ = ("copy", "start", "stop")

    def __init__(self, copy: HostCopy, start: int, stop: int) -> None:
        self.copy, self.start, self.stop = copy, start, stop

    def tolist(self) -> list[float]:
        return self.copy.values()[self.start:self.stop]


def _pinned_copy(joined: torch.Tensor) -> HostCopy:
    """``joined`` (on a CUDA device) into pinned host memory, without waiting; an event recorded after the copy."""
    host = torch.empty(joined.shape, dtype=joined.dtype, pin_memory=True)
    host.copy_(joined, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(joined.device))
    return HostCopy(host, event)


def join(values: list[Any], on_device: Callable[[Any], bool], copy: Callable[[torch.Tensor], HostCopy]) -> list[Any]:
    """``values`` with the parts ``on_device`` picks joined into one batch (float32, float64 when one part is),
    handed to ``copy``, and replaced by their slices of it, in place: the order of the values is kept."""
    where = [i for i, v in enumerate(values) if on_device(v)]
    if not where:
        return values
    dtype = torch.float64 if any(values[i].dtype == torch.float64 for i in where) else torch.float32
    with torch.no_grad(), suppressed():
        flat = [values[i].detach().reshape(-1).to(dtype) for i in where]
        shared = copy(torch.cat(flat) if len(flat) > 1 else flat[0])
    out, at = list(values), 0
    for i, part in zip(where, flat):
        out[i] = HostSlice(shared, at, at + part.numel())
        at += part.numel()
    return out


def _is_cuda(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_cuda


def to_host(values: list[Any]) -> list[Any]:
    """A step's values with its CUDA tensors in one pinned copy per device (see the module); the rest as they are."""
    for device in {v.device for v in values if _is_cuda(v)}:
        values = join(values, lambda v, d=device: _is_cuda(v) and v.device == d, _pinned_copy)
    return values
