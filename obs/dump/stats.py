"""Tensor statistics for ``statistic.csv`` and the NaN/Inf check, on the tensor's own device.

Fast path first: one sum decides whether a tensor is all finite (a finite sum means no NaN and no
Inf); exact NaN/Inf counts and finite-only min/max are computed only when that gate fails.  All
requested numbers are stacked and read back in one transfer.  Everything runs under
:func:`obs._core.internal.suppressed`, invisible to obs's hooks.
"""

from __future__ import annotations

import cmath
import hashlib
import math
from collections.abc import Sequence
from typing import Any

import torch

from obs._core.internal import suppressed

__all__ = ["FIXED_COLUMNS", "csv_header", "nonfinite_counts", "statistics"]

#: statistic.csv's fixed columns, byte for byte as the original writes them
FIXED_COLUMNS = ("Op Type", "Op Name", "Task ID", "Stream ID", "Timestamp", "IO", "Slot", "Data Size", "Data Type",
                 "Shape")


def csv_header(categories: Sequence[str]) -> str:
    """The header line (without newline): the 10 fixed columns, then one per category in the user's order."""
    from obs.dump.config import CATEGORY_COLUMNS

    return ",".join(FIXED_COLUMNS + tuple(CATEGORY_COLUMNS[c] for c in categories))


def nonfinite_counts(tensor: torch.Tensor) -> tuple[int, int, int] | None:
    """None when every element is finite (the sum gate), else exact ``(nan, +inf, -inf)`` counts."""
    if not (tensor.is_floating_point() or tensor.is_complex()) or tensor.numel() == 0:
        return None
    with suppressed():
        t, _ = _unexpanded(tensor.detach())
        total = t.sum().item()
        if not isinstance(total, complex) and math.isfinite(total) or isinstance(total, complex) and \
                cmath.isfinite(total):
            return None
        t = tensor.detach()
        nan = torch.isnan(t).sum()
        pos = (t == float("inf")).sum()
        neg = (t == float("-inf")).sum()
        counts = torch.stack((nan, pos, neg)).tolist()
    if not any(counts):  # the sum overflowed on large finite values
        return None
    return int(counts[0]), int(counts[1]), int(counts[2])


def _unexpanded(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """An expanded tensor's distinct elements and how often each repeats (reductions over stride-0 views are
    very slow on CPU: 17-43 ms for a 500k-element expand, against 0.05 ms for the same data contiguous)."""
    repeat = 1
    for dim, (size, stride) in enumerate(zip(t.shape, t.stride())):
        if stride == 0 and size > 1:
            t = t.narrow(dim, 0, 1)
            repeat *= size
    return t, repeat


_COUNTS = ("nan count", "positive inf count", "negative inf count")
_ZEROS = ("zero count", "positive zero count", "negative zero count")
_HASHES = ("md5", "hash:md5", "hash", "hash:sha1")


def statistics(tensor: torch.Tensor, categories: Sequence[str]) -> list[Any]:
    """One value per category, in order; ``None`` for max/min/avg when no element is finite.

    Stage one reads back, in one transfer, what every tensor needs (min and max in one pass, the sum
    or the norm) plus a gate; only a tensor whose gate is not finite pays stage two: exact NaN/Inf
    counts and min/max/avg over its finite elements.
    """
    need = set(categories)
    with suppressed():
        t = tensor.detach()
        if t.is_complex():
            t = t.abs()
        if t.dtype == torch.bool:
            t = t.to(torch.uint8)
        n = t.numel()
        t, repeat = _unexpanded(t)
        floating = t.is_floating_point()
        values: dict[str, Any] = {"count": n}
        names: list[str] = []
        parts: list[torch.Tensor] = []

        def add(name: str, value: torch.Tensor) -> None:
            names.append(name)
            parts.append(value)

        if n:
            if need & {"max", "min"}:
                # aminmax is one pass over contiguous memory but slow on permuted views, where amax/amin are not
                lo, hi = torch.aminmax(t) if t.is_contiguous() else (t.amin(), t.amax())
                add("min", lo)
                add("max", hi)
            if "avg" in need or not (need & {"max", "min", "l2norm"}) and floating:
                add("sum", t.sum(dtype=torch.float64) if not floating else t.sum())
            if "l2norm" in need:
                add("l2norm", torch.linalg.vector_norm(t if floating else t.to(torch.float64)))
            if need.intersection(_ZEROS):
                zero = t == 0
                add("zero count", zero.sum())
                if floating:
                    add("negative zero count", (zero & torch.signbit(t)).sum())
        if parts and any(p.dtype != parts[0].dtype for p in parts):  # one stack, one read-back: one dtype
            parts = [p.to(torch.float64) for p in parts]
        read = dict(zip(names, torch.stack(parts).tolist())) if parts else {}
        if repeat > 1:  # the values of an expanded tensor, repeated
            for key in ("sum", "zero count", "negative zero count"):
                if key in read:
                    read[key] *= repeat
            if "l2norm" in read:
                read["l2norm"] *= math.sqrt(repeat)
        finite = not floating or not n or all(math.isfinite(read[k]) for k in ("min", "max", "sum", "l2norm")
                                              if k in read)
        if finite:
            values.update({k: 0 for k in _COUNTS})
            if n:
                values.update(max=read.get("max"), min=read.get("min"),
                              avg=read["sum"] / n if "sum" in read else None)
            else:
                values.update(max=None, min=None, avg=None)
        else:  # stage two: exact counts, and min/max/avg over the finite elements
            mask = torch.isfinite(t)
            kept = t[mask]
            exact = [torch.isnan(t).sum(), (t == float("inf")).sum(), (t == float("-inf")).sum()]
            if kept.numel():
                lo, hi = torch.aminmax(kept)
                exact += [lo, hi, kept.sum()]
            got = torch.stack([v.to(torch.float64) for v in exact]).tolist()
            values.update(zip(_COUNTS, (c * repeat for c in got[:3])))
            values.update(min=got[3], max=got[4], avg=got[5] / len(kept)) if kept.numel() else \
                values.update(min=None, max=None, avg=None)
        values["l2norm"] = read.get("l2norm", 0.0)
        if "zero count" in read:
            values["zero count"] = read["zero count"]
            values["negative zero count"] = read.get("negative zero count", 0)
            values["positive zero count"] = read["zero count"] - values["negative zero count"]
        if not n:
            values.update({k: 0 for k in _ZEROS})
        if need.intersection(_HASHES):
            from obs.dump._tensors import host_array

            raw = host_array(tensor).tobytes()
            values["md5"] = values["hash:md5"] = hashlib.md5(raw).hexdigest()
            values["hash"] = values["hash:sha1"] = hashlib.sha1(raw).hexdigest()
    out = []
    for c in categories:
        v = values.get(c)
        if v is not None and (c in _COUNTS or c in _ZEROS or c == "count"):
            v = int(v)
        out.append(v)
    return out
