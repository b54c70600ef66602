"""Module-level interception that publishes MODULE_ENTER / MODULE_EXIT with MindSpore-style scopes.

While someone subscribes to module events, ``torch.nn.Module.__call__`` is wrapped: this keeps
PyTorch's hook-free fast path, where global forward hooks force every module call through the
slow path (``tests/perf/bench_overhead.py`` measures both).  A root module (entered with nothing
on this thread's stack) names every submodule once from ``named_modules()``:
``Default/net-Net/fc1-Linear`` (``Default/net/fc1`` without class names).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.compiler import is_compiling

from obs._core.events import Event, bus
from obs._core.internal import SUPPRESSION, report_internal_error
from obs.runtime.steps import tracker

__all__ = ["ModuleHooks", "current_scope"]

_scopes: dict[int, str] = {}


def current_scope() -> str:
    """Scope of the innermost module running on this thread ('' outside any module)."""
    stack = SUPPRESSION.stack
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


def _scope_of(module: torch.nn.Module, stack: list[str], keep_class: bool) -> str:
    if stack:
        return stack[-1] + "/" + _part(type(module).__name__.lower(), module, keep_class)
    _name_tree(module, keep_class)
    return _scopes[id(module)]


def _fault(scope: str, error: BaseException) -> None:
    # Report the innermost module only, not every frame the error unwinds through.
    if not getattr(error, "_obs_fault_reported", False):
        try:
            error._obs_fault_reported = True  # type: ignore[attr-defined]
        except AttributeError:
            pass
        bus.emit(Event.FAULT, "module_error", scope, error)


class ModuleHooks:
    """Wraps ``nn.Module.__call__`` until ``remove()``; ``refresh()`` re-reads the handler tuples."""

    def __init__(self, keep_class_names: bool) -> None:
        _scopes.clear()
        self.enter: tuple[Any, ...] = ()
        self.exit: tuple[Any, ...] = ()
        self.refresh()
        hooks, original = self, torch.nn.Module.__call__
        self._original = original
        keep = keep_class_names

        state = SUPPRESSION

        def __call__(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            if state.depth or is_compiling():
                return original(module, *args, **kwargs)
            stack = state.stack
            scope = _scopes.get(id(module)) or _scope_of(module, stack, keep)
            stack.append(scope)
            if not tracker.in_step:
                tracker.auto_begin()
            for handler in hooks.enter:
                try:
                    handler(scope, module)
                except Exception as exc:
                    report_internal_error("MODULE_ENTER handler", exc)
            error: BaseException | None = None
            try:
                return original(module, *args, **kwargs)
            except BaseException as exc:
                error = exc
                raise
            finally:
                stack.pop()
                for handler in hooks.exit:
                    try:
                        handler(scope, module, error)
                    except Exception as exc:
                        report_internal_error("MODULE_EXIT handler", exc)
                if error is not None:
                    _fault(scope, error)
                    error = None  # break the frame <-> traceback cycle

        torch.nn.Module.__call__ = __call__  # type: ignore[method-assign]

    def refresh(self) -> None:
        self.enter = bus.handlers(Event.MODULE_ENTER)
        self.exit = bus.handlers(Event.MODULE_EXIT)

    def remove(self) -> None:
        torch.nn.Module.__call__ = self._original  # type: ignore[method-assign]
        _scopes.clear()
