"""Global module forward hooks that publish MODULE_ENTER / MODULE_EXIT with MindSpore-style scopes.

A root module (entered with nothing on this thread's stack) names every submodule once, from
``named_modules()``: ``Default/net-Net/fc1-Linear`` (or ``Default/net/fc1`` without class
names).  The hooks are installed only while someone subscribes to module events.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.compiler import is_compiling
from torch.nn.modules import module as nn_module

from obs._core.events import Event, bus
from obs._core.internal import SUPPRESSION, report_internal_error
from obs.runtime.steps import tracker

__all__ = ["ModuleHooks", "current_scope"]

_tls = threading.local()
_scopes: dict[int, str] = {}


def _stack() -> list[str]:
    stack = getattr(_tls, "stack", None)
    if stack is None:
        stack = _tls.stack = []
    return stack


def current_scope() -> str:
    """Scope of the innermost module running on this thread ('' outside any module)."""
    stack = getattr(_tls, "stack", None)
    return stack[-1] if stack else ""


def _part(name: str, module: torch.nn.Module, keep_class: bool) -> str:
    return f"{name}-{type(module).__name__}" if keep_class else name


def _forget(key: int) -> None:
    _scopes.pop(key, None)


def _name_tree(root: torch.nn.Module, keep_class: bool) -> None:
    prefix = "Default/" + _part("net", root, keep_class)
    for qualified, sub in root.named_modules(remove_duplicate=True):
        key = id(sub)
        if key in _scopes:
            continue
        scope = prefix
        if qualified:
            owner = root
            for name in qualified.split("."):
                owner = owner._modules[name]  # type: ignore[assignment]
                scope += "/" + _part(name, owner, keep_class)
        _scopes[key] = scope
        weakref.finalize(sub, _forget, key)


class ModuleHooks:
    """Installs the global forward pre/post hooks; ``remove()`` takes them out again."""

    def __init__(self, keep_class_names: bool) -> None:
        self._keep = keep_class_names
        _scopes.clear()
        enter: Callable[..., Any] = self._enter
        leave: Callable[..., Any] = self._leave
        self._handles = [
            nn_module.register_module_forward_pre_hook(enter),
            nn_module.register_module_forward_hook(leave, always_call=True),
        ]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        _scopes.clear()

    def _enter(self, module: torch.nn.Module, args: Any) -> None:
        # Inside a graph Dynamo traces, the hook folds away: the graph is one unit (GRAPH_COMPILED).
        if getattr(SUPPRESSION, "depth", 0) or is_compiling():
            return
        stack = _stack()
        scope = _scopes.get(id(module))
        if scope is None:
            if stack:
                scope = stack[-1] + "/" + _part(type(module).__name__.lower(), module, self._keep)
            else:
                _name_tree(module, self._keep)
                scope = _scopes[id(module)]
        stack.append(scope)
        if not tracker.in_step:
            tracker.auto_begin()
        for handler in bus.handlers(Event.MODULE_ENTER):
            try:
                handler(scope, module)
            except Exception as exc:
                report_internal_error("MODULE_ENTER handler", exc)

    def _leave(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        stack = getattr(_tls, "stack", None)
        if not stack or getattr(SUPPRESSION, "depth", 0) or is_compiling():
            return
        scope = stack.pop()
        # On failure torch calls always_call hooks from inside its `except` with output None.
        error = sys.exc_info()[1] if output is None else None
        for handler in bus.handlers(Event.MODULE_EXIT):
            try:
                handler(scope, module, error)
            except Exception as exc:
                report_internal_error("MODULE_EXIT handler", exc)
        if error is not None and not getattr(error, "_obs_fault_reported", False):
            # Report the innermost module only, not every frame the error unwinds through.
            error._obs_fault_reported = True  # type: ignore[attr-defined]
            bus.emit(Event.FAULT, "module_error", scope, error)
