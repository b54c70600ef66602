"""The recorder's C hot path (``recorder/_hotpath.c``: ring slots, module calls, the signal relay), loaded once.

``HOTPATH.load()`` is the C module, or None where it is not built or ``OBS_NATIVE_RECORDER=0`` (or
``OBS_NATIVE=0``) asks for the Python handlers, which do the same work and are the reference.
"""

from __future__ import annotations

from typing import Any

from obs._core import native

__all__ = ["HOTPATH", "hotpath"]

HOTPATH = native.Installed("recorder._hotpath", "RECORDER")


def hotpath() -> Any:
    """The C hot path, or None (see the module docstring)."""
    return HOTPATH.load()
