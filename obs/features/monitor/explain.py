"""What ``obs monitor explain`` and ``obs monitor show`` compute from a run read back (pure; the CLI renders).

:func:`explain` runs the run's own rules (``monitor.json``'s settings, else the defaults) over every series, the
same ones the worker ran while training, and orders the anomalies causally: by step; within a step forward (in
module order, the loss at its end), then backward (in reverse module order, the global gradient norm at its end),
then the collectives (``cc``, by call), then the optimizer (in the optimizer's parameter order).  The first of them
is the series that left its history first.  :func:`movers` picks the series that moved most and lays out their
values per step.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from obs.features.monitor.detect import Detector, Robust, rules_from
from obs.features.monitor.layout import kind_stage
from obs.features.monitor.reader import MonitorRun, Series
from obs.settings.monitor_options import MONITOR_OPTIONS

__all__ = ["Explanation", "Finding", "Mover", "Movers", "explain", "findings", "loss_after", "movers", "movers_window",
           "rules_of", "scores"]

_STAGE = {"forward": 0, "backward": 1, "communication": 2, "optimizer": 3}
_SERIES = {"actv": 0, "grad_unreduced": 1, "grad_reduced": 2, "other": 3, "exp_avg": 4, "exp_avg_sq": 5,
           "update_ratio": 6, "param_update": 7}
_END = 1 << 30


@dataclass(frozen=True)
class Finding:
    """One anomaly: where (step, rank, stage, kind, name, statistic), the value against its baseline, the rule."""

    step: int
    rank: int | None
    name: str
    kind: str
    stat: str
    stage: str
    value: float
    baseline: float
    series: str  #: the CSV file's prefix (grad_reduced, update_ratio, ...)
    micro_step: int | None
    rule: str
    score: float

    def as_dict(self) -> dict[str, Any]:
        return {k: (None if isinstance(v, float) and not math.isfinite(v) and k != "value" else v)
                for k, v in asdict(self).items()}


@dataclass(frozen=True)
class Explanation:
    """The anomalies of a window in causal order; ``first`` is the earliest.  ``loss_step``: the first loss anomaly
    at or after it, and ``lead_steps`` how many steps the first anomaly came before it."""

    folder: str
    rank: int | None
    window: tuple[int, int] | None
    first: Finding | None
    anomalies: list[Finding]
    loss_step: int | None
    lead_steps: int | None
    rules: list[str]
    problems: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"folder": self.folder, "rank": self.rank, "window": list(self.window) if self.window else None,
                "first": self.first.as_dict() if self.first else None,
                "anomalies": [a.as_dict() for a in self.anomalies], "loss_step": self.loss_step,
                "lead_steps": self.lead_steps, "rules": self.rules, "problems": self.problems}


def _setting(run: MonitorRun, key: str) -> Any:
    settings = run.meta.get("settings", {}) if isinstance(run.meta.get("settings"), dict) else {}
    return settings.get(key, MONITOR_OPTIONS[key].default)


def _order(run: MonitorRun) -> Any:
    modules = {name: i for i, name in enumerate(run.meta.get("modules", []) or [])}
    params = {name: i for i, name in enumerate(run.meta.get("params", []) or [])}
    ops = {name: i for i, name in enumerate(run.meta.get("collectives", []) or [])}
    seen: dict[str, int] = {}

    def module_of(series: Series) -> str:
        if series.kind == "xy":
            base, _, side = series.name.rpartition(".")
            return base if side.split("_")[0] in ("input", "output") else series.name
        return series.name.rpartition(".")[0]

    def place(name: str, table: dict[str, int]) -> int:
        if name in table:
            return table[name]
        return len(table) + seen.setdefault(name, len(seen))

    def key(f: Finding, series: Series) -> tuple[Any, ...]:
        stage = _STAGE.get(f.stage, 3)
        if series.prefix == "scalars":
            pos = _END
        elif f.stage == "forward":
            pos = place(module_of(series), modules)
        elif f.stage == "backward":
            pos = -place(module_of(series), modules)
        elif f.stage == "communication":  # the collectives: by call (micro_step), then op in first-call order
            pos = (f.micro_step or 0) * 10_000 + place(series.name.partition("/")[0], ops)
        else:
            pos = place(series.name, params)
        side = 1 if ".output" in series.name or "/post_" in series.name else 0  # a collective's after its before
        return (f.step, stage, pos, _SERIES.get(series.prefix, 9), side, f.micro_step or 0, series.name, f.stat)

    return key


def rules_of(run: MonitorRun) -> list[Any]:
    """The run's own rules (``monitor.json``'s settings, else the defaults)."""
    return rules_from(int(_setting(run, "window")), int(_setting(run, "warmup")), float(_setting(run, "threshold")),
                      _setting(run, "alert") or {})


def findings(run: MonitorRun, *, step: int | None = None, span: int = 20) -> list[tuple[tuple[Any, ...], Finding]]:
    """Every anomaly of ``run`` (of steps ``step - span`` to ``step + span`` with ``step``), unordered, each with its
    causal key within the run: (step, stage, place in the stage, file, input/output, call, name, statistic)."""
    detector = Detector(rules_of(run))
    key = _order(run)
    found: list[tuple[tuple[Any, ...], Finding]] = []
    if run.recorded is not None:
        found = _recorded(run, key, step, span)
    for series in run.series if run.recorded is None else ():
        if series.stat == "id":
            continue
        for s, value in zip(series.steps, series.values):
            verdict = detector.judge((series.prefix, series.name, series.micro, series.stat), value, series.stat)
            if verdict is None or (step is not None and not step - span <= s <= step + span):
                continue
            f = Finding(s, run.rank, series.name, series.kind, series.stat, series.stage, value, verdict.baseline,
                        series.prefix, series.micro, verdict.rule, verdict.score)
            found.append((key(f, series), f))
    return found


def loss_after(anomalies: list[Finding]) -> tuple[int | None, int | None]:
    """The first loss anomaly at or after the first anomaly's step, and how many steps after it."""
    first = anomalies[0] if anomalies else None
    if first is None:
        return None, None
    loss_step = next((f.step for f in anomalies if f.kind == "loss" and f.step >= first.step), None)
    return loss_step, (loss_step - first.step if loss_step is not None else None)


