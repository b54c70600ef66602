"""statistic.csv of one step: statistics taken as ops return, the text formatted once at the step's end.

An op's statistics must be taken when it returns (a later in-place write would change them), but
everything else waits: a row is recorded as ``(op, io, slot, record)`` and a record holds the
statistics, the dtype and the shape of one tensor.  Records are shared within a step: by tensor (an
op's output is usually the next op's input), and by memory (autograd hands backward a new tensor
object for a saved forward output; a view with the same layout): the same storage, still alive, the
same address, shape, strides, dtype and version hold the same values.  :meth:`StatisticRows.text` then
formats each record once and every row from it, in one tight loop instead of a little at a time
between the training step's kernels.

CUDA tensors' statistics stay on the device until the step's end (:mod:`obs.features.dump.stats.device_stats`): their
records hold a token as text until :meth:`StatisticRows.send` has their values, off the training thread.

Plain CPU tensors are recorded by a C++ recorder (``obs/features/dump/stats/_fast_rows.cpp``, through
:mod:`obs.features.dump.stats.native_rows`) that reads them through ATen and keeps the same rows in C++, without a
Python object each, and formats them there; it hands every other tensor back to :meth:`StatisticRows._row`,
appends the row that makes to this list and keeps its place among its own rows, so rows stay in order.  The Python
path here is the reference the tests hold it to, and the fallback where it is not built.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from obs.features.dump.stats import native_rows, tensor_stats
from obs.features.dump.stats.columns import csv_header
from obs.features.dump.stats.device_stats import DeviceStats
from obs.features.dump.stats.tensor_stats import compile_contiguous, compile_statistics, native_code, native_picks

__all__ = ["Op", "StatisticRows", "each_tensor"]

#: (op type, escaped full name, µs): what names an op's rows and tensor files
Op = tuple[str, str, int]

_WHOLE = frozenset({"max", "min"})  # printed as integers for integer tensors
_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _number(value: Any, integral: bool) -> str:
    if value is None:
        return "null"
    if isinstance(value, float):
        if integral and value.is_integer():
            return str(int(value))
        return repr(value)
    return str(value)


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def each_tensor(op: Op, io: str, values: Sequence[Any], sink: Callable[[Op, str, int, torch.Tensor], None]) -> None:
    """``sink(op, io, slot, tensor)`` for every tensor of ``values``; slots follow positions, a list of tensors
    taking one slot per item (a non-tensor leaves a gap, as in MindSpore's dump)."""
    slot = 0
    for value in values:
        if isinstance(value, torch.Tensor):
            sink(op, io, slot, value)
        elif isinstance(value, (list, tuple)) and value and \
                all(isinstance(v, torch.Tensor) or v is None for v in value):
            for item in value:
                if item is not None:
                    sink(op, io, slot, item)
                slot += 1
            continue
        slot += 1


class StatisticRows:
    """The rows of one step; ``add_values`` (or ``add``) while ops run, ``text`` at the end, ``clear`` for the
    next step.  ``add_values`` is the C++ recorder (obs/features/dump/stats/_fast_rows.cpp) where it is built and the
    statistics allow it (no hash), else :func:`each_tensor` over :meth:`_add`; ``native=False`` asks for Python."""

    def __init__(self, categories: Sequence[str], *, native: bool = True) -> None:
        self.header = csv_header(categories)
        self._stats = compile_statistics(tuple(categories))
        self._contiguous = compile_contiguous(tuple(categories))  # the C pass on what _by_memory already read
        self._whole = [c in _WHOLE for c in categories]
        self._rows: list[tuple[Op, str, int, list[Any]]] = []  # the C++ recorder's slow rows are here too: kept
        self._computed: list[tuple[Op, str, int, list[Any]]] = []  # rows of compiled graphs (add_computed)
        self._seen: dict[int, tuple[Any, int, list[Any] | None]] = {}
        self._memory: dict[tuple[Any, ...], tuple[Any, list[Any]]] = {}
        self._dtypes: dict[torch.dtype, tuple[int, str, bool]] = {}  # itemsize, name, floating: for the C formatter
        for dtype in tensor_stats.NATIVE_DTYPES:  # the C++ recorder's records: their dtypes are known ahead
            self._dtype_info(dtype)
        picks = native_picks(tuple(categories)) if native else None
        self.native = None if picks is None else native_rows.row_recorder(
            self._rows, picks[0], picks[1], self._row)
        self.add_values: Callable[[Op, str, Sequence[Any]], None] = \
            self.native.add_values if self.native is not None else self._add_values
        self.device = DeviceStats(categories)  # CUDA tensors' records, their statistics on the device

    def __len__(self) -> int:
        return (len(self._rows) if self.native is None else self.native.size) + len(self._computed)

    def add_computed(self, op: Op, io: str, slot: int, values: list[Any], dtype: torch.dtype,
                     shape: tuple[int, ...]) -> None:
        """A row whose statistics were computed elsewhere (by a compiled graph); written after the others."""
        if dtype not in self._dtypes:
            self._dtype_info(dtype)
        self._computed.append((op, io, slot, [values, dtype, shape, None]))

    def add_computed_later(self, op: Op, io: str, slot: int, record: list[Any]) -> None:
        """A compiled graph's row whose values come from the device after the step (``record``:
        :meth:`DeviceStats.record_rows`'); written after the others, as :meth:`add_computed`'s."""
        self._computed.append((op, io, slot, record))

    def clear(self) -> None:
        self.device.clear()
        self._computed.clear()
        self._rows.clear()
        self._seen.clear()
        self._memory.clear()
        if self.native is not None:
            self.native.clear()

    def _add_values(self, op: Op, io: str, values: Sequence[Any]) -> None:
        each_tensor(op, io, values, self._add)

    def _dtype_info(self, dtype: torch.dtype) -> None:
        self._dtypes[dtype] = (dtype.itemsize, _dtype_name(dtype), dtype.is_floating_point or dtype.is_complex)

    def add(self, op: Op, io: str, slot: int, tensor: torch.Tensor) -> None:
        """One row for ``tensor`` (none for a tensor without strided values of one shape: sparse, meta, nested)."""
        if self.native is not None:  # the C++ recorder keeps the rows: it places the tensor at its slot
            self.native.add_values(op, io, (*(None,) * slot, tensor))
        else:
            self._add(op, io, slot, tensor)

    def _add(self, op: Op, io: str, slot: int, tensor: torch.Tensor) -> None:
        """:meth:`add` in Python, the whole recorder where the C++ one is not built."""
        row = self._row(op, io, slot, tensor)
        if row is not None:
            self._rows.append(row)

    def _row(self, op: Op, io: str, slot: int, tensor: torch.Tensor) -> tuple[Op, str, int, list[Any]] | None:
        """The row of ``tensor`` (its record shared within the step), None without one.  The C++ recorder's slow path:
        it appends the row itself, so that another thread's rows cannot land in between."""
        try:
            version = tensor._version
        except RuntimeError:  # an inference tensor has no version counter: not shared
            version = None
        seen = self._seen.get(id(tensor))
        if seen is not None and seen[1] == version and version is not None and seen[0]() is tensor:
            record = seen[2]
        else:
            record = self._record(tensor, version)
        return None if record is None else (op, io, slot, record)

    def _record(self, tensor: torch.Tensor, version: int | None) -> list[Any] | None:
        dtype = tensor.dtype
        if dtype not in self._dtypes:
            self._dtype_info(dtype)
        if tensor.layout is not torch.strided or tensor.is_meta or tensor.is_nested:  # no single shape: no row
            record = None
        elif version is None:
            record = self.device.record(tensor, dtype, tensor.shape) if self.device.takes(tensor) else \
                [self._stats(tensor), dtype, tensor.shape, None]
        else:
            record = self._by_memory(tensor, version, dtype)
        if version is not None:
            self._seen[id(tensor)] = (weakref.ref(tensor), version, record)
        return record

    def _by_memory(self, tensor: torch.Tensor, version: int, dtype: torch.dtype) -> list[Any]:
        """The record of another tensor over the same memory, else a new one: [statistics, dtype, shape, text]."""
        shape = tensor.shape
        try:
            storage = tensor.untyped_storage()  # one Python object per live storage: identity is safe
            address = tensor.data_ptr()
            key = (address, shape, tensor.stride(), dtype, version)
        except Exception:  # noqa: BLE001 - a tensor subclass without storage
            return [self._stats(tensor), dtype, shape, None]
        found = self._memory.get(key)
        if found is not None and found[0]() is storage:
            return found[1]
        if self.device.takes(tensor):  # no read-back now: its values come after the step
            record = self.device.record(tensor, dtype, shape)
        else:
            code = None if self._contiguous is None else native_code(tensor, dtype)
            values = self._stats(tensor) if code is None else self._contiguous(address, tensor.numel(), code)
            record = [values, dtype, shape, None]
        self._memory[key] = (weakref.ref(storage), record)
        return record

    def text(self) -> str:
        """statistic.csv: the header, then one line per row, in the order they were added (compiled graphs'
        rows after the others)."""
        if self.native is not None:
            text = self.native.text(self.header, self._whole, self._dtypes)
        elif tensor_stats.native is not None:
            text = tensor_stats.native.format_rows(self._rows, self.header, self._whole, self._dtypes)
        else:
            return self.python_text()
        return text + self._lines(self._computed) if self._computed else text

    def write_text(self, write: Callable[[str], None]) -> None:
        """``write(text())`` now, or, where the step has records of device tensors, once their values are on the
        host (on the poller's thread; :meth:`flush` waits for it)."""
        text = self.text()
        if len(self.device):
            self.device.send(text, self._format, write)
        else:
            write(text)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every text :meth:`write_text` left for later is written."""
        return self.device.flush(timeout)

    def close(self) -> None:
        """:meth:`flush`, then stop the thread that writes them."""
        self.device.close()

    def python_text(self) -> str:
        """:meth:`text` without the C extension (the reference the C formatter is tested against)."""
        return self.header + "\n" + self._lines(self._rows) + self._lines(self._computed)

    def _lines(self, rows: list[tuple[Op, str, int, list[Any]]]) -> str:
        lines = []
        last_op, prefix = None, ""
        for op, io, slot, record in rows:
            if op is not last_op:  # an op's rows follow one another
                last_op, prefix = op, f"{op[0]},{op[1]},0,0,{op[2]},"
            tail = record[3]
            if tail is None:
                tail = record[3] = self._format(record)
            lines.append(f"{prefix}{io},{slot},{tail}\n")
        return "".join(lines)

    def _format(self, record: list[Any]) -> str:
        """Data Size, Data Type, Shape, then the statistics: the columns after the slot."""
        values, dtype, shape = record[0], record[1], record[2]
        fixed = f'{math.prod(shape) * dtype.itemsize},{_dtype_name(dtype)},"({",".join(map(str, shape))})"'
        if not values:
            return fixed
        if dtype.is_floating_point or dtype.is_complex:
            numbers = [repr(v) if v.__class__ is float else "null" if v is None else str(v) for v in values]
        else:
            numbers = [_number(v, whole) for v, whole in zip(values, self._whole)]
        return fixed + "," + ",".join(numbers)
