"""What a trace says in numbers: step time percentiles, the phase breakdown, top modules and ops by total and
self time, span, aggregation and drop counts.  Pure: spans in, a :class:`TraceSummary` dataclass out.

Self time of a module is its duration less that of its child spans (modules and ops); an op is a
leaf.  Ops and phases aggregated into a parent's attributes (``ml.ops.*``, ``ml.phases.*``) count in the
totals too.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from exporters.spans import Span

__all__ = ["SummaryBuilder", "Timing", "TraceSummary", "percentile", "summarize"]

TOP = 10


@dataclass(frozen=True)
class Timing:
    name: str
    count: int
    total_ms: float
    self_ms: float
    share: float = 0.0  #: of all steps' time (phases)


@dataclass
class TraceSummary:
    steps: int
    incomplete_steps: int
    step_ms: dict[str, float]  #: p50, p90, p99, max, mean
    phases: list[Timing]
    modules: list[Timing]
    ops: list[Timing]
    spans: int
    aggregated: int
    dropped: int
    dropped_detail: dict[str, int] = field(default_factory=dict)
    endpoint: str = ""
    sources: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile ``q`` (0-100) of ``values`` (0.0 when empty)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    at = (len(ordered) - 1) * q / 100
    lo = int(at)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (at - lo)


class SummaryBuilder:
    """Accumulates spans (a step's at a time, or in any order) into totals."""

    def __init__(self) -> None:
        self.step_ms: list[float] = []
        self.incomplete = 0
        self.spans = 0
        self.aggregated = 0
        self._timings: dict[str, dict[str, list[float]]] = {k: defaultdict(lambda: [0, 0.0, 0.0])
                                                             for k in ("phase", "module", "op")}

    def add(self, spans: Iterable[Span]) -> None:
        spans = list(spans)
        child_ns: dict[int, int] = defaultdict(int)
        for s in spans:
            if s.parent_id and s.kind in ("module", "op"):
                child_ns[s.parent_id] += s.duration_ns
        for s in spans:
            self.spans += 1
            if s.kind == "step":
                self.step_ms.append(s.duration_ns / 1e6)
                self.incomplete += bool(s.attributes.get("ml.step.incomplete"))
                self.aggregated += int(s.attributes.get("obs.spans.aggregated", 0) or 0)
            elif s.kind in self._timings:
                key = str(s.attributes.get("ml.module.scope", s.name)) if s.kind == "module" else s.name
                row = self._timings[s.kind][key]
                row[0] += 1
                row[1] += s.duration_ns / 1e6
                row[2] += max(0, s.duration_ns - child_ns.get(s.span_id, 0)) / 1e6
            self._add_aggregated(s.attributes, "ml.ops", "op")
            self._add_aggregated(s.attributes, "ml.phases", "phase")

    def _add_aggregated(self, attrs: Mapping[str, Any], prefix: str, kind: str) -> None:
        """Spans aggregated into a parent: ``{prefix}.names`` / ``.counts`` / ``.total_ns`` arrays."""
        names, counts, totals = (attrs.get(f"{prefix}.{k}") for k in ("names", "counts", "total_ns"))
        if not (isinstance(names, (list, tuple)) and isinstance(counts, (list, tuple))
                and isinstance(totals, (list, tuple))):
            return
        for name, count, total in zip(names, counts, totals):
            row = self._timings[kind][str(name)]
            row[0] += int(count)
            row[1] += float(total) / 1e6
            row[2] += float(total) / 1e6

    def result(self, *, dropped: Mapping[str, int] | None = None, endpoint: str = "",
               sources: list[str] | None = None) -> TraceSummary:
        steps_total = sum(self.step_ms) or 1.0

        def rows(kind: str, by: int, top: int | None) -> list[Timing]:
            items = sorted(self._timings[kind].items(), key=lambda kv: -kv[1][by])
            return [Timing(name, int(v[0]), round(v[1], 4), round(v[2], 4),
                           round(v[1] / steps_total, 4) if kind == "phase" else 0.0)
                    for name, v in items[:top]]

        detail = {k: int(v) for k, v in (dropped or {}).items() if v}
        ms = self.step_ms
        return TraceSummary(
            steps=len(ms), incomplete_steps=self.incomplete,
            step_ms={"p50": round(percentile(ms, 50), 4), "p90": round(percentile(ms, 90), 4),
                     "p99": round(percentile(ms, 99), 4), "max": round(max(ms, default=0.0), 4),
                     "mean": round(sum(ms) / len(ms), 4) if ms else 0.0},
            phases=rows("phase", 1, None), modules=rows("module", 1, TOP), ops=rows("op", 1, TOP),
            spans=self.spans, aggregated=self.aggregated, dropped=sum(detail.values()), dropped_detail=detail,
            endpoint=endpoint, sources=list(sources or []))


def summarize(spans: Iterable[Span], **kwargs: Any) -> TraceSummary:
    builder = SummaryBuilder()
    builder.add(spans)
    return builder.result(**kwargs)