def explain(run: MonitorRun, *, step: int | None = None, span: int = 20) -> Explanation:
    """The anomalies of ``run`` (of steps ``step - span`` to ``step + span`` with ``step``), in causal order."""
    found = findings(run, step=step, span=span)
    found.sort(key=lambda item: item[0])
    anomalies = [f for _, f in found]
    first = anomalies[0] if anomalies else None
    loss_step, lead = loss_after(anomalies)
    window = (step - span, step + span) if step is not None else None
    return Explanation(run.folder, run.rank, window, first, anomalies, loss_step, lead,
                       [r.name for r in rules_of(run)], list(run.problems))


def _recorded(run: MonitorRun, key: Any, step: int | None, span: int) -> list[tuple[tuple[Any, ...], Finding]]:
    """The anomalies the worker flagged while the run went on (a bundle's), with their causal order's keys."""
    by_key = {(s.prefix, s.name, s.micro, s.stat): s for s in run.series}
    out = []
    for a in run.recorded or ():
        if step is not None and not step - span <= a.step <= step + span:
            continue
        kind, stage = kind_stage(a.prefix, a.name)
        series = by_key.get((a.prefix, a.name, a.micro, a.stat)) or Series(a.prefix, a.name, a.micro, a.stat, kind,
                                                                            stage, (), ())
        f = Finding(a.step, run.rank, a.name, kind, a.stat, stage, a.value, a.baseline, a.prefix, a.micro, a.rule,
                    a.score)
        out.append((key(f, series), f))
    return out


@dataclass(frozen=True)
class Mover:
    """A series that moved: its peak robust score over the run and the step of it."""

    name: str
    kind: str
    stat: str
    series: str
    score: float
    peak_step: int
    rank: int | None = None
    micro_step: int | None = None  #: a module's or a collective's call within the step


@dataclass(frozen=True)
class Movers:
    """The series that moved most, and their values at ``steps`` (``values[i][j]``: step i, series j; None: none)."""

    folder: str
    movers: list[Mover]
    steps: list[int]
    values: list[list[float | None]]

    def as_dict(self) -> dict[str, Any]:
        return {"folder": self.folder, "series": [asdict(m) for m in self.movers], "steps": self.steps,
                "values": [[None if v is None or not math.isfinite(v) else v for v in row] for row in self.values]}


def scores(run: MonitorRun) -> list[tuple[float, Series, int]]:
    """Each series' peak robust score (robust standard deviations from the median of its last ``window`` values,
    warm-up left out) and the step of it."""
    scored: list[tuple[float, Series, int]] = []
    window, warmup = int(_setting(run, "window")), int(_setting(run, "warmup"))
    for series in run.series:
        if series.stat == "id":
            continue
        rule = Robust(window, warmup, threshold=-1.0)  # every judged value's score, flagged or not
        state = rule.state()
        best, at = -1.0, series.steps[0]
        for s, v in zip(series.steps, series.values):
            verdict = rule.judge(state, v, series.stat)
            if verdict is not None and verdict.score > best:
                best, at = verdict.score, s
        if best >= 0:
            scored.append((best, series, at))
    return scored


def movers(run: MonitorRun, *, top: int = 6, step: int | None = None, rows: int = 12) -> Movers:
    """The ``top`` series whose values strayed furthest from their history (the robust rule's score: robust standard
    deviations from the median of their last ``window`` values, warm-up left out), and their values over ``rows``
    steps around ``step`` (default: the top series' peak)."""
    scored = scores(run)
    scored.sort(key=lambda item: (-item[0], item[1].name))
    chosen = scored[:top]
    picked = [Mover(s.name, s.kind, s.stat, s.prefix, score, at, run.rank, s.micro) for score, s, at in chosen]
    center = step if step is not None or not chosen else chosen[0][2]
    return movers_window(run.folder, picked, [s for _, s, _ in chosen], run.steps, center, rows)


def movers_window(root: str, picked: list[Mover], series: list[Series], all_steps: list[int], center: int | None,
                  rows: int) -> Movers:
    """The picked series' values over ``rows`` of ``all_steps`` around ``center`` (none without series or steps)."""
    if not series or not all_steps or center is None:
        return Movers(root, picked, [], [])
    at = min(range(len(all_steps)), key=lambda i: abs(all_steps[i] - center))
    lo = max(0, at - rows // 2)
    steps = all_steps[lo:lo + rows]
    lookup = [dict(zip(s.steps, s.values)) for s in series]
    return Movers(root, picked, steps, [[table.get(st) for table in lookup] for st in steps])
