"""What ``obs monitor plot`` draws, computed from a run read back (pure; :mod:`obs.features.monitor.plot_html` renders).

:func:`build_plot` lays every series kind out as a layer × step heatmap (one per CSV file prefix: ``grad_reduced``,
``param_update``, ``update_ratio``, ``actv``, ``exp_avg``, ...; the statistic ``norm`` where the file has it), the
cells being ``log10 |value|``, and the loss and the global gradient norm as curves; the anomalies of
:func:`~obs.features.monitor.explain.explain` are marked on both.  A long run is binned: at most ``max_columns`` step
columns, each the largest value of its steps (a spike is never averaged away), a non-finite value winning over all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from obs.features.monitor.explain import Explanation, Finding
from obs.features.monitor.reader import MonitorRun, Series

__all__ = ["Curve", "Heatmap", "Mark", "Plot", "build_plot"]

#: heatmaps in the order of a step: forward, backward, the optimizer
_ORDER = ("actv", "actv_grad", "grad_unreduced", "grad_reduced", "param_update", "update_ratio", "exp_avg",
          "exp_avg_sq", "param_origin", "param_updated", "other")
_TITLES = {"actv": "activations", "actv_grad": "activation gradients", "grad_unreduced": "gradients (unreduced)",
           "grad_reduced": "gradients", "param_update": "updates", "update_ratio": "update/weight ratio",
           "exp_avg": "Adam exp_avg", "exp_avg_sq": "Adam exp_avg_sq", "param_origin": "parameters before the step",
           "param_updated": "parameters after the step", "other": "collectives"}
ZERO = -math.inf  #: a cell whose values are all exactly 0 (no logarithm)


@dataclass(frozen=True)
class Mark:
    """An anomaly on a heatmap: its row and column, and its index in :attr:`Plot.anomalies`."""

    row: int
    column: int
    anomaly: int


@dataclass(frozen=True)
class Heatmap:
    """One file prefix's statistic: ``cells[r][c]`` is ``log10 |value|`` of row ``r`` (a tensor, or a module's call)
    over the steps of column ``c`` (the largest; :data:`ZERO` for zeros, NaN for a non-finite value, None for none);
    ``low`` and ``high`` the finite cells' range."""

    prefix: str
    kind: str
    stat: str
    title: str
    rows: list[str]
    columns: list[tuple[int, int]]  #: each column's first and last step
    cells: list[list[float | None]]
    low: float
    high: float
    marks: list[Mark]


@dataclass(frozen=True)
class Curve:
    """A scalar series (the loss, the global gradient norm), binned as the heatmaps' columns (each bin's largest)."""

    name: str
    steps: list[int]
    values: list[float]


@dataclass(frozen=True)
class Plot:
    """Everything the page shows: the explanation's first anomaly and its lead over the loss, the heatmaps, the curves,
    the anomalies (causal order) and the steps that have one."""

    folder: str
    rank: int | None
    first: Finding | None
    loss_step: int | None
    lead_steps: int | None
    heatmaps: list[Heatmap]
    curves: list[Curve]
    anomalies: list[Finding]
    rules: list[str]
    problems: list[str] = field(default_factory=list)

    @property
    def anomaly_steps(self) -> list[int]:
        return sorted({a.step for a in self.anomalies})


def _bins(steps: list[int], max_columns: int) -> list[tuple[int, int]]:
    if not steps:
        return []
    size = max(1, math.ceil(len(steps) / max(1, max_columns)))
    return [(steps[i], steps[min(i + size, len(steps)) - 1]) for i in range(0, len(steps), size)]


def _locate(columns: list[tuple[int, int]], step: int) -> int:
    """The column holding ``step`` (binary search over the columns' first steps)."""
    lo, hi = 0, len(columns) - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if columns[mid][0] <= step:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _log(value: float) -> float:
    if not math.isfinite(value):
        return math.nan
    size = abs(value)
    return math.log10(size) if size > 0 else ZERO


