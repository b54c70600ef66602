"""``obs.scalar(name, value)``: a value the user reports per step (a loss, a learning rate), as a metric.

While the profiler records metrics, each call writes one SCALAR slot into the profile ring (the name
interned once, the step, the value as a float64): the exporter process turns it into the gauge
``obs.scalar`` with the attribute ``name``.  Otherwise a call returns at once.

No host sync: a Python number or a CPU tensor is read where it is (``.item()`` of a CPU tensor waits
for nothing).  A CUDA tensor is copied, ``non_blocking``, into pinned host memory and its slot is written
by a poller's thread (``obs-scalars``) once the copy is done (:mod:`obs.runtime.device_readback`), so the
training thread never waits for the device.  What is still in flight when the session closes is waited
for then.  Any other device's tensor is read with ``.item()``.  Light: torch is imported only for a
CUDA tensor.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from obs.runtime.device_readback import Poller, marker, pinned_copy
from obs.runtime.steps import tracker
from recorder.layout import SCALAR_SLOT, Kind

if TYPE_CHECKING:
    from recorder.ring import RingWriter

__all__ = ["ScalarWriter", "attach", "detach", "recording", "scalar", "set_tap"]

_write: Callable[[str, Any], None] | None = None  # the write of the ScalarWriter in force; None: metrics off
_writer: ScalarWriter | None = None
_tap: Callable[[str, Any], None] | None = None  # the training-health monitor's reader of scalars; None: monitor off


class _Unknown:
    """Stands for torch.Tensor until a tensor was seen (no value is of this class)."""


def scalar(name: str, value: Any) -> None:
    """Record ``value`` (a number, or a one-element tensor) as the scalar ``name`` of the current step.

    A metric of the profiler's exporter process (``obs.scalar{name=...}``): recorded while the profiler's
    metrics are on, a no-op otherwise.  Never synchronises with a device: a CUDA tensor's value is copied
    without blocking and read once the copy is done.  Raises TypeError for a name that is not a non-empty
    str or a value that is not a number, ValueError for a tensor of more than one element.
    """
    tap = _tap
    if tap is not None:
        tap(name, value)
    write = _write
    if write is not None:
        write(name, value)


class ScalarWriter:
    """Writes SCALAR slots into the ``step`` ring of a profile ring; its poller writes those of device copies.

    Calling it records one value; the hot path (a number, a CPU tensor) is a closure built here, with
    every name it needs bound to a local: each attribute lookup is paid per call."""

    __slots__ = ("write", "_slot", "_ids", "_poller", "_tensor", "ring")

    def __init__(self, ring: RingWriter) -> None:
        self.ring = ring
        _, mm, base, cap, size, counter, seq, clock = ring.slots("step")
        kind, pack, steps = int(Kind.SCALAR), SCALAR_SLOT.pack_into, tracker
        ids, me = ring.ids, self
        self._ids = ids
        self._poller = Poller("scalars")  # its thread starts with the first CUDA tensor
        self._tensor: type = _Unknown  # torch.Tensor once a tensor was seen (torch is not imported for nothing)

        def slot(sid: int, step: int, value: float) -> None:
            idx = next(counter)
            pack(mm, base + (idx % cap) * size, next(seq), idx + 1, clock(), kind, 0, sid, step, 0, value)

        def write(name: str, value: Any) -> None:
            sid = ids.get(name)
            if not sid:  # None: a name not seen yet; 0 is the ring's id of ""
                sid = me._name_id(name)
            cls = value.__class__
            if cls is not float and cls is not int:
                if cls is not me._tensor or value.is_cuda:
                    me._other(sid, name, value)
                    return
                try:
                    value = value.item()  # a CPU tensor's value is in host memory: nothing to wait for
                except RuntimeError:  # not one element: _other says so
                    me._other(sid, name, value)
                    return
            idx = next(counter)
            pack(mm, base + (idx % cap) * size, next(seq), idx + 1, clock(), kind, 0, sid, steps.step, 0, value)

        self._slot, self.write = slot, write

    def __call__(self, name: str, value: Any) -> None:
        self.write(name, value)

    def _name_id(self, name: Any) -> int:
        if not isinstance(name, str) or not name:
            raise TypeError(f"obs.scalar: the name must be a non-empty str (got {name!r})")
        return self.ring.intern(name)

    def _other(self, sid: int, name: str, value: Any) -> None:
        """Anything but a float, an int or a one-element CPU tensor: another number, a CUDA tensor (copied, read
        later), another device's tensor (read with ``.item()``), or an error."""
        device = getattr(value, "device", None)
        if device is None or not hasattr(value, "numel"):
            try:
                number = float(value)
            except (TypeError, ValueError):
                raise TypeError(f"obs.scalar({name!r}, ...): the value must be a number or a one-element tensor "
                                f"(got {type(value).__name__})") from None
            self._slot(sid, tracker.step, number)
            return
        torch = sys.modules.get("torch")
        if torch is not None and type(value) is torch.Tensor:
            self._tensor = torch.Tensor  # from now on a plain tensor takes the hot path
        if value.numel() != 1:
            raise ValueError(f"obs.scalar({name!r}, ...): the tensor must hold one element (got shape "
                             f"{tuple(value.shape)})")
        if device.type == "cuda":
            self._copy(sid, value)
        else:
            self._slot(sid, tracker.step, float(value.item()))

    def _copy(self, sid: int, value: Any) -> None:
        """A CUDA tensor: copied into pinned memory without blocking, its slot written by the poller's thread once the
        copy is done."""
        host, step = pinned_copy(value.detach().reshape(())), tracker.step
        self._poller.submit((marker(value.device),), lambda: self._slot(sid, step, float(host.item())))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the slots of every device copy so far are written (False when ``timeout`` passed first)."""
        return self._poller.drain(timeout)

    def close(self) -> None:
        """Write the slots of the device copies still in flight (waiting for them), then stop the poller's thread."""
        self._poller.close()

    def abandon(self) -> None:
        """In a forked child: forget the parent's copies in flight, touching no device."""
        self._poller.abandon()

    @property
    def pending(self) -> int:
        """Device copies whose slots are not written yet."""
        return self._poller.pending


def recording() -> bool:
    """Whether obs.scalar values are recorded now (a profile session with its metrics on)."""
    return _write is not None


def set_tap(tap: Callable[[str, Any], None] | None) -> None:
    """Hand every ``obs.scalar`` call to ``tap(name, value)`` too (the training-health monitor's loss); None: stop."""
    global _tap
    _tap = tap


def attach(writer: ScalarWriter) -> None:
    """Route obs.scalar to ``writer`` (a profile session whose metrics are on)."""
    global _write, _writer
    _writer, _write = writer, writer.write


def detach(writer: ScalarWriter) -> None:
    """Stop routing obs.scalar to ``writer``, if it is the one in force."""
    global _write, _writer
    if _writer is writer:
        _writer = _write = None
