"""The NaN/Inf check's C++ module hook (``_fast_nan.cpp`` beside this file), built once like the statistic recorder.

Compiled against the installed torch the first time a NaN check at module granularity starts (or ahead of time
with ``obs native build``), into obs's cache of native builds (:mod:`obs._core.native`).  Where
it cannot be built, or ``OBS_NATIVE_DUMP=0`` asks for the Python path, :func:`module_check` returns None and
:class:`~obs.features.dump.nan.check.NanCheck` checks in Python (the log says why, once).  Both find the same places:
the tests run both.
"""

from __future__ import annotations

import os
from typing import Any

from obs._core import native
from obs.features.dump.stats.native_rows import STATS_API, stats_missing

__all__ = ["EXTENSION", "module_check", "unavailable_reason"]

_HERE = os.path.dirname(os.path.abspath(__file__))
EXTENSION = native.Extension(
    "obs_dump_nan", "native NaN/Inf check", (os.path.join(_HERE, "_fast_nan.cpp"), STATS_API),
    part="DUMP", fallback="the NaN/Inf check runs in Python (slower)", requires=stats_missing)
unavailable_reason = EXTENSION.unavailable_reason


def module_check(**parts: Any) -> Any | None:
    """A ``Check(**parts)`` (see ``_fast_nan.cpp``), or None where the Python path must check."""
    module = EXTENSION.load()
    return None if module is None else module.Check(**parts)
