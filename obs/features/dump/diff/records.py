"""One step of a data dump as ``obs dump diff`` sees it: its tensors in dump order as columns, and its ops as runs of
them.

An op is the rows (or tensor files) of one full name.  Its name gives its phase (forward, ``Gradients/``, or a
parameter), its module scope and its type: ``Gradients_Default_net-Net_fc1-Linear_Mm-op12`` is a backward ``Mm`` in
``Gradients_Default_net-Net_fc1-Linear``.  A tensor has its ``statistic.csv`` row (its fields as text, and its
statistics parsed into one float array per step) and its file's path, each where it was dumped.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from obs.features.dump.diff.metrics import number
from obs.features.dump.reader import DumpReader, Step, read_statistic_fields

__all__ = ["NULL", "NUMBER", "TEXT", "OpRecord", "StepRecords", "read_step"]

NUMBER, NULL, TEXT = 0, 1, 2  # what a statistic's cell holds
_ROUND = 1 << 44  # float64 bits kept for a fingerprint: 7 of the mantissa, about 2 significant digits
_MIX = np.array([0x9E3779B97F4A7C15 - (1 << 64) + 2 * k for k in range(64)], dtype=np.int64)


class OpRecord:
    """One op of a step: its full name, type, phase (``"forward"``, ``"backward"``, ``"parameter"``), module scope,
    its rows ``[start, end)`` in the step, its outputs' shapes (None where one is not known) and a fingerprint of its
    first output's statistics (None without statistics)."""

    __slots__ = ("name", "op_type", "phase", "scope", "start", "end", "shapes", "fingerprint")

    def __init__(self, name: str, op_type: str, start: int) -> None:
        self.name, self.op_type, self.start, self.end = name, op_type, start, start
        if op_type == "Parameter":
            self.phase, self.scope = "parameter", name
        else:
            cut = name.rfind("-op")
            head = name[:cut] if cut > 0 and name[cut + 3:].isdigit() else name
            if head.endswith(op_type):
                head = head[:-len(op_type)]
            self.scope = head.rstrip("_")
            self.phase = "backward" if self.scope.startswith("Gradients") else "forward"
        self.shapes: tuple[str, ...] | None = None
        self.fingerprint: int | None = None


class StepRecords:
    """The tensors of one step, as columns (``io``, ``slot``, ``dtype``, ``shape``, ``path``; ``raw``: each row's
    statistic fields as text; ``values``/``cells``: the statistics as floats and what each cell held), in the
    order of ``keys``; and its ops."""

    __slots__ = ("ops", "keys", "io", "slot", "dtype", "shape", "raw", "values", "cells", "path")

    def __init__(self, keys: list[str] | None) -> None:
        self.ops: list[OpRecord] = []
        self.keys = keys
        self.io: list[str] = []
        self.slot: list[int] = []
        self.dtype: list[str] = []
        self.shape: list[str | None] = []
        self.raw: list[list[Any]] = []
        self.path: list[str | None] = []
        self.values: np.ndarray | None = None
        self.cells: np.ndarray | None = None

    def rows(self, op: OpRecord) -> range:
        return range(op.start, op.end)

    def _fill(self, names: list[str], types: list[str]) -> None:
        """The ops: runs of rows of one name (an op's rows are written together)."""
        ops = self.ops
        last = None
        for row, name in enumerate(names):
            if name != last:
                if ops:
                    ops[-1].end = row
                ops.append(OpRecord(name, types[row], row))
                last = name
        if ops:
            ops[-1].end = len(names)
        if self.raw:
            self.values, self.cells = _parse(self.raw, len(self.keys or ()))
            fingerprints = _fingerprints(self.values, self.cells)
        else:
            fingerprints = None
        io, shape = self.io, self.shape
        for op in ops:
            outputs = [r for r in range(op.start, op.end) if io[r] == "output"]
            shapes = tuple(shape[r] for r in outputs)
            op.shapes = None if None in shapes else shapes  # type: ignore[assignment]
            if fingerprints is not None:
                op.fingerprint = int(fingerprints[outputs[0] if outputs else op.start])


