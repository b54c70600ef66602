"""The training-health monitor (docs/monitor.md): per-parameter gradient and update norms, update/weight ratios, the
loss and, opt-in, activations and optimizer moments at every step, in msprobe's CSV files, with anomalies flagged
as they start and explained after the fact (``obs monitor show``, ``obs monitor explain``)."""

from obs.features.monitor.actions import MonitorAnomalyError
from obs.features.monitor.feature import feature

__all__ = ["MonitorAnomalyError", "feature"]
