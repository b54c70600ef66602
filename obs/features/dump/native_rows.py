"""The C++ recorder of statistic.csv's rows (``obs/features/dump/_fast_rows.cpp``), built once and shared by dumps.

It is compiled against the installed torch the first time a statistic dump needs it (or ahead of time
with ``obs native build``), into obs's cache of native builds (:mod:`obs._core.native`).
Where it cannot be built (no compiler, no ``obs.features.dump._stats``) or ``OBS_NATIVE_DUMP=0`` asks for the Python
path, :func:`row_recorder` returns None, :class:`~obs.features.dump._rows.StatisticRows` records in Python, and the
log says why, once.  Both paths write the same bytes: the tests compare them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from obs._core import native

__all__ = ["EXTENSION", "row_recorder", "stats_missing", "unavailable_reason"]

_HERE = os.path.dirname(os.path.abspath(__file__))


def stats_missing() -> str | None:
    """Why obs.dump's C++ extensions cannot work here (they borrow obs.features.dump._stats's pass), else None."""
    from obs.features.dump import stats

    return None if stats.native is not None else stats.STATS.unavailable_reason() or "obs.features.dump._stats is off"


EXTENSION = native.Extension(
    "obs_dump_rows", "native statistic recorder",
    (os.path.join(_HERE, "_fast_rows.cpp"), os.path.join(_HERE, "_stats_api.h")), part="DUMP",
    fallback="statistic dump rows are recorded in Python (slower): the native statistic recorder is off",
    requires=stats_missing)
unavailable_reason = EXTENSION.unavailable_reason


def row_recorder(rows: list[Any], picks: tuple[int, ...], zeros: bool,
                 slow: Callable[[Any, str, int, Any], None]) -> Any | None:
    """A recorder appending to ``rows`` (``add_values(op, io, values)``, ``clear()``), or None where the Python
    path must do it (one log line says why)."""
    module = EXTENSION.load()
    return None if module is None else module.Rows(rows, picks, zeros, slow)
