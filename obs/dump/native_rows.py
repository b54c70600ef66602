"""The C++ recorder of statistic.csv's rows (``obs/dump/_fast_rows.cpp``), built once and shared by dumps.

It is compiled against the installed torch the first time a statistic dump needs it (or ahead of time
with ``python -m obs.dump.native_rows``), into obs's cache of native builds (:mod:`obs._core.native_build`).
Where it cannot be built (no compiler, no ``obs.dump._stats``) or ``OBS_NATIVE_DUMP=0`` asks for the Python
path, :func:`row_recorder` returns None, :class:`~obs.dump._rows.StatisticRows` records in Python, and the
log says why, once.  Both paths write the same bytes: the tests compare them.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

from obs._core import native_build

__all__ = ["build", "row_recorder", "unavailable_reason"]

logger = logging.getLogger("obs")
_HERE = os.path.dirname(os.path.abspath(__file__))
_SOURCES = (os.path.join(_HERE, "_fast_rows.cpp"), os.path.join(_HERE, "_stats_api.h"))
_NAME = "obs_dump_rows"
_lock = threading.Lock()
_module: ModuleType | None = None
_reason: str | None = None  # why there is no module (set once a build was tried)


def build() -> str:
    """Compile the row recorder (or find it built) and return the shared library's path; raises on failure."""
    return native_build.build(_NAME, "native statistic recorder", *_SOURCES)


def _load() -> ModuleType | None:
    global _module, _reason
    if _module is not None or _reason is not None:
        return _module
    from obs.dump import stats

    if stats.native is None:
        _reason = "the C extension obs.dump._stats is not built"
        return None
    try:
        _module = native_build.load_module(_NAME, build())
    except Exception as exc:  # noqa: BLE001 - any build or load failure means: use the Python path, and say why
        lines = str(exc).strip().splitlines()
        _reason = f"it could not be built ({lines[-1] if lines else type(exc).__name__})"
    return _module


def unavailable_reason() -> str | None:
    """Why the C++ recorder is not used (None when it is, or has not been asked for yet)."""
    return _reason


def row_recorder(rows: list[Any], picks: tuple[int, ...], zeros: bool,
                 slow: Callable[[Any, str, int, Any], None]) -> Any | None:
    """A recorder appending to ``rows`` (``add_values(op, io, values)``, ``clear()``), or None where the Python
    path must do it (one log line says why)."""
    if native_build.switched_off("OBS_NATIVE_DUMP"):
        return None
    with _lock:
        had_reason = _reason is not None
        module = _load()
    if module is None:
        if not had_reason:
            logger.warning("obs: statistic dump rows are recorded in Python (slower): the native statistic recorder "
                           "is off: %s", _reason)
        return None
    return module.Rows(rows, picks, zeros, slow)


if __name__ == "__main__":  # python -m obs.dump.native_rows: build ahead of time (CI, images)
    print(build())
