"""Tensor statistics for ``statistic.csv`` and the NaN/Inf check, on the tensor's own device.

Fast path first: one sum decides whether a tensor is all finite (a finite sum means no NaN and no
Inf); exact NaN/Inf counts and finite-only min/max are computed only when that gate fails.  All
requested numbers are stacked and read back in one transfer.  Everything runs under
:func:`obs._core.internal.suppressed`, invisible to obs's hooks.
"""

from __future__ import annotations

import hashlib
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
        t = tensor.detach()
        if bool(torch.isfinite(t.sum())):
            return None
        nan = torch.isnan(t).sum()
        pos = (t == float("inf")).sum()
        neg = (t == float("-inf")).sum()
        counts = torch.stack((nan, pos, neg)).tolist()
    if not any(counts):  # the sum overflowed on large finite values
        return None
    return int(counts[0]), int(counts[1]), int(counts[2])



def statistics(tensor: torch.Tensor, categories: Sequence[str]) -> list[Any]:
    """One value per category, in order; ``None`` for max/min/avg when no element is finite."""
    with suppressed():
        t = tensor.detach()
        if t.is_complex():
            t = t.abs()
        floating = t.is_floating_point()
        n = t.numel()
        need = set(categories)
        values: dict[str, Any] = {}
        numbers: list[torch.Tensor] = []
        names: list[str] = []

        def add(name: str, value: torch.Tensor) -> None:
            names.append(name)
            numbers.append(value.to(torch.float64).reshape(()))

        finite_all = True
        if floating and n:
            finite_all = bool(torch.isfinite(t.sum()))
        base = t
        if not finite_all:
            base = t[torch.isfinite(t)]
        if t.dtype == torch.bool:
            base = base.to(torch.uint8)
        if need & {"max", "min", "avg"}:
            if base.numel():
                if need & {"max", "min"}:
                    lo, hi = torch.aminmax(base)
                    add("max", hi)
                    add("min", lo)
                if "avg" in need:
                    add("avg", base.to(torch.float64).mean())
            else:
                values.update(max=None, min=None, avg=None)
        if "count" in need:
            values["count"] = n
        if need & {"nan count", "positive inf count", "negative inf count"}:
            if finite_all:
                values.update({"nan count": 0, "positive inf count": 0, "negative inf count": 0})
            else:
                add("nan count", torch.isnan(t).sum())
                add("positive inf count", (t == float("inf")).sum())
                add("negative inf count", (t == float("-inf")).sum())
        if need & {"zero count", "positive zero count", "negative zero count"}:
            zero = t == 0
            add("zero count", zero.sum())
            if floating:
                neg = (zero & torch.signbit(t)).sum()
                add("negative zero count", neg)
                add("positive zero count", zero.sum() - neg)
            else:
                values["negative zero count"] = 0
                add("positive zero count", zero.sum())
        if "l2norm" in need:
            add("l2norm", torch.linalg.vector_norm(t.to(torch.float64) if not floating else t).to(torch.float64)
                if n else torch.zeros((), dtype=torch.float64))
        if numbers:
            for name, value in zip(names, torch.stack(numbers).tolist()):
                values[name] = value
        if need & {"md5", "hash:md5", "hash", "hash:sha1"}:
            from obs.dump._tensors import host_array

            raw = host_array(tensor).tobytes()
            values["md5"] = values["hash:md5"] = hashlib.md5(raw).hexdigest()
            values["hash"] = values["hash:sha1"] = hashlib.sha1(raw).hexdigest()
    out = []
    for c in categories:
        v = values.get(c)
        if c in ("count", "nan count", "positive inf count", "negative inf count", "zero count",
                 "positive zero count", "negative zero count") and v is not None:
            v = int(v)
        out.append(v)
    return out
