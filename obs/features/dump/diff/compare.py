"""The tensors of two aligned ops compared: tensor files one pair at a time, ``statistic.csv`` rows a step at once.

Two ops' tensors pair by IO and slot.  A pair is compared by its tensors where both runs dumped them
(:func:`~obs.features.dump.diff.metrics.tensor_metrics`; the two arrays are the only ones in memory), else by its
statistics: rows whose statistics are the same text agree at once, the others of the step go through
:func:`~obs.features.dump.diff.metrics.statistic_metrics_many` together.  :class:`Parameters` names the parameter an
optimizer's op updates: the one whose value (its statistics, or its file's bytes) is the op's first input.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Hashable
from typing import Any, NamedTuple

import numpy as np

from obs._core import safe_files
from obs.features.dump.diff.metrics import DiffMetrics, Tolerance, statistic_metrics_many, tensor_metrics
from obs.features.dump.diff.records import TEXT, OpRecord, StepRecords
from obs.features.dump.reader import load_npy

__all__ = ["SAME_STATISTICS", "Parameters", "StepComparer", "TensorDiff"]


class TensorDiff(NamedTuple):
    """One input or output compared: ``source`` ``"tensors"`` or ``"statistics"``; ``row``: its position in A's
    step."""

    io: str
    slot: int
    source: str
    dtype_a: str
    dtype_b: str
    metrics: DiffMetrics
    row: int


class Parameters:
    """The parameters of A's step by value, to name the one an optimizer's op updates (built when first asked).

    An op outside every module in forward names the parameter whose value is its first input.  A value that two
    parameters share (two zero biases of one shape), or that two of the ops asked about start from (Adam's zero
    moments and a zero bias), names none: which parameter the op updates is then not told apart."""

    def __init__(self, records: StepRecords) -> None:
        self._records = records
        self._by_value: dict[Hashable, str | None] | None = None

    def _value(self, row: int) -> Hashable:
        r = self._records
        if r.raw:
            return (r.shape[row], tuple(r.raw[row]))
        path = r.path[row]  # the file's bytes: its header names dtype and shape, the rest is the values
        return None if path is None else hashlib.blake2b(safe_files.read_private(path), digest_size=16).digest()

    def _first_input(self, op: OpRecord) -> Hashable:
        r = self._records
        if op.phase != "forward" or op.scope != "Default":
            return None
        row = next((row for row in r.rows(op) if r.io[row] == "input" and r.slot[row] == 0), None)
        return None if row is None else self._value(row)

    def _parameters(self) -> dict[Hashable, str | None]:
        if self._by_value is None:
            self._by_value = {}
            for p in self._records.ops:
                if p.phase != "parameter":
                    break
                if p.end > p.start:
                    value = self._value(p.start)
                    self._by_value[value] = None if value in self._by_value else p.name
        return self._by_value

    def updated_by(self, ops: list[OpRecord]) -> list[str | None]:
        """For each op, the parameter it updates, or None (not an op outside every module in forward, none,
        ambiguous)."""
        values = [self._first_input(op) for op in ops]
        starts = Counter(v for v in values if v is not None)
        by_value = self._parameters() if starts else {}
        return [by_value.get(v) if v is not None and starts[v] == 1 else None for v in values]


SAME_STATISTICS = DiffMetrics(True, 0.0, 0.0, None, 0.0, 0.0)  #: two rows whose statistics are the same text


class StepComparer:
    """The tensors of a step's aligned ops compared: files one pair at a time, statistics all at once."""

    def __init__(self, ra: StepRecords, rb: StepRecords, tolerance: Tolerance,
                 tolerances: dict[tuple[str, str], tuple[float, float]]) -> None:
        self.ra, self.rb, self.tolerance, self._tol = ra, rb, tolerance, tolerances
        ka, kb = ra.keys or [], rb.keys or []
        self.keys = [k for k in ka if k in kb]
        self.index_a, self.index_b = [ka.index(k) for k in self.keys], [kb.index(k) for k in self.keys]
        self.same_keys = ka == kb
        self.sources: set[str] = set()

    def tol(self, dtype_a: str, dtype_b: str) -> tuple[float, float]:
        found = self._tol.get((dtype_a, dtype_b))
        if found is None:
            found = self._tol[(dtype_a, dtype_b)] = self.tolerance.of(dtype_a, dtype_b)
        return found

    def compare(self, pairs: list[tuple[OpRecord, OpRecord]]) -> list[list[TensorDiff]]:
        """For each pair of ops, its tensors compared (those both ops have, matched by IO and slot), in A's order."""
        ra, rb = self.ra, self.rb
        out: list[list[TensorDiff]] = []
        pending: list[tuple[list[TensorDiff], int, int, int]] = []  # statistics left to compare at once
        for oa, ob in pairs:
            a0, a1, b0, b1 = oa.start, oa.end, ob.start, ob.end
            if ra.io[a0:a1] == rb.io[b0:b1] and ra.slot[a0:a1] == rb.slot[b0:b1]:
                rows: Any = zip(range(a0, a1), range(b0, b1))  # the same tensors in the same order: most ops
            else:
                by_slot = {(rb.io[r], rb.slot[r]): r for r in range(b0, b1)}
                rows = ((r, by_slot.get((ra.io[r], ra.slot[r]))) for r in range(a0, a1))
            diffs: list[TensorDiff] = []
            for row_a, row_b in rows:
                if row_b is None:
                    continue
                path_a, path_b = ra.path[row_a], rb.path[row_b]
                if path_a is not None and path_b is not None:
                    diffs.append(self._tensors(row_a, row_b, path_a, path_b))
                elif ra.raw and rb.raw and self.keys:
                    if ra.shape[row_a] != rb.shape[row_b]:
                        metrics = DiffMetrics(False, what="shape", a=ra.shape[row_a], b=rb.shape[row_b])
                    elif self.same_keys and ra.raw[row_a] == rb.raw[row_b]:
                        metrics = SAME_STATISTICS
                    else:
                        pending.append((diffs, len(diffs), row_a, row_b))
                        metrics = SAME_STATISTICS  # replaced below
                    diffs.append(TensorDiff(ra.io[row_a], ra.slot[row_a], "statistics", ra.dtype[row_a],
                                            rb.dtype[row_b], metrics, row_a))
                    self.sources.add("statistics")
            out.append(diffs)
        if pending:
            self._statistics(pending)
        return out

    def _tensors(self, row_a: int, row_b: int, path_a: str, path_b: str) -> TensorDiff:
        ra, rb = self.ra, self.rb
        xa, xb = load_npy(path_a), load_npy(path_b)
        if xa.shape != xb.shape:
            metrics = DiffMetrics(False, what="shape", a=xa.shape, b=xb.shape)
        else:
            metrics = tensor_metrics(xa, xb, *self.tol(ra.dtype[row_a], rb.dtype[row_b]))
        del xa, xb  # one pair in memory at a time
        self.sources.add("tensors")
        return TensorDiff(ra.io[row_a], ra.slot[row_a], "tensors", ra.dtype[row_a], rb.dtype[row_b], metrics, row_a)

    def _statistics(self, pending: list[tuple[list[TensorDiff], int, int, int]]) -> None:
        ra, rb = self.ra, self.rb
        assert ra.values is not None and rb.values is not None and ra.cells is not None and rb.cells is not None
        rows_a = np.fromiter((p[2] for p in pending), np.int64, len(pending))
        rows_b = np.fromiter((p[3] for p in pending), np.int64, len(pending))
        ia, ib = np.asarray(self.index_a), np.asarray(self.index_b)
        va, vb = ra.values[np.ix_(rows_a, ia)], rb.values[np.ix_(rows_b, ib)]
        ca, cb = ra.cells[np.ix_(rows_a, ia)], rb.cells[np.ix_(rows_b, ib)]
        text_same = np.zeros(va.shape, dtype=bool)
        for r, k in zip(*np.nonzero((ca == TEXT) & (cb == TEXT))):
            text_same[r, k] = ra.raw[rows_a[r]][ia[k]] == rb.raw[rows_b[r]][ib[k]]
        tols = [self.tol(ra.dtype[p[2]], rb.dtype[p[3]]) for p in pending]
        rtol = np.fromiter((t[0] for t in tols), np.float64, len(tols))
        atol = np.fromiter((t[1] for t in tols), np.float64, len(tols))
        found = statistic_metrics_many(self.keys, va, vb, ca, cb, text_same, rtol, atol)
        for (diffs, at, _, _), metrics in zip(pending, found):
            diffs[at] = diffs[at]._replace(metrics=metrics)
