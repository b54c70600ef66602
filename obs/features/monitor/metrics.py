"""The monitor's OpenTelemetry metrics: what a dashboard needs of each judged step, as the profiler's scalars (a sink
of the monitor's worker thread, :class:`~obs.features.monitor.writer.StepValues` in).

The trainer never touches the OpenTelemetry SDK: each value goes into the profiler's ring as an ``obs.scalar`` slot
(a no-op while the profiler's metrics are off), under a reserved name, and the exporter process
(:mod:`exporters.step_metrics`, :mod:`exporters.metrics`) serves them as

- ``obs.monitor.grad_norm`` → ``obs_monitor_grad_norm``: the global gradient norm of the last step;
- ``obs.monitor.update_ratio.max`` → ``obs_monitor_update_ratio_max`` (attribute ``layer``): the largest
  update/weight ratio of the last step, and the parameter it belongs to;
- ``obs.monitor.anomalies`` → ``obs_monitor_anomalies_total`` (attribute ``kind``: ``wg``, ``ur``, ``mv``, ``xy``,
  ``loss``): the anomalies found so far, a counter (each kind at 0 from the first step, so that a rule on its
  increase sees the first anomaly).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from typing import Any

from obs.features.monitor.layout import kind_stage

__all__ = ["ANOMALIES", "GRAD_NORM", "KINDS", "RATIO_MAX", "SEP", "MetricsSink", "kind_of"]

GRAD_NORM = "obs.monitor.grad_norm"
RATIO_MAX = "obs.monitor.update_ratio.max"  #: + SEP + the parameter's name
ANOMALIES = "obs.monitor.anomalies"  #: + SEP + the kind; the value is the count so far
SEP = "|"
#: the kinds whose counters start at 0 with the first step, so that an alert on their increase sees the first anomaly
KINDS = ("wg", "ur", "mv", "xy", "loss")


def kind_of(anomaly: Any) -> str:
    """An anomaly's series kind (``wg``, ``ur``, ``mv``, ``xy``, ``cc``, ``loss``)."""
    return kind_stage(anomaly.prefix, anomaly.name)[0] or "other"


class MetricsSink:
    """Each step's global gradient norm, largest update ratio and anomaly counts to ``scalar(name, value)``
    (default: ``obs.scalar``'s path into the profiler's ring, skipped at once while the profiler's metrics are off;
    the anomalies are counted all the same, and every kind's count is written again when they come on)."""

    def __init__(self, scalar: Callable[[str, Any], None] | None = None) -> None:
        if scalar is None:
            from obs.features.profiling import scalars

            self.scalar, self._on = scalars.scalar, scalars.recording
        else:
            self.scalar, self._on = scalar, _always
        self.anomalies: Counter[str] = Counter()
        self._announced = False  # every kind's count written since the metrics came on

    def wants_values(self) -> bool:
        """The step's values only while the profiler's metrics record (its anomalies are counted always)."""
        return bool(self._on())

    def __call__(self, values: Any) -> None:
        kinds = [kind_of(a) for a in values.anomalies] if values.anomalies else []
        self.anomalies.update(kinds)
        if not self._on():
            self._announced = False
            return
        scalar = self.scalar
        for kind in sorted(set(kinds) if self._announced else {*KINDS, *self.anomalies}):
            scalar(f"{ANOMALIES}{SEP}{kind}", float(self.anomalies[kind]))
        self._announced = True
        ratios = [(value, name) for prefix, name, _, _, value in values.values
                  if prefix == "update_ratio" and value == value and value != math.inf]
        if ratios:
            value, name = max(ratios)
            scalar(f"{RATIO_MAX}{SEP}{name}", value)
        norm = [value for prefix, name, _, _, value in values.values if prefix == "scalars" and name == "grad_norm"]
        if norm:
            scalar(GRAD_NORM, norm[-1])


def _always() -> bool:
    return True
