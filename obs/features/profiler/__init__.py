"""The profiler (``obs.profiling``): ``enable_profiling`` / ``profiling_options`` and the env config ``profiler``
section.  Its applier is :mod:`obs.features.profiler.feature`; one session's ring, subscriptions and exporter process
are :mod:`obs.features.profiler.profile_session`; ``obs.scalar`` (values for the metrics) is
:mod:`obs.features.profiler.scalars`."""

from __future__ import annotations

from obs.features.profiler.feature import ProfilerDropWarning, ProfilerFeature, feature, last_status, session

__all__ = ["ProfilerDropWarning", "ProfilerFeature", "feature", "last_status", "session"]
