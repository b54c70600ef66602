"""The NaN/Inf check's C++ module hook (``obs/dump/_fast_nan.cpp``), built once like the statistic recorder.

Compiled against the installed torch the first time a NaN check at module granularity starts (or ahead of time
with ``python -m obs.dump.native_nan``), into obs's cache of native builds (:mod:`obs._core.native_build`).  Where
it cannot be built, or ``OBS_NATIVE_DUMP=0`` asks for the Python path, :func:`module_check` returns None and
:class:`~obs.dump.nan_check.NanCheck` checks in Python (the log says why, once).  Both find the same places: the
tests run both.
"""

from __future__ import annotations

import logging
import os
import threading
from types import ModuleType
from typing import Any

from obs._core import native_build

__all__ = ["build", "module_check", "unavailable_reason"]

logger = logging.getLogger("obs")
_HERE = os.path.dirname(os.path.abspath(__file__))
_SOURCES = (os.path.join(_HERE, "_fast_nan.cpp"), os.path.join(_HERE, "_stats_api.h"))
_NAME = "obs_dump_nan"
_lock = threading.Lock()
_module: ModuleType | None = None
_reason: str | None = None  # why there is no module (set once a build was tried)


def build() -> str:
    """Compile the module hook (or find it built) and return the shared library's path; raises on failure."""
    return native_build.build(_NAME, "native NaN/Inf check", *_SOURCES)


def unavailable_reason() -> str | None:
    """Why the C++ check is not used (None when it is, or has not been asked for yet)."""
    return "OBS_NATIVE_DUMP=0 asks for the Python path" if native_build.switched_off("OBS_NATIVE_DUMP") else _reason


def module_check(**parts: Any) -> Any | None:
    """A ``Check(**parts)`` (see ``_fast_nan.cpp``), or None where the Python path must check (logged once)."""
    global _module, _reason
    if native_build.switched_off("OBS_NATIVE_DUMP"):
        return None
    with _lock:
        if _module is None and _reason is None:
            from obs.dump import stats

            if stats.native is None:
                _reason = "the C extension obs.dump._stats is not built"
            else:
                try:
                    _module = native_build.load_module(_NAME, build())
                except Exception as exc:  # noqa: BLE001 - any build or load failure: the Python path, and why
                    lines = str(exc).strip().splitlines()
                    _reason = f"it could not be built ({lines[-1] if lines else type(exc).__name__})"
                if _reason is not None:
                    logger.warning("obs: the NaN/Inf check runs in Python (slower): %s", _reason)
    return None if _module is None else _module.Check(**parts)


if __name__ == "__main__":  # python -m obs.dump.native_nan: build ahead of time (CI, images)
    print(build())
