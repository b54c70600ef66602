"""Anomaly rules over one series of values, step by step: the robust default and msprobe's two rules.

No torch: the monitor's worker thread runs them as values arrive, and ``obs monitor explain`` runs
the same ones over the CSV files, so both see the same anomalies.

* :class:`Robust` (the default): the median and the MAD of the last ``window`` values; a value further than
  ``threshold`` robust standard deviations (1.4826 x MAD) from the median is flagged, above or below.  A series'
  first ``warmup`` values are not judged.  The scale never falls below 5% of the median's size, so a series that
  barely moves (a constant count) is not flagged for noise; a NaN or an infinity after finite values always is.
* :class:`Turbulence` (msprobe's ``AnomalyTurbulence``): the baseline is the running mean of ``|value|`` (an
  exponential one, beta 0.99, started at the first value); a value whose size is above ``baseline x (1 +
  threshold)`` is flagged.  Upward only, and for the ``norm`` and ``mean`` statistics only, as msprobe does.
* :class:`NanRule` (msprobe's ``AnomalyNan``): a NaN, or a size above ``threshold`` when one is given.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass
from typing import Any

from obs._core import native

__all__ = ["EXTENSION", "Detector", "NanRule", "Robust", "Turbulence", "Verdict", "rules_from"]

_MAD_SIGMA = 1.4826  # MAD x this is the standard deviation of a normal distribution
_REL_FLOOR = 0.05
_ABS_FLOOR = 1e-12

#: the robust rule over many series in C (``_robust.c``; the Python rule is its reference)
EXTENSION = native.Installed("obs.features.monitor._robust", "STATS")


@dataclass(frozen=True)
class Verdict:
    """A value a rule flagged: the rule, the baseline it was judged against, and how far off (in the rule's unit)."""

    rule: str
    baseline: float
    score: float


class Robust:
    """Median and MAD of the last ``window`` values, both directions, ``warmup`` values ignored."""

    name = "robust"

    def __init__(self, window: int = 50, warmup: int = 20, threshold: float = 10.0) -> None:
        self.window, self.warmup, self.threshold = window, warmup, threshold

    def state(self) -> Any:
        return [deque(), [], 0]  # the window in arrival order, the same values sorted, values seen

    def judge(self, state: Any, value: float, stat: str) -> Verdict | None:
        arrived, ordered, seen = state
        state[2] = seen + 1
        verdict = None
        if seen >= self.warmup and len(ordered) >= 3:
            median = _median(ordered)
            if not math.isfinite(value):
                verdict = Verdict(self.name, median, math.inf)
            else:
                off = abs(value - median)
                floor = max(_REL_FLOOR * abs(median), _ABS_FLOOR)
                if off > self.threshold * floor:  # else within the floor's reach: no need of the MAD
                    scale = max(_MAD_SIGMA * _mad(ordered, median), floor)
                    if off / scale > self.threshold:
                        verdict = Verdict(self.name, median, off / scale)
        if math.isfinite(value):
            if len(arrived) == self.window:
                del ordered[bisect.bisect_left(ordered, arrived.popleft())]
            arrived.append(value)
            bisect.insort(ordered, value)
        return verdict


class Turbulence:
    """msprobe's AnomalyTurbulence: above the running mean of sizes by more than ``threshold`` of it."""

    name = "AnomalyTurbulence"
    beta = 0.99

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold

    def state(self) -> Any:
        return [None]

    def judge(self, state: Any, value: float, stat: str) -> Verdict | None:
        if math.isnan(value):
            return None
        size = abs(value)
        avg = state[0] if state[0] is not None else size
        state[0] = self.beta * avg + (1 - self.beta) * size
        if stat not in ("norm", "mean") or size <= avg * (1 + self.threshold):
            return None
        return Verdict(self.name, avg, size / avg if avg else math.inf)


class NanRule:
    """msprobe's AnomalyNan: a NaN, or (with a threshold) a size above it."""

    name = "AnomalyNan"

    def __init__(self, threshold: float | None = None) -> None:
        self.threshold = threshold

    def state(self) -> Any:
        return None

    def judge(self, state: Any, value: float, stat: str) -> Verdict | None:
        if math.isnan(value):
            return Verdict(self.name, math.nan, math.inf)
        if self.threshold is not None and abs(value) > self.threshold:
            return Verdict(self.name, self.threshold, abs(value) / self.threshold if self.threshold else math.inf)
        return None


def rules_from(window: int, warmup: int, threshold: float, alert: dict[str, Any]) -> list[Any]:
    """The robust rule, then msprobe's ``alert.rules`` in their order (validated by the settings)."""
    rules: list[Any] = [Robust(window, warmup, threshold)]
    for spec in alert.get("rules", []) or []:
        args = spec.get("args") or {}
        if spec.get("rule_name") == "AnomalyTurbulence":
            rules.append(Turbulence(float(args["threshold"])))
        elif spec.get("rule_name") == "AnomalyNan":
            rules.append(NanRule(float(args["threshold"]) if "threshold" in args else None))
    return rules


class Detector:
    """Every series' state under the same rules; :meth:`judge` returns the first rule's verdict, or None.

    With the robust rule alone (the default) and the native module built, the states live in its C ``Bank``: one
    call judges a whole step (:meth:`judge_many`), with the Python rule's arithmetic.  ``native=False`` keeps them in
    Python; either way :meth:`judge` and :meth:`judge_many` share them."""

    def __init__(self, rules: list[Any], *, native: bool = True) -> None:
        self.rules = rules
        self._index: dict[Any, int] = {}
        self._states: list[list[Any]] = []
        self._bank: Any = None
        if native and len(rules) == 1 and type(rules[0]) is Robust:
            lib = EXTENSION.load()
            if lib is not None:
                rule = rules[0]
                self._bank = lib.Bank(rule.window, rule.warmup, float(rule.threshold))

    def indices(self, keys: Any) -> tuple[int, ...]:
        """Each series' index for :meth:`judge_many` (a new series gets the next one)."""
        index = self._index
        return tuple(index.setdefault(key, len(index)) for key in keys)

    def judge(self, key: Any, value: float, stat: str) -> Verdict | None:
        found = self.judge_many(self.indices((key,)), (value,), (stat,))
        return found[0][1] if found else None

    def judge_many(self, indices: tuple[int, ...], values: Any, stats: Any) -> list[tuple[int, Verdict]]:
        """Each value as the next of the series at the same place in ``indices``: ``(position, verdict)`` of the
        flagged ones, in order.  ``stats``: each value's statistic (msprobe's rules judge only some)."""
        if self._bank is not None:
            name = self.rules[0].name
            return [(at, Verdict(name, baseline, score)) for at, baseline, score in self._bank.judge(indices, values)]
        states, rules, found = self._states, self.rules, []
        while len(states) < len(self._index):
            states.append([rule.state() for rule in rules])
        for at, (i, value, stat) in enumerate(zip(indices, values, stats)):
            first = None
            for rule, state in zip(rules, states[i]):  # every rule sees every value: their histories stay whole
                verdict = rule.judge(state, value, stat)
                if first is None:
                    first = verdict
            if first is not None:
                found.append((at, first))
        return found


def _mad(ordered: list[float], median: float) -> float:
    """The median of ``|v - median|`` over a sorted list, merging its two halves outwards from the median."""
    n = len(ordered)
    hi = bisect.bisect_left(ordered, median)
    lo = hi - 1
    want = n // 2  # 0-based rank of the (upper) middle deviation
    taken, last, before = 0, 0.0, 0.0
    while taken <= want:
        before = last
        if lo >= 0 and (hi >= n or median - ordered[lo] <= ordered[hi] - median):
            last = median - ordered[lo]
            lo -= 1
        else:
            last = ordered[hi] - median
            hi += 1
        taken += 1
    return last if n % 2 else (before + last) / 2


def _median(ordered: list[float]) -> float:
    n = len(ordered)
    mid = n // 2
    return ordered[mid] if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2
