"""statistic.csv's statistics of CUDA tensors: reductions kept on the device, read back once per step, off-thread.

:meth:`DeviceStats.record` queues the reductions a tensor's statistic categories need (0-dim tensors on its
device, in a :class:`~obs.runtime.device_readback.DeviceBatch`; no read-back) and returns the row's record
(``[values, dtype, shape, text]``, as :class:`~obs.features.dump.stats.statistic_csv.StatisticRows` keeps them) with
no values yet and, as its text, a token.  At the step's end the rows' text is made as usual, tokens and all, and
:meth:`DeviceStats.send` copies the step's reductions to the host (one copy per device, then an event); once
they are there, on the poller's thread, each record gets its values and text, the tokens are replaced and the file
is written.  Hash categories need the bytes: the tensor is copied whole into pinned memory, hashed there.
:meth:`DeviceStats.record_rows` does the same for the rows of a compiled graph, whose statistics the graph computed
on the device (:mod:`obs.features.dump.stats.graph_rows`): they are read with the step's others.

The values are those of :func:`obs.features.dump.stats.tensor_stats.statistics`'s torch path, computed without a
branch on the data: max, min and avg over the finite elements (None when there is none), exact NaN/Inf counts, the L2
norm over all elements, zero counts.  CUDA tensors only (the CPU ones have the C pass, which waits for nothing); the
tests add the CPU (``cpu=True``) to drive this logic without a GPU.
"""

from __future__ import annotations

import functools
import math
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from obs._core.internal import suppressed
from obs.features.dump._tensors import read_after_the_step
from obs.features.dump.stats.tensor_stats import _add_hashes, prepared
from obs.runtime.device_readback import DeviceBatch, Poller, Sent, pinned_copy

__all__ = ["DeviceStats", "reductions", "statistics_of"]

_COUNTS = {"nan count": "nan", "positive inf count": "pos_inf", "negative inf count": "neg_inf"}
_ZEROS = frozenset({"zero count", "positive zero count", "negative zero count"})
_HASHES = frozenset({"md5", "hash:md5", "hash", "hash:sha1"})
_TOKEN = re.compile("\x00([0-9]+)\x00")
_INF = math.inf
#: a row a device computed: (its index, dtype, shape, its categories' values of its row read back)
_Computed = tuple[int, torch.dtype, Any, Callable[[list[float]], list[Any]]]


def reductions(tensor: torch.Tensor, need: frozenset[str]) -> tuple[list[str], list[torch.Tensor], int, bool, int]:
    """``(names, values, numel, floating, repeat)``: the 0-dim device tensors ``need``'s categories are made of,
    each named; ``repeat``: how often each distinct element of an expanded tensor repeats."""
    t, n, repeat, floating = prepared(tensor)
    names: list[str] = []
    values: list[torch.Tensor] = []
    if not n:
        return names, values, n, floating, repeat

    def add(name: str, value: torch.Tensor) -> None:
        names.append(name)
        values.append(value)

    counts = bool(need.intersection(_COUNTS)) and floating
    if floating:
        if "max" in need:  # over the finite elements: every other one as -inf (-inf left: none is finite)
            add("max", torch.nan_to_num(t, nan=-_INF, posinf=-_INF, neginf=-_INF).amax())
        if "min" in need:
            add("min", torch.nan_to_num(t, nan=_INF, posinf=_INF, neginf=_INF).amin())
        if "avg" in need:
            low = t.dtype in (torch.float16, torch.bfloat16)
            add("sum", torch.nan_to_num(t, nan=0.0, posinf=0.0, neginf=0.0).sum(dtype=torch.float32 if low else None))
            if not counts:
                add("finite", torch.isfinite(t).sum())
        if counts:
            add("nan", torch.isnan(t).sum())
            add("pos_inf", (t == _INF).sum())
            add("neg_inf", (t == -_INF).sum())
    else:
        if need & {"max", "min"}:
            low_value, high_value = torch.aminmax(t)
            add("min", low_value)
            add("max", high_value)
        if "avg" in need:
            add("sum", t.sum(dtype=torch.float64))
    if "l2norm" in need:
        add("l2norm", torch.linalg.vector_norm(t if floating else t.to(torch.float64)))
    if need.intersection(_ZEROS):
        zero = t == 0
        add("zero", zero.sum())
        if floating:
            add("neg_zero", (zero & torch.signbit(t)).sum())
    return names, values, n, floating, repeat


