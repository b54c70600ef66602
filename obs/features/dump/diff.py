"""Compare two dumps (two seeds, two versions, CPU against GPU) and find the first op that diverges.

Steps are matched by rank and iteration; within a step, ops are walked in A's execution order and
matched by (op name, IO, slot).  With ``statistic.csv`` on both sides the statistics they share are
compared; otherwise the tensors themselves (loaded one pair at a time).  Two numbers agree when
``|a - b| <= atol + rtol * |b|`` (NaN agrees with NaN, ``null`` with ``null``).  Pure: readers in,
a :class:`DiffResult` out.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from obs.features.dump.reader import DumpReader, StatRow, Step, TensorFile

__all__ = ["DiffResult", "Divergence", "diff_dumps"]


@dataclass(frozen=True)
class Divergence:
    """Where A and B first disagree: the op, which tensor, what differs."""

    rank: int
    iteration: int
    index: int  #: position of the op's row in A's step (execution order)
    op_type: str
    op_name: str
    io: str
    slot: int
    what: str  #: the statistic ("max", "l2norm"), "values", "shape", "dtype" or "missing"
    a: Any
    b: Any


@dataclass(frozen=True)
class DiffResult:
    compared: int  #: tensors compared
    steps: list[tuple[int, int]]  #: (rank, iteration) compared
    only_in_a: list[tuple[int, int]]
    only_in_b: list[tuple[int, int]]
    mode: str  #: "statistics" or "tensors"
    first: Divergence | None


def _close(a: Any, b: Any, rtol: float, atol: float) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    a, b = float(a), float(b)
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= atol + rtol * abs(b)


def _steps(reader: DumpReader) -> dict[tuple[int, int], Step]:
    out: dict[tuple[int, int], Step] = {}
    for step in reader.steps():
        out.setdefault((step.rank, step.iteration), step)
    return out


def diff_dumps(a: DumpReader, b: DumpReader, *, rtol: float = 1e-5, atol: float = 1e-8,
               iterations: list[int] | None = None,
               progress: Callable[[int, int], None] | None = None) -> DiffResult:
    """The first op whose statistics (or values) differ beyond the tolerance, in execution order."""
    sa, sb = _steps(a), _steps(b)
    keys = sorted(k for k in sa if k in sb and (iterations is None or k[1] in iterations))
    stats = all(any(True for _ in a.statistics(sa[k])) and any(True for _ in b.statistics(sb[k])) for k in keys)
    mode = "statistics" if keys and stats else "tensors"
    compared, first = 0, None
    total = len(keys)
    for n, key in enumerate(keys):
        if mode == "statistics":
            done, first = _diff_rows(list(a.statistics(sa[key])), list(b.statistics(sb[key])), key, rtol, atol)
        else:
            done, first = _diff_tensors(list(a.tensors(sa[key])), list(b.tensors(sb[key])), key, rtol, atol)
        compared += done
        if progress is not None:
            progress(n + 1, total)
        if first is not None:
            break
    return DiffResult(compared, keys, sorted(k for k in sa if k not in sb), sorted(k for k in sb if k not in sa),
                      mode, first)


def _walk(items_a: list[Any], items_b: list[Any], key: tuple[int, int],
          compare: Callable[[Any, Any], tuple[str, Any, Any] | None]) -> tuple[int, Divergence | None]:
    """A's items in order, each matched with B's by (op name, IO, slot); the first ``compare`` objects to."""
    index_b = {(t.op_name, t.io, t.slot): t for t in items_b}
    for i, a in enumerate(items_a):
        b = index_b.get((a.op_name, a.io, a.slot))
        found = ("missing", "present", "absent") if b is None else compare(a, b)
        if found is not None:
            return i, Divergence(key[0], key[1], i, a.op_type, a.op_name, a.io, a.slot, *found)
    return len(items_a), None


def _diff_rows(rows_a: list[StatRow], rows_b: list[StatRow], key: tuple[int, int], rtol: float,
               atol: float) -> tuple[int, Divergence | None]:
    def compare(ra: StatRow, rb: StatRow) -> tuple[str, Any, Any] | None:
        if ra.shape != rb.shape:
            return "shape", ra.shape, rb.shape
        for stat, va in ra.stats.items():
            if stat in rb.stats and not _close(va, rb.stats[stat], rtol, atol):
                return stat, va, rb.stats[stat]
        return None
    return _walk(rows_a, rows_b, key, compare)


def _diff_tensors(files_a: list[TensorFile], files_b: list[TensorFile], key: tuple[int, int], rtol: float,
                  atol: float) -> tuple[int, Divergence | None]:
    def compare(ta: TensorFile, tb: TensorFile) -> tuple[str, Any, Any] | None:
        if ta.dtype != tb.dtype:
            return "dtype", ta.dtype, tb.dtype
        xa, xb = ta.load(), tb.load()
        if xa.shape != xb.shape:
            return "shape", xa.shape, xb.shape
        if xa.dtype.kind in "fc" or xb.dtype.kind in "fc":
            same = np.allclose(xa, xb, rtol=rtol, atol=atol, equal_nan=True)
        else:
            same = np.array_equal(xa, xb)
        if same:
            return None
        with np.errstate(invalid="ignore"):
            gap = np.nanmax(np.abs(xa.astype(np.float64) - xb.astype(np.float64))) if xa.size else 0.0
        return "values", f"max |a-b| = {float(gap):.6g}", f"rtol={rtol}, atol={atol}"
    return _walk(files_a, files_b, key, compare)
