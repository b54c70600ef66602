"""Every ``torch.export.ExportedProgram`` made in the process, handed to a callback.

torch.export (non-strict, its default) traces without Dynamo and reports nothing to PyTorch's structured
trace, so the one place every exported program passes is its constructor: ``torch.export.export``,
``run_decompositions`` and ``torch.export.load`` all build one.  Wrapping the class's ``__init__`` (not
the ``export`` function) also sees programs exported through a name imported before obs started.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from obs._core.internal import report_internal_error, suppressed

__all__ = ["ExportHook"]


class ExportHook:
    """Calls ``seen(program)`` after each ExportedProgram is built, until ``remove()``."""

    _lock = threading.Lock()

    def __init__(self, seen: Callable[[Any], None]) -> None:
        from torch.export import ExportedProgram

        self._cls = ExportedProgram
        original = self._original = ExportedProgram.__init__

        def init(program: Any, *args: Any, **kwargs: Any) -> None:
            original(program, *args, **kwargs)
            try:
                with suppressed():
                    seen(program)
            except Exception as exc:  # noqa: BLE001 - reported; the user's export goes on
                report_internal_error("save_graphs: an exported program", exc)

        init.__wrapped__ = original  # type: ignore[attr-defined]
        with self._lock:
            ExportedProgram.__init__ = init  # type: ignore[method-assign]
        self._installed = init

    def remove(self) -> None:
        with self._lock:
            if self._cls.__init__ is self._installed:
                self._cls.__init__ = self._original  # type: ignore[method-assign]
