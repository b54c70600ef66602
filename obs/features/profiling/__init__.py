"""The profiler (``obs.profiling``): ``enable_profiling`` / ``profiling_options`` and the env config ``profiler``
section.  Its applier is :mod:`obs.features.profiling.feature`; one session's ring, subscriptions and exporter process
are :mod:`obs.features.profiling.profile_session`; ``obs.scalar`` (values for the metrics) is
:mod:`obs.features.profiling.scalars`."""

from __future__ import annotations

from obs.features.profiling.feature import ProfilerDropWarning, ProfilerFeature, feature, last_status, session

__all__ = ["ProfilerDropWarning", "ProfilerFeature", "feature", "last_status", "session"]