def _parse(raw: list[list[Any]], width: int) -> tuple[np.ndarray, np.ndarray]:
    """The statistics as floats (NaN where a cell holds none) and what each cell holds (NUMBER, NULL, TEXT): a column
    at a time in numpy, a cell at a time only in a column holding a ``null`` or an MD5."""
    values = np.full((len(raw), width), np.nan)
    cells = np.zeros((len(raw), width), dtype=np.int8)
    for k, column in enumerate(zip(*raw)):
        try:
            values[:, k] = np.array(column, dtype=np.float64)
        except (ValueError, TypeError):
            for r, text in enumerate(column):
                value = number(text)
                if isinstance(value, float):
                    values[r, k] = value
                else:
                    cells[r, k] = NULL if value is None else TEXT
    return values, cells


def _fingerprints(values: np.ndarray, cells: np.ndarray) -> np.ndarray:
    """One integer per row from its statistics rounded to about 2 significant digits (each float's bits with the
    low 45 of the mantissa rounded off): rows whose statistics agree that closely mostly share it."""
    if not values.size:
        return np.zeros(len(values), dtype=np.int64)
    bits = np.where(np.isnan(values), 0, values).view(np.int64)
    rounded = (bits + _ROUND) >> 45
    rounded = np.where(cells == NUMBER, rounded, cells.astype(np.int64))
    hashed: np.ndarray = (rounded * _MIX[:values.shape[1]]).sum(axis=1)  # wraps around: a hash
    return hashed


def read_step(reader: Any, step: Step) -> StepRecords:
    """A step's ops from its ``statistic.csv`` (in execution order) and its tensor files; from the files alone
    (in the order they were written) where it has no ``statistic.csv``.  ``reader``: a :class:`DumpReader`, or any
    object with its ``statistics(step)`` and ``tensors(step)``."""
    files = {(t.op_name, t.io, t.slot): t.path for t in reader.tensors(step)}
    if isinstance(reader, DumpReader):
        csv_path = os.path.join(step.path, "statistic.csv")
        if os.path.exists(csv_path):
            keys, fields = read_statistic_fields(csv_path)
            records = StepRecords(keys)
            names = [f[1] for f in fields]
            records.io = [f[5] for f in fields]
            records.slot = [int(f[6]) for f in fields]
            records.dtype = [f[8] for f in fields]
            records.shape = [f[9] for f in fields]
            records.raw = [f[10:] for f in fields]
            records.path = ([files.get(k) for k in zip(names, records.io, records.slot)] if files else
                            [None] * len(fields))
            records._fill(names, [f[0] for f in fields])
            return records
    else:  # a reader view: its own rows
        rows = list(reader.statistics(step))
        if rows:
            keys = list(rows[0].stats)
            records = StepRecords(keys)
            records.io = [r.io for r in rows]
            records.slot = [r.slot for r in rows]
            records.dtype = [r.data_type for r in rows]
            records.shape = ["(" + ",".join(map(str, r.shape)) + ")" for r in rows]
            records.raw = [[r.stats.get(k) for k in keys] for r in rows]
            records.path = [files.get((r.op_name, r.io, r.slot)) for r in rows]
            records._fill([r.op_name for r in rows], [r.op_type for r in rows])
            return records
    records = StepRecords(None)
    by_name: dict[str, list[Any]] = {}
    for file in reader.tensors(step):  # in the order they were written; an op's files together
        by_name.setdefault(file.op_name, []).append(file)
    group = [file for files_of_op in by_name.values() for file in files_of_op]
    records.io = [f.io for f in group]
    records.slot = [f.slot for f in group]
    records.dtype = [f.dtype for f in group]
    records.shape = [None] * len(group)
    records.path = [f.path for f in group]
    records._fill([f.op_name for f in group], [f.op_type for f in group])
    return records
