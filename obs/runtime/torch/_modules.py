"""Module-level interception that publishes MODULE_ENTER / MODULE_EXIT with MindSpore-style scopes.

While someone subscribes to module events, ``torch.nn.Module.__call__`` is wrapped: this keeps
PyTorch's hook-free fast path, where global forward hooks force every module call through the
slow path (``tests/perf/bench_overhead.py`` measures both).  The wrapper is C
(``recorder/_module_call.c``, no Python frame per module call) where the recorder's C hot path is
built, and the Python ``obs_module_call`` below otherwise (``OBS_NATIVE_RECORDER=0``); both do the
same, in the same order.  A root module (entered with nothing on this thread's stack) names every
submodule once from ``named_modules()``:
``Default/net-Net/fc1-Linear`` (``Default/net/fc1`` without class names).  A module wrapped by
``torch.compile`` (``OptimizedModule``) is named after the module it wraps: ``Default/net-Net``,
with no ``_orig_mod`` level.

Inside a ``torch.compile``'d call (Dynamo's frame callback is set) the wrapper only calls through: the
compiled wrapper's own call is recorded, under the wrapped module's name, and the wrapped module's call it
makes is not recorded again; a handler run there would itself be compiled by Dynamo as a frame.

The first module call with grad enabled outside a step opens the step; a forward under
``torch.no_grad()`` / ``torch.inference_mode()`` between steps (evaluation) opens none.

The wrapper leaves no frame in a user's traceback: the C one has none; the Python one inlines
PyTorch's ``_wrapped_call_impl`` (two lines) and, when an exception passes through, drops its own
entry from the traceback before a bare ``raise`` (which, unlike ``raise exc``, adds no entry).  A
module level then shows torch's ``_call_impl`` and the ``forward``, one frame fewer than without obs.
Debuggers walking the traceback (``pdb.post_mortem``) skip it too; ``sys._getframe()`` stacks still
show the Python one, as ``_modules.py ... in obs_module_call``.
"""

from __future__ import annotations

import sys
import time
import types
import weakref
from typing import Any

import torch
from torch._C._dynamo.eval_frame import get_eval_frame_callback
from torch.compiler import is_compiling

from obs._core.events import Event, bus
from obs._core.internal import SUPPRESSION, leave_traceback, report_internal_error
from obs.runtime.steps import tracker
from obs.runtime.torch._failures import failure_hooks

__all__ = ["ModuleHooks", "current_scope", "forget_scopes"]

_scopes: dict[int, str] = {}
_kept: list[Any] = []  # [the wrapper left in Module.__call__ by remove(), the original it calls]


def current_scope() -> str:
    """Scope of the innermost module running on this thread ('' outside any module)."""
    stack = SUPPRESSION.stack
    return stack[-1] if stack else ""


def forget_scopes() -> None:
    """Name every module again at its next call (``reserve_class_name_in_scope`` changed)."""
    _scopes.clear()


def _wrapped(module: torch.nn.Module) -> torch.nn.Module | None:
    """The module a ``torch.compile`` wrapper (``OptimizedModule``) wraps, else None."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # no OptimizedModule exists before it loads
    if eval_frame is not None and isinstance(module, eval_frame.OptimizedModule):
        return module._orig_mod  # type: ignore[no-any-return]
    return None


def _class_name(module: torch.nn.Module) -> str:
    while (inner := _wrapped(module)) is not None:
        module = inner
    return type(module).__name__


def _part(name: str, module: torch.nn.Module, keep_class: bool) -> str:
    return f"{name}-{_class_name(module)}" if keep_class else name


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
                outer, owner = owner, owner._modules[name]  # type: ignore[assignment]
                if name == "_orig_mod" and _wrapped(outer) is owner:
                    continue  # the compiled wrapper already carries the wrapped module's name
                scope += "/" + _part(name, owner, keep_class)
        _scopes[key] = scope
        weakref.finalize(sub, _forget, key)


def _generated(module: torch.nn.Module) -> bool:
    """A GraphModule outside the user's module tree: code that torch.compile, AOT autograd or torch.export made."""
    fx = sys.modules.get("torch.fx")
    return fx is not None and isinstance(module, fx.GraphModule)


def _scope_of(module: torch.nn.Module, stack: list[str], keep_class: bool) -> str:
    """The module's scope; '' for generated code, whose calls are not recorded (the modules it calls are)."""
    if _generated(module):
        _scopes[id(module)] = ""
        weakref.finalize(module, _forget, id(module))
        return ""
    if stack:
        return stack[-1] + "/" + _part(_class_name(module).lower(), module, keep_class)
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


def _phase(handlers: tuple[Any, ...], began: int, ended: int) -> None:
    for handler in handlers:
        try:
            handler("forward", began, ended)
        except Exception as exc:  # noqa: BLE001 - reported; a handler's bug must not break forward
            report_internal_error("PHASE handler", exc)


