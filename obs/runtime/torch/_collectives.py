"""torch.distributed collectives → COLLECTIVE events: sequence number per group, op, sizes, dtype, state, timing.

While COLLECTIVE has subscribers, the public collective functions of ``torch.distributed`` are
wrapped (both names: ``torch.distributed.X`` and ``distributed_c10d.X``).  A blocking call
publishes ``started`` then ``completed`` with its duration; an ``async_op=True`` call publishes
``scheduled`` and, once its Work is seen completed (polled at the next collective or step end),
``completed``.  Collectives issued from C++ (DDP's gradient buckets) are not seen.

Async completion is discovered at the next collective call (``poll``): a hung async op stays
``scheduled`` in the record, which is what a post-mortem needs to see.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from obs._core.events import Event, bus

__all__ = ["CollectiveHooks", "OPS"]

OPS = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
       "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier", "gather", "scatter", "send", "recv",
       "isend", "irecv")


def _group_name(group: Any) -> str:
    if group is None:
        return "default"
    return str(getattr(group, "group_name", None) or getattr(group, "group_desc", None) or id(group))


def _tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for value in itertools.chain(args, kwargs.values()):
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            out.extend(v for v in value if isinstance(v, torch.Tensor))
    return out


class CollectiveHooks:
    """Wraps the collectives until ``remove()``; ``poll()`` publishes completions of async work."""

    def __init__(self) -> None:
        self._seq: defaultdict[str, itertools.count[int]] = defaultdict(lambda: itertools.count(1))
        self._pending: list[tuple[Any, dict[str, Any], int]] = []
        self._originals: dict[str, Any] = {}
        for name in OPS:
            original = getattr(c10d, name, None)
            if original is None:
                continue
            self._originals[name] = original
            wrapped = self._wrap(name, original)
            setattr(c10d, name, wrapped)
            if getattr(dist, name, None) is original:
                setattr(dist, name, wrapped)

    def _wrap(self, name: str, original: Any) -> Any:
        @functools.wraps(original)
        def collective(*args: Any, **kwargs: Any) -> Any:
            self.poll()
            tensors = _tensors(args, kwargs)
            group = _group_name(kwargs.get("group"))
            record = {"op": name, "group": group, "seq": next(self._seq[group]),
                      "sizes": [list(t.shape) for t in tensors[:4]],
                      "dtype": str(tensors[0].dtype).removeprefix("torch.") if tensors else None,
                      "state": "started", "duration_ns": 0}
            is_async = bool(kwargs.get("async_op")) or name in ("isend", "irecv")
            if is_async:
                record["state"] = "scheduled"
            bus.emit(Event.COLLECTIVE, dict(record))
            start = time.perf_counter_ns()
            result = original(*args, **kwargs)
            if is_async and result is not None:
                self._pending.append((result, record, start))
            else:
                bus.emit(Event.COLLECTIVE, {**record, "state": "completed",
                                            "duration_ns": time.perf_counter_ns() - start})
            return result

        return collective

    def poll(self) -> None:
        """Publish ``completed`` for async work that has finished since the last poll."""
        if not self._pending:
            return
        still = []
        for work, record, start in self._pending:
            if work.is_completed():
                bus.emit(Event.COLLECTIVE, {**record, "state": "completed",
                                            "duration_ns": time.perf_counter_ns() - start})
            else:
                still.append((work, record, start))
        self._pending = still

    def remove(self) -> None:
        for name, original in self._originals.items():
            wrapped = getattr(c10d, name)
            setattr(c10d, name, original)
            if getattr(dist, name, None) is wrapped:
                setattr(dist, name, original)
        self._originals = {}
