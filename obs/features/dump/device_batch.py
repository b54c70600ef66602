"""Values computed on a device during a step, read by the host once, without the training thread waiting for it.

A :class:`DeviceBatch` gathers 0-dim device tensors (reductions a dump made of its tensors) as a step runs; nothing is
read back meanwhile.  :meth:`DeviceBatch.send` then stacks them on their device, as float64, and starts one copy per
device into a pinned host buffer (``non_blocking``: the CPU goes on at once) followed by a marker (a CUDA event) on
the stream that made the copy.  The returned :class:`Sent` is read off the training thread once its markers are done
(:class:`~obs.features.dump.device_poller.Poller` waits for them): neither ``.item()`` nor a blocking copy, so
``torch.cuda.set_sync_debug_mode("error")`` sees no host synchronisation.

:meth:`DeviceBatch.add_vector` keeps a whole 1-D tensor the same way (the statistics a compiled graph computed of
its tensors: :mod:`obs.runtime.torch._graph_taps`).

:func:`pinned_copy` starts the copy of a whole tensor the same way (the data dump's tensor files).

Any device works: on the CPU the "pinned buffer" is the stacked tensor itself and the marker is done already, which is
how the tests drive this logic without a GPU.  Work is assumed to be on each device's current stream at :meth:`send`
(autograd joins its backward streams to it); values made on a side stream that the current one does not wait for
could be read before they are written.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from obs._core.internal import suppressed

__all__ = ["DONE", "DeviceBatch", "Sent", "marker", "pinned_copy"]


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
    # blocking: a thread that waits on it sleeps instead of spinning on a core the training loop may need
    event = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
    event.record(torch.cuda.current_stream(device))
    return event


def pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A host tensor that receives ``tensor``'s values as they are now, once the work queued on its device so far is
    done (read it after a :func:`marker` of that device recorded later is); a CPU tensor's values are copied now."""
    if tensor.device.type == "cpu":
        return tensor.clone()
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


#: (device, dtype, whether its tensors are 1-D vectors): the tensors stacked (or concatenated) together
_Key = tuple[torch.device, torch.dtype, bool]


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
