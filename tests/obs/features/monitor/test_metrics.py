"""The monitor's metrics sink: nothing written while the profiler's metrics are off (anomalies still counted), every
kind's count written when they come on, then each step's grad norm, largest finite update ratio and new counts.  The
path through the ring to Prometheus: tests/exporters/test_metrics.py."""

from __future__ import annotations

from types import SimpleNamespace

from obs.features.monitor.metrics import MetricsSink
from obs.features.monitor.writer import Anomaly, StepValues
from obs.features.profiling import scalars


def test_off_then_on(monkeypatch):
    written: list[tuple[str, float]] = []
    sink = MetricsSink()
    spike = Anomaly(3, "update_ratio", "fc.weight", None, "ratio", 0.5, 0.01, "robust", 40.0)
    values = [("update_ratio", "fc.weight", None, "ratio", 0.5),
              ("update_ratio", "fc.bias", None, "ratio", float("nan")), ("scalars", "grad_norm", None, "value", 2.0)]
    sink(StepValues(3, values, [spike]))  # the profiler's metrics off: nothing written, the anomaly counted
    assert not scalars.recording() and written == [] and sink.anomalies == {"ur": 1}
    session = SimpleNamespace(write=lambda name, value: written.append((name, value)))
    scalars.attach(session)
    try:
        sink(StepValues(4, values, []))
        assert written == [("obs.monitor.anomalies|loss", 0.0), ("obs.monitor.anomalies|mv", 0.0),
                           ("obs.monitor.anomalies|ur", 1.0), ("obs.monitor.anomalies|wg", 0.0),
                           ("obs.monitor.anomalies|xy", 0.0), ("obs.monitor.update_ratio.max|fc.weight", 0.5),
                           ("obs.monitor.grad_norm", 2.0)]
        written.clear()
        sink(StepValues(5, values, [spike, spike]))
        assert written == [("obs.monitor.anomalies|ur", 3.0), ("obs.monitor.update_ratio.max|fc.weight", 0.5),
                           ("obs.monitor.grad_norm", 2.0)]
    finally:
        scalars.detach(session)
