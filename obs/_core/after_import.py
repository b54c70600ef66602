"""Run a callback once a module has been imported, without importing it (``import obs`` stays light).

Used for what only makes sense once a heavy module is loaded: teaching Dynamo about obs's module wrapper
once ``torch._dynamo`` is imported, listening to compiles once ``torch`` is.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["after_import"]

_lock = threading.Lock()
_waiting: dict[str, list[Callable[[], None]]] = {}


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps the loader of each awaited module so that its callbacks run right after the module executed."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name not in _waiting:
            return None
        with _lock:
            callbacks = _waiting.pop(name, [])
            if not _waiting and self in sys.meta_path:
                sys.meta_path.remove(self)
        if not callbacks:
            return None
        spec = importlib.util.find_spec(name)  # the finders after this one (we are no longer asked for `name`)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            for callback in callbacks:
                callback()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


_finder = _Finder()


def after_import(name: str, callback: Callable[[], None]) -> None:
    """Call ``callback()`` now if module ``name`` is imported, else right after its first import completes."""
    if name in sys.modules:
        callback()
        return
    with _lock:
        _waiting.setdefault(name, []).append(callback)
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
