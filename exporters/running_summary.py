"""The exporter's summary of a run of any length: :class:`exporters.trace_summary.SummaryBuilder` with its step
times in a histogram instead of a list.

A builder keeps every step's time to take percentiles from; an exporter that runs for weeks would hold one float per
step (32 bytes: 3 MiB per 100,000 steps) and sort them all each time it writes its status (every 2 s).  Here step
times go into buckets 1% wide on a log scale (a few hundred buckets for any real spread of step times), so memory
and the cost of :meth:`RunningSummary.result` stay bounded.  The count, mean and max are exact; the percentiles
are within 0.5% of the linear-interpolated ones the builder gives.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any

from exporters.spans import Span
from exporters.trace_summary import SummaryBuilder, TraceSummary

__all__ = ["RunningSummary"]

_BASE = math.log(1.01)  # bucket width: 1% (a bucket's middle is within 0.5% of any time in it)
_ZERO = -(1 << 62)  # the bucket of step times <= 0 (a clock that did not move)


class RunningSummary(SummaryBuilder):
    """:class:`SummaryBuilder` whose step times live in a bounded histogram (see the module)."""

    def __init__(self) -> None:
        super().__init__()
        self._buckets: dict[int, int] = {}  # bucket → steps
        self._count = 0
        self._total_ms = 0.0
        self._max_ms = 0.0

    def add(self, spans: Iterable[Span]) -> None:
        super().add(spans)
        for ms in self.step_ms:
            key = math.floor(math.log(ms) / _BASE) if ms > 0 else _ZERO
            self._buckets[key] = self._buckets.get(key, 0) + 1
            self._count += 1
            self._total_ms += ms
            self._max_ms = max(self._max_ms, ms)
        self.step_ms.clear()

    def percentile(self, q: float) -> float:
        """Percentile ``q`` (0-100) of the step times: the middle of the bucket that holds its rank."""
        if not self._count:
            return 0.0
        rank, seen = (self._count - 1) * q / 100, 0
        for key in sorted(self._buckets):
            seen += self._buckets[key]
            if seen > rank:
                return 0.0 if key == _ZERO else min(self._max_ms, math.exp((key + 0.5) * _BASE))
        return self._max_ms

    def result(self, *, dropped: Mapping[str, int] | None = None, endpoint: str = "",
               sources: list[str] | None = None) -> TraceSummary:
        self.step_ms = [self._total_ms] if self._count else []  # what the phases' shares divide by
        try:
            summary = super().result(dropped=dropped, endpoint=endpoint, sources=sources)
        finally:
            self.step_ms = []
        times: dict[str, Any] = {f"p{q}": round(self.percentile(q), 4) for q in (50, 90, 99)}
        times.update(max=round(self._max_ms, 4), mean=round(self._total_ms / self._count, 4) if self._count else 0.0)
        return dataclasses.replace(summary, steps=self._count, step_ms=times)
