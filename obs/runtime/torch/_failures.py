"""The failure hooks: what a feature runs when a module call or an aten op raises, with the call's own arguments.

The module wrapper (``_modules.py``, and ``recorder/_module_call.c``, which is handed this registry when it is
installed) calls ``hook(error, "module", scope, args, kwargs, module)``; the op dispatch mode (``_ops.py``)
calls ``hook(error, "op", name, args, kwargs)``.  Innermost call first, while the exception unwinds, before the
FAULT event (so an RDR bundle can name the exception dump written for it).  Wrappers test
``failure_hooks.snapshot`` first: with no hook, a failure costs nothing more.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from obs._core.hooks import Hooks

__all__ = ["failure_hooks"]

failure_hooks: Hooks[Callable[..., Any]] = Hooks("failure hook")
