"""The exporter's summary keeps its step times in a bounded histogram: count, mean, max and phase shares as the
builder gives them, percentiles within 0.5%, and memory that does not grow with the steps."""

from __future__ import annotations

import random

import pytest

from exporters.running_summary import RunningSummary
from exporters.spans import Span
from exporters.trace_summary import SummaryBuilder


def _step(n: int, ms: float) -> list[Span]:
    ns = round(ms * 1e6)
    return [Span("step", "step", n, 1, 0, 0, ns, {"ml.step": n}),
            Span("forward", "phase", n, 2, 1, 0, ns // 3, {"ml.phase": "forward"})]


def test_the_running_summary_agrees_with_the_builder_within_half_a_percent():
    rng = random.Random(7)
    times = [rng.lognormvariate(3, 0.4) for _ in range(5000)] + [0.0, 2500.0]
    running, exact = RunningSummary(), SummaryBuilder()
    for n, ms in enumerate(times):
        running.add(_step(n, ms))
        exact.add(_step(n, ms))
    got, want = running.result(dropped={"queue_full": 2}), exact.result(dropped={"queue_full": 2})
    assert got.steps == want.steps == len(times) and running.step_ms == []
    assert got.step_ms["max"] == want.step_ms["max"] and got.step_ms["mean"] == pytest.approx(want.step_ms["mean"])
    for q in ("p50", "p90", "p99"):
        assert got.step_ms[q] == pytest.approx(want.step_ms[q], rel=0.005), q
    assert got.phases == want.phases and got.dropped == want.dropped == 2 and got.spans == want.spans


def test_its_memory_stays_bounded_over_many_steps():
    running = RunningSummary()
    rng = random.Random(3)
    for n in range(100_000):
        running.add(_step(n, rng.uniform(9.0, 11.0)))
    assert running.result().steps == 100_000 and len(running._buckets) <= 25 and running.step_ms == []
    assert RunningSummary().result().step_ms == {"p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0, "mean": 0.0}
