"""MindSpore-style operator objects: ``p = obs.ops.Print(); p("loss:", loss)``."""

from __future__ import annotations

from typing import Any

from obs.features.printing import print_values

__all__ = ["Print"]


class Print:
    """The Print operator: calling it is :func:`obs.Print` (file or screen, compiled graphs too)."""

    def __call__(self, *values: Any) -> None:
        print_values(values, 2)

    def __repr__(self) -> str:
        return "Print()"
