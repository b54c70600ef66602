"""A packet's layout, compiled once for the worker: which values a step writes and judges, in which order, and each
CSV file's rows as one format string.

A training step's packet has the same blocks step after step (the same row tuples, the same statistics), so what the
worker did per value (derive the update, ratio and total rows, name each series, format each row's fixed cells) is
done once per layout; a step is then a few list operations, one rule call (:meth:`Detector.judge_many`) and one
``str.format`` per file.

Order (the order values are judged, anomalies listed and rows written): the blocks written as they are, in
:data:`WRITTEN`'s order; then the rows derived from the norms' inputs: ``grad_reduced`` from ``_gnorm`` and
``param_update`` from ``_unorm`` (each sample's norm times its scale) when the packet does not hold them already,
``update_ratio`` (``_unorm / _wnorm``, NaN for a parameter at zero), the ``scalars`` ``grad_norm`` (the root of the
sum of ``_gnorm``'s squares) and ``loss`` (``_loss``, unless a loss comes through ``obs.scalar``).
"""

from __future__ import annotations

import math
from typing import Any

from obs.features.monitor.layout import columns, is_micro

__all__ = ["WRITTEN", "StepPlan", "cell", "layout_key", "same_rows"]

WRITTEN = ("actv", "grad_unreduced", "grad_reduced", "other", "exp_avg", "exp_avg_sq", "param_update")

Key = tuple[str, str, "int | None", str]  # (prefix, name, micro, stat)


def cell(text: str) -> str:
    """A CSV cell as msprobe's pandas writes it: quoted when it holds a comma, a quote or a line break."""
    if any(c in text for c in ',"\n\r'):
        return '"' + text.replace('"', '""') + '"'
    return text


def layout_key(blocks: Any, loss_from_scalar: bool) -> tuple[Any, ...]:
    """What identifies a layout: each block's prefix, rows (by identity: the plan holds them) and statistics."""
    return (loss_from_scalar, *[(b.prefix, id(b.rows), b.stats, b.scales) for b in blocks])


def same_rows(rows: Any, last: tuple[Any, ...]) -> tuple[Any, ...]:
    """A step's rows as a tuple: ``last`` (the step before's) itself when they are the same, so that the layout the
    worker knows by the rows' identity (:func:`layout_key`) is compiled once."""
    rows = tuple(rows)
    return last if rows == last else rows


def _braced(text: str) -> str:
    return text.replace("{", "{{").replace("}", "}}")


class StepPlan:
    """One layout's step: :meth:`values` (every written value, in order) and :meth:`lines` (each file's rows).

    ``keys[i]`` is ``values(...)[i]``'s series; ``judged`` the positions judged (all but ``id`` statistics) and
    ``indices`` their series' detector indices; ``files`` each file's ``(prefix, header, template)``."""

    def __init__(self, blocks: Any, loss_from_scalar: bool, ndigits: int, detector: Any) -> None:
        self.blocks = list(blocks)  # held: the layout key names their rows by identity
        tables: dict[str, tuple[Any, int, int]] = {}
        at = 0
        for block in blocks:
            tables[block.prefix] = (block, at, at + block.size)
            at += block.size
        self.size = at
        #: how to take each group of values from the packet's: (kind, prefix, rows, stats, source...)
        self._groups: list[tuple[Any, ...]] = []
        for prefix in WRITTEN:
            if prefix in tables:
                block, start, end = tables[prefix]
                self._groups.append(("slice", prefix, block.rows, block.stats, start, end))
        if "grad_reduced" not in tables and "_gnorm" in tables:
            block, start, end = tables["_gnorm"]
            self._groups.append(("slice", "grad_reduced", block.rows, block.stats, start, end))
        if "param_update" not in tables and "_unorm" in tables:
            block, start, end = tables["_unorm"]
            kind = "scaled" if block.scales is not None else "slice"
            self._groups.append((kind, "param_update", block.rows, block.stats, start, end, block.scales))
        if "_unorm" in tables and "_wnorm" in tables:
            block, start, end = tables["_unorm"]
            self._groups.append(("ratio", "update_ratio", block.rows, ("ratio",), start, end, tables["_wnorm"][1]))
        if "_gnorm" in tables:
            _, start, end = tables["_gnorm"]
            self._groups.append(("total", "scalars", (("grad_norm", None, "", ""),), ("value",), start, end))
        if "_loss" in tables and not loss_from_scalar:
            _, start, end = tables["_loss"]
            self._groups.append(("slice", "scalars", (("loss", None, "", ""),), ("value",), start, end))
        self.keys: list[Key] = [(group[1], name, micro, stat) for group in self._groups
                                for name, micro, _, _ in group[2] for stat in group[3]]
        self.judged = [i for i, key in enumerate(self.keys) if key[3] != "id"]
        self.all_judged = len(self.judged) == len(self.keys)
        self.indices = detector.indices([self.keys[i] for i in self.judged])
        self.stats = tuple(self.keys[i][3] for i in self.judged)
        self.files = self._templates(ndigits)

    def _templates(self, ndigits: int) -> list[tuple[str, list[str], str]]:
        """Each file's rows as one format string over ``(step, *values)``, files in the order their rows come."""
        rows: dict[tuple[str, tuple[str, ...]], list[str]] = {}
        at = 0
        for group in self._groups:
            prefix, stats = group[1], group[3]
            tail = prefix not in ("update_ratio", "scalars")
            for name, micro, shape, dtype in group[2]:
                fields = ",".join(f"{{{at + 1 + k}:.{ndigits}g}}" for k in range(len(stats)))
                at += len(stats)
                rows.setdefault((prefix, stats), []).append(
                    "0," + _braced(cell(name)) + ",{0}" + ("," + str(micro) if is_micro(prefix) else "") + ","
                    + fields + ("," + _braced(cell(shape)) + "," + _braced(cell(dtype)) if tail else "") + "\n")
        return [(prefix, columns(prefix, list(stats)), "".join(lines)) for (prefix, stats), lines in rows.items()]

    def values(self, values: list[float]) -> list[float]:
        """Every written value of a step, in :attr:`keys`' order, from the packet's flat values."""
        out: list[float] = []
        for group in self._groups:
            kind, start, end = group[0], group[4], group[5]
            if kind == "slice":
                out += values[start:end]
            elif kind == "scaled":
                out += [v * f for v, f in zip(values[start:end], group[6])]
            elif kind == "ratio":
                w = group[6]
                # a parameter at zero (a bias at its start): no ratio
                out += [u / values[w + i] if values[w + i] > 0 else math.nan
                        for i, u in enumerate(values[start:end])]
            else:  # total
                norms = values[start:end]
                out.append(math.sqrt(math.fsum(g * g for g in norms)) if norms else math.nan)
        return out

    def lines(self, step: int, written: list[float]) -> list[tuple[str, list[str], str]]:
        """Each file's ``(prefix, header, rows)`` for one step."""
        return [(prefix, header, template.format(step, *written)) for prefix, header, template in self.files]
