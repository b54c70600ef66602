"""Teach torch.compile (Dynamo) to trace through obs's C ``Module.__call__`` as through torch's own.

Dynamo inlines Python functions but stops at a C callable it does not know: every submodule call of
a compiled model would become a graph break.  ``substitute_in_graph`` registers a Python stand-in that
Dynamo inlines instead (the C call is never traced; in eager mode the C call runs).  The stand-in calls
the ``Module.__call__`` obs replaced, which is what the Python wrapper does while compiling.

Importing Dynamo costs about a second, so nothing here imports it: the stand-in is registered at once
when Dynamo is already loaded, else right after its first import (a one-shot import hook).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import sys
from typing import Any

__all__ = ["teach_dynamo"]

logger = logging.getLogger("obs")
_original: list[Any] = [None]  # the Module.__call__ obs replaced, read by the stand-in when Dynamo traces
_registered: set[int] = set()


def _register(descriptor: Any) -> None:
    if id(descriptor) in _registered:
        return
    _registered.add(id(descriptor))
    try:
        from torch._dynamo.decorators import substitute_in_graph

        @substitute_in_graph(descriptor, skip_signature_check=True)
        def obs_module_call(module: Any, *args: Any, **kwargs: Any) -> Any:
            return _original[0](module, *args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - compiled models still run, with a graph break per module call
        logger.warning("obs: torch.compile will break its graphs at every module call while obs records modules "
                       "(the C Module.__call__ could not be registered with Dynamo: %r)", exc)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``then()`` once ``torch._dynamo`` has been imported, then leaves ``sys.meta_path``."""

    def __init__(self, then: Any) -> None:
        self.then = then

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "torch._dynamo":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run, then = spec.loader.exec_module, self.then  # type: ignore[union-attr]

        def exec_module(module: Any) -> None:
            run(module)
            then()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign,union-attr]
        return spec


def teach_dynamo(descriptor: Any, original: Any) -> None:
    """Make Dynamo inline ``original`` where it meets ``descriptor`` (obs's C ``Module.__call__``)."""
    _original[0] = original
    if "torch._dynamo" in sys.modules:
        _register(descriptor)
    elif not any(isinstance(finder, _AfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(lambda: _register(descriptor)))