class ModuleHooks:
    """Wraps ``nn.Module.__call__`` until ``remove()``; ``refresh()`` re-reads the handler tuples."""

    def __init__(self, keep_class_names: bool) -> None:
        _scopes.clear()
        self.enter: tuple[Any, ...] = ()
        self.exit: tuple[Any, ...] = ()
        self.phase: tuple[Any, ...] = ()
        self._c: Any = None  # recorder._hotpath when the C wrapper is installed
        self.refresh()
        hooks, original = self, torch.nn.Module.__call__
        if _kept and original is _kept[0]:  # our wrapper, left in place by remove(): wrap what it wrapped
            original = _kept[1]
        # Someone put a function over our C wrapper since remove() left it; that function calls it.  The C wrapper
        # is one configuration, so a second one on top would call that function as its original, and be called by
        # it again: record beneath it instead, from the kept wrapper, and leave their function on top.
        self._beneath = (bool(_kept) and original is not _kept[1] and not isinstance(_kept[0], types.FunctionType)
                         and _c_module_call_available())
        if self._beneath:
            original = _kept[1]
        self._original = original
        self.off = False
        keep = keep_class_names
        # Inline torch's own ``_wrapped_call_impl`` (one frame less per module level); call whatever
        # else was installed before us as it is.
        inline = original is torch.nn.Module._wrapped_call_impl
        state = SUPPRESSION
        grad_enabled = torch.is_grad_enabled
        getframe = sys._getframe
        clock = time.perf_counter_ns
        compiled_region = get_eval_frame_callback

        def obs_module_call(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            if state.depth or is_compiling() or hooks.off or compiled_region() is not None:
                try:
                    return original(module, *args, **kwargs)
                except BaseException as exc:
                    leave_traceback(exc, getframe())  # as below: this wrapper leaves no frame
                    raise
            stack = state.stack
            root = not stack
            scope = _scopes.get(id(module))
            if scope is None:
                scope = _scope_of(module, stack, keep)
            if not scope:
                return original(module, *args, **kwargs)
            stack.append(scope)
            if not tracker.in_step and grad_enabled():
                tracker.auto_begin()
            # A root call with grad enabled is the step's forward phase (PHASE subscribers: the profiler).
            began = clock() if root and hooks.phase and grad_enabled() else 0
            try:
                for handler in hooks.enter:
                    try:
                        handler(scope, module)
                    except Exception as exc:  # noqa: BLE001 - reported; a handler's bug must not break forward
                        report_internal_error("MODULE_ENTER handler", exc)
            except BaseException:  # raise mode (tests): the handler's error leaves, our stack entry with it
                stack.pop()
                raise
            error: BaseException | None = None
            try:
                if not inline:
                    return original(module, *args, **kwargs)
                if module._compiled_call_impl is not None:
                    return module._compiled_call_impl(*args, **kwargs)
                return module._call_impl(*args, **kwargs)  # obs records this module's enter and exit
            except BaseException as exc:
                error = exc
                if failure_hooks.snapshot:  # exception_dump: the innermost failing call, with its own arguments
                    failure_hooks.call(exc, "module", scope, args, kwargs, module)
                leave_traceback(exc, getframe())  # a bare raise adds no frame: this one leaves the traceback
                raise
            finally:
                stack.pop()
                for handler in hooks.exit:
                    try:
                        handler(scope, module, error)
                    except Exception as exc:  # noqa: BLE001 - reported; a handler's bug must not break forward
                        report_internal_error("MODULE_EXIT handler", exc)
                if began:
                    _phase(hooks.phase, began, clock())
                if error is not None:
                    _fault(scope, error)
                    error = None  # break the frame <-> traceback cycle

        descriptor = _install_c_module_call(original, inline, keep)
        if descriptor is not None:
            from recorder.hotpath import hotpath

            self._c = hotpath()
            self._c.set_module_handlers(self.enter, self.exit, self.phase)
            if not self._beneath:
                torch.nn.Module.__call__ = descriptor  # type: ignore[method-assign]
        else:
            from obs.runtime.torch._dynamo_polyfill import skip_frames

            skip_frames(obs_module_call.__code__)
            torch.nn.Module.__call__ = obs_module_call  # type: ignore[method-assign]

    def refresh(self) -> None:
        self.enter = bus.handlers(Event.MODULE_ENTER)
        self.exit = bus.handlers(Event.MODULE_EXIT)
        self.phase = bus.handlers(Event.PHASE)
        if self._c is not None:
            self._c.set_module_handlers(self.enter, self.exit, self.phase)

    def remove(self) -> None:
        """Stop publishing.  Once torch.compile is loaded the wrapper stays in place, calling through: graphs it
        compiled guard on ``Module.__call__``, and putting torch's back would recompile every one of them."""
        self.off = True
        if self._c is not None:
            self._c.uninstall_module_call()
        if self._beneath:
            pass  # their function stays on top, calling our kept wrapper, which now calls through
        elif "torch._dynamo" in sys.modules:
            _kept[:] = [torch.nn.Module.__call__, self._original]
        else:
            torch.nn.Module.__call__ = self._original  # type: ignore[method-assign]
            _kept.clear()
        _scopes.clear()


def _c_module_call_available() -> bool:
    """Whether the C wrapper can be installed here (built, and not switched off by ``OBS_NATIVE_RECORDER=0``)."""
    from recorder.hotpath import hotpath

    hot = hotpath()
    return hot is not None and hasattr(hot, "install_module_call")


def _install_c_module_call(original: Any, inline: bool, keep: bool) -> Any:
    """Configure the C wrapper and return it (a method descriptor of ``Module``), or None where the C hot path
    is not built or ``OBS_NATIVE_RECORDER=0``."""
    if not _c_module_call_available():
        return None
    import torch.compiler

    from obs._core.internal import report_internal_error as report
    from obs.runtime.torch._dynamo_polyfill import teach_dynamo
    from recorder.hotpath import hotpath

    descriptor = hotpath().install_module_call(
        module_type=torch.nn.Module, original=original, inline=inline, state=SUPPRESSION,
        compiler_globals=vars(torch.compiler), scopes=_scopes,
        scope_of=lambda module, stack: _scope_of(module, stack, keep), tracker=tracker,
        auto_begin=tracker.auto_begin, grad_enabled=torch.is_grad_enabled, report=report, on_phase=_phase,
        on_fault=_fault, failure_hooks=failure_hooks, compiled_region=get_eval_frame_callback)
    teach_dynamo(descriptor, original)
    return descriptor