def _bigger(old: float | None, new: float) -> float:
    if old is None or math.isnan(new):
        return new
    if math.isnan(old):
        return old
    return max(old, new)


def _row_key(run: MonitorRun) -> object:
    params = {name: i for i, name in enumerate(run.meta.get("params", []) or [])}
    modules = {name: i for i, name in enumerate(run.meta.get("modules", []) or [])}
    seen: dict[str, int] = {}

    def key(series: Series) -> tuple[int, int, str, int]:
        name = series.name
        if name in params:
            at = params[name]
        else:
            module = name.rpartition(".")[0] if series.kind == "xy" else name
            at = modules.get(module, len(modules) + seen.setdefault(name, len(seen)))
        return (at, 1 if ".output" in name else 0, name, series.micro or 0)

    return key


def _heatmap(prefix: str, series: list[Series], columns: list[tuple[int, int]], findings: list[Finding],
             key: object) -> Heatmap:
    stats = [s.stat for s in series]
    stat = "norm" if "norm" in stats else next(s for s in stats if s != "id")
    chosen = sorted((s for s in series if s.stat == stat), key=key)  # type: ignore[arg-type]
    rows, cells = [], []
    place = {}
    for r, s in enumerate(chosen):
        rows.append(s.name if not s.micro else f"{s.name} (call {s.micro})")
        place[(s.name, s.micro)] = r
        line: list[float | None] = [None] * len(columns)
        for step, value in zip(s.steps, s.values):
            c = _locate(columns, step)
            line[c] = _bigger(line[c], _log(value))
        cells.append(line)
    finite = [v for line in cells for v in line if v is not None and math.isfinite(v)]
    marks = []
    for i, f in enumerate(findings):
        r = place.get((f.name, f.micro_step))
        if f.series == prefix and r is not None:
            marks.append(Mark(r, _locate(columns, f.step), i))
    kind = chosen[0].kind if chosen else ""
    return Heatmap(prefix, kind, stat, _TITLES.get(prefix, prefix), rows, columns, cells,
                   min(finite, default=0.0), max(finite, default=0.0), marks)


def _curve(series: Series | None, columns: list[tuple[int, int]]) -> Curve | None:
    if series is None:
        return None
    by_column: dict[int, tuple[int, float]] = {}
    for step, value in zip(series.steps, series.values):
        c = _locate(columns, step)
        have = by_column.get(c)
        if have is None or math.isnan(value) or (not math.isnan(have[1]) and value > have[1]):
            by_column[c] = (step, value)
    points = [by_column[c] for c in sorted(by_column)]
    return Curve(series.name, [p[0] for p in points], [p[1] for p in points])


def build_plot(run: MonitorRun, explanation: Explanation, *, max_columns: int = 400) -> Plot:
    """The heatmaps and curves of ``run``, its anomalies (``explanation``, of the same run) marked on them."""
    columns = _bins(run.steps, max_columns)
    findings = explanation.anomalies
    by_prefix: dict[str, list[Series]] = {}
    for s in run.series:
        if s.prefix != "scalars" and s.stat != "id":
            by_prefix.setdefault(s.prefix, []).append(s)
    key = _row_key(run)
    order = sorted(by_prefix, key=lambda p: (_ORDER.index(p) if p in _ORDER else len(_ORDER), p))
    heatmaps = [_heatmap(p, by_prefix[p], columns, findings, key) for p in order]
    scalars = {s.name: s for s in run.series if s.prefix == "scalars" and s.stat == "value"}
    curves = [c for c in (_curve(scalars.get("loss"), columns), _curve(scalars.get("grad_norm"), columns)) if c]
    return Plot(explanation.folder, explanation.rank, explanation.first, explanation.loss_step,
                explanation.lead_steps, heatmaps, curves, list(findings), list(explanation.rules),
                list(explanation.problems))
