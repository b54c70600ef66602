"""The C++ recorder of statistic.csv's rows (``_fast_rows.cpp`` beside this file), built once and shared by dumps.

It is compiled against the installed torch the first time a statistic dump needs it (or ahead of time
with ``obs native build``), into obs's cache of native builds (:mod:`obs._core.native`).
Where it cannot be built (no compiler, no ``obs.features.dump.stats._stats``) or ``OBS_NATIVE_DUMP=0`` asks for
the Python path, :func:`row_recorder` returns None, :class:`~obs.features.dump.stats.statistic_csv.StatisticRows`
records in Python, and the log says why, once.  Both paths write the same bytes: the tests compare them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from obs._core import native

__all__ = ["EXTENSION", "STATS_API", "row_recorder", "stats_missing", "unavailable_reason"]

_HERE = os.path.dirname(os.path.abspath(__file__))
#: the header of what the C statistics pass lends the C++ extensions (its dtype codes, gate and formatter)
STATS_API = os.path.join(_HERE, "_stats_api.h")


def stats_missing() -> str | None:
    """Why obs.dump's C++ extensions cannot work here (they borrow obs.features.dump.stats._stats's pass), else None."""
    from obs.features.dump.stats import tensor_stats

    if tensor_stats.native is not None:
        return None
    return tensor_stats.STATS.unavailable_reason() or "obs.features.dump.stats._stats is off"


EXTENSION = native.Extension(
    "obs_dump_rows", "native statistic recorder",
    (os.path.join(_HERE, "_fast_rows.cpp"), STATS_API), part="DUMP",
    fallback="statistic dump rows are recorded in Python (slower): the native statistic recorder is off",
    requires=stats_missing)
unavailable_reason = EXTENSION.unavailable_reason


def row_recorder(rows: list[Any], picks: tuple[int, ...], zeros: bool,
                 slow: Callable[[Any, str, int, Any], None]) -> Any | None:
    """A recorder appending to ``rows`` (``add_values(op, io, values)``, ``clear()``), or None where the Python
    path must do it (one log line says why)."""
    module = EXTENSION.load()
    return None if module is None else module.Rows(rows, picks, zeros, slow)