def statistics_of(read: dict[str, float], n: int, floating: bool, repeat: int) -> dict[str, Any]:
    """The statistic categories' values from what :func:`reductions` named, read back."""
    values: dict[str, Any] = {"count": n, "l2norm": 0.0, "zero count": 0, "negative zero count": 0,
                              "positive zero count": 0, "nan count": 0, "positive inf count": 0,
                              "negative inf count": 0, "max": None, "min": None, "avg": None}
    if not n:
        return values
    for category, name in _COUNTS.items():
        if name in read:
            values[category] = int(read[name]) * repeat
    if floating:
        for name in ("max", "min"):
            if name in read and math.isfinite(read[name]):
                values[name] = read[name]
        finite = read["finite"] * repeat if "finite" in read else \
            n - values["nan count"] - values["positive inf count"] - values["negative inf count"]
        if "sum" in read and finite:
            values["avg"] = read["sum"] * repeat / finite
    else:
        values.update({name: read[name] for name in ("max", "min") if name in read})
        if "sum" in read:
            values["avg"] = read["sum"] * repeat / n
    if "l2norm" in read:
        values["l2norm"] = read["l2norm"] * math.sqrt(repeat)
    if "zero" in read:
        zero, negative = int(read["zero"]) * repeat, int(read.get("neg_zero", 0)) * repeat
        values.update({"zero count": zero, "negative zero count": negative, "positive zero count": zero - negative})
    return values


class DeviceStats:
    """The records of one step whose statistics are on their device; :meth:`send` at the step's end."""

    def __init__(self, categories: Sequence[str], *, cpu: bool = False) -> None:
        self.categories = tuple(categories)
        self._need = frozenset(categories)
        self._hashes = bool(self._need & _HASHES)
        self._cpu = cpu
        self._lock = threading.Lock()
        self._batch = DeviceBatch()
        # per record: (record, first value's index, how many, its categories' values of those read back)
        self._pending: list[tuple[list[Any], int, int, Callable[[list[float]], list[Any]]]] = []
        self.poller = Poller("statistic-dump")

    def __len__(self) -> int:
        return len(self._pending)

    def takes(self, tensor: torch.Tensor) -> bool:
        """Whether :meth:`record` takes ``tensor`` (a plain strided CUDA tensor)."""
        return read_after_the_step(tensor, self._cpu)

    def record(self, tensor: torch.Tensor, dtype: torch.dtype, shape: Any) -> list[Any]:
        """``tensor``'s record, its statistics queued on its device; its values and text come at :meth:`send`."""
        with suppressed():
            names, values, n, floating, repeat = reductions(tensor, self._need)
            host = pinned_copy(tensor.detach()) if self._hashes else None
        make = functools.partial(self._values_of, names, n, floating, repeat, host)
        with self._lock:
            token = f"\x00{len(self._pending)}\x00"
            record: list[Any] = [[], dtype, shape, token]
            first = self._batch.add_all(values) if values else 0
            self._pending.append((record, first, len(values), make))
        return record

    def record_rows(self, values: torch.Tensor, width: int, rows: Sequence[_Computed]) -> list[list[Any]]:
        """The records of rows whose statistics a device computed already: row ``i`` of ``values`` (1-D, ``width``
        per row, nothing writes it again) is ``values[width i : width i + width]``; per record ``(i, dtype, shape,
        make)``, ``make(row i read back)`` gives its categories' values at :meth:`send`."""
        records: list[list[Any]] = []
        if not rows:
            return records
        with self._lock:
            first = self._batch.add_vector(values)
            for i, dtype, shape, make in rows:
                records.append([[], dtype, shape, f"\x00{len(self._pending)}\x00"])
                self._pending.append((records[-1], first + width * i, width, make))
        return records

    def _values_of(self, names: list[str], n: int, floating: bool, repeat: int, host: torch.Tensor | None,
                   read: list[float]) -> list[Any]:
        values = statistics_of(dict(zip(names, read)), n, floating, repeat)
        if host is not None:
            _add_hashes(host, values)
        return [values.get(c) for c in self.categories]

    def clear(self) -> None:
        """Forget the records not sent (their step is not written)."""
        with self._lock:
            self._batch, self._pending = DeviceBatch(), []

    def send(self, text: str, fmt: Callable[[list[Any]], str], write: Callable[[str], None]) -> None:
        """Copy the step's statistics to the host; once there (on the poller's thread) give each record its values
        and its text (``fmt(record)``), put those in place of the tokens of ``text`` and ``write`` the result."""
        with self._lock:
            batch, pending = self._batch, self._pending
            self._batch, self._pending = DeviceBatch(), []
        sent = batch.send()
        markers = sent.markers if sent is not None else []
        self.poller.submit(markers, lambda: write(self._fill(text, sent, pending, fmt)))

    def _fill(self, text: str, sent: Sent | None, pending: list[Any], fmt: Callable[[list[Any]], str]) -> str:
        read = sent.values() if sent is not None else []
        tails = []
        for record, first, count, make in pending:
            record[0] = make(read[first:first + count])
            record[3] = None
            tails.append(fmt(record))
            record[3] = tails[-1]
        return _TOKEN.sub(lambda m: tails[int(m.group(1))], text)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait (on this thread) until every step sent has been written."""
        return self.poller.drain(timeout)

    def close(self) -> None:
        self.clear()
        self.poller.close()
