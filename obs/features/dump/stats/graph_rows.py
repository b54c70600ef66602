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
from dataclasses import dataclass, replace
from typing import Any

import torch

from obs.features.graphs.describe import scope_parts

__all__ = ["NONFINITE", "GraphRow", "columns_for", "filled", "graph_rows"]

#: statistic category -> the graph columns it needs (obs.runtime.torch._graph_taps.COLUMNS); not the csv columns
GRAPH_COLUMNS_OF = {"max": ("max",), "min": ("min",), "avg": ("sum", "finite"), "l2norm": ("l2norm",),
                    "nan count": ("nan",), "positive inf count": ("pos_inf",), "negative inf count": ("neg_inf",),
                    "zero count": ("zero",), "count": ()}
NONFINITE = ("nan", "pos_inf", "neg_inf")


def columns_for(categories: Sequence[str]) -> frozenset[str]:
    """The graph columns the data dump's ``categories`` need (others, hashes and signed zeros, stay empty)."""
    return frozenset(c for category in categories for c in GRAPH_COLUMNS_OF.get(category, ()))


@dataclass(frozen=True)
class GraphRow:
    """One tensor of a compiled graph: its scope (without the op), op type, dtype, shape and statistics."""

    scope: str
    op: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    values: dict[str, float]  # graph column -> value

    @property
    def nonfinite(self) -> tuple[int, int, int]:
        return tuple(int(self.values.get(c, 0)) for c in NONFINITE)  # type: ignore[return-value]

    def statistics(self, categories: Sequence[str]) -> list[Any]:
        """The values of ``categories`` (None where a graph does not compute one: hashes, signed zeros; and max,
        min, avg of a tensor with no finite element)."""
        v = self.values
        out: list[Any] = []
        for c in categories:
            if c == "max":
                out.append(v["max"] if math.isfinite(v["max"]) else None)
            elif c == "min":
                out.append(v["min"] if math.isfinite(v["min"]) else None)
            elif c == "avg":
                out.append(v["sum"] / v["finite"] if v["finite"] else None)
            elif c == "count":
                out.append(math.prod(self.shape))
            elif c in GRAPH_COLUMNS_OF and GRAPH_COLUMNS_OF[c][0] in v:
                value = v[GRAPH_COLUMNS_OF[c][0]]
                out.append(value if c == "l2norm" else int(value))
            else:
                out.append(None)
        return out


def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, name.removeprefix("torch."), None)
    return value if isinstance(value, torch.dtype) else torch.float32


def graph_rows(spec: dict[str, Any], rows: Sequence[Sequence[float]] | None, root: str, keep_class: bool,
               classes: dict[str, str] | None = None) -> list[GraphRow]:
    """The rows of one graph run; ``root`` is the scope of the module that ran it (``Default/net-Net``);
    ``classes`` (qualified name -> class of its submodules) names containers as eager scopes do.  ``rows`` None:
    values still on their device; each row has none yet (:func:`filled` gives its statistics once read)."""
    prefix = ("Gradients/" if spec.get("backward") else "") + (root or "Default")
    out = []
    columns = spec.get("columns", ())
    for entry, values in zip(spec["rows"], rows if rows is not None else [()] * len(spec["rows"])):
        cells = scope_parts(dict(enumerate(entry["stack"])), "root", keep_class, classes)[1:]  # the root: `root`
        scope = "/".join([prefix, *cells])
        shape = tuple(int(d) if str(d).isdigit() else 0 for d in entry["shape"])
        out.append(GraphRow(scope, str(entry["op"]), _dtype(str(entry["dtype"])), shape, dict(zip(columns, values))))
    return out


def filled(row: GraphRow, columns: Sequence[str], categories: Sequence[str], values: Sequence[float]) -> list[Any]:
    """:meth:`GraphRow.statistics` of ``row`` made without values, once its ``values`` (one per graph column of
    ``columns``) are read back."""
    return replace(row, values=dict(zip(columns, values))).statistics(categories)
