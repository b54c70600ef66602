"""GRAPH_STATS rows (statistics an Inductor-compiled graph computed of its own tensors) as the dump names them.

A row's op is named as an eager op of the same module would be: the scope of the compiled module that ran
the graph (``Default/net-Net``, ``Gradients/...`` for a backward graph), the module path Dynamo recorded
for the node (``fc1-Linear``), then the op type and its index in the step (``Addmm-op3``).  Its values
are the data dump's statistic categories, computed from the graph's reductions (finite elements for max,
min and avg, as the eager dump reports a tensor holding NaN or Inf).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from obs.features.graphs.describe import scope_parts

__all__ = ["GraphRow", "graph_rows"]

_COUNTS = {"nan count": 4, "positive inf count": 5, "negative inf count": 6, "zero count": 7}


@dataclass(frozen=True)
class GraphRow:
    """One tensor of a compiled graph: its scope (without the op), op type, dtype, shape and statistics."""

    scope: str
    op: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    values: Sequence[float]  # max, min, sum, l2norm, nan, +inf, -inf, zero (obs.runtime.torch._graph_taps.COLUMNS)

    @property
    def nonfinite(self) -> tuple[int, int, int]:
        return int(self.values[4]), int(self.values[5]), int(self.values[6])

    def statistics(self, categories: Sequence[str]) -> list[Any]:
        """The values of ``categories`` (None where a graph does not compute one: hashes, signed zeros)."""
        count = math.prod(self.shape)
        finite = count - sum(self.nonfinite)
        out: list[Any] = []
        for c in categories:
            if c == "max":
                out.append(self.values[0] if finite else None)
            elif c == "min":
                out.append(self.values[1] if finite else None)
            elif c == "avg":
                out.append(self.values[2] / finite if finite else None)
            elif c == "l2norm":
                out.append(self.values[3])
            elif c == "count":
                out.append(count)
            elif c in _COUNTS:
                out.append(int(self.values[_COUNTS[c]]))
            else:
                out.append(None)
        return out


def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, name.removeprefix("torch."), None)
    return value if isinstance(value, torch.dtype) else torch.float32


def graph_rows(spec: dict[str, Any], rows: Sequence[Sequence[float]], root: str, keep_class: bool) -> list[GraphRow]:
    """The rows of one graph run; ``root`` is the scope of the module that ran it (``Default/net-Net``)."""
    prefix = ("Gradients/" if spec.get("backward") else "") + (root or "Default")
    out = []
    for entry, values in zip(spec["rows"], rows):
        cells = scope_parts(dict(enumerate(entry["stack"])), "root", keep_class)[1:]  # the root is `root`
        scope = "/".join([prefix, *cells])
        shape = tuple(int(d) if str(d).isdigit() else 0 for d in entry["shape"])
        out.append(GraphRow(scope, str(entry["op"]), _dtype(str(entry["dtype"])), shape, values))
    return out
