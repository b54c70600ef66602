"""Teach torch.compile (Dynamo) to treat obs's ``Module.__call__`` as torch's own, so it compiles the same frames.

Dynamo inlines Python functions but stops at a C callable it does not know: every submodule call of
a compiled model would become a graph break.  ``substitute_in_graph`` registers a Python stand-in that
Dynamo inlines instead (the C call is never traced; in eager mode the C call runs).  The stand-in calls
the ``Module.__call__`` obs replaced, which is what the Python wrapper does while compiling.

A module compiled with ``torch.compile(module)`` (an ``OptimizedModule``) compiles ``module.__call__``: a C
callable there makes Dynamo add a frame of its own above it (``external_utils.wrap_inline``), which changes the
frames it compiles where a graph breaks.  :func:`teach_dynamo` therefore has ``OptimizedModule`` take torch's
own ``Module.__call__`` of the module it wraps; obs records the wrapper's call, under the wrapped module's name.

The Python wrapper (``OBS_NATIVE_RECORDER=0``) is a frame Dynamo would capture as a compiled module's top
frame, where torch's own ``Module.__call__`` is a skipped file: :func:`skip_frames` marks its code skipped
(frames only; Dynamo still inlines it when it traces a call).

Importing Dynamo costs about a second, so nothing here imports it: the stand-in is registered at once
when Dynamo is already loaded, else right after its first import (a one-shot import hook).
"""

from __future__ import annotations

import logging
import types
from typing import Any

from obs._core.after_import import after_import

__all__ = ["hidden_from_dynamo", "skip_frames", "teach_dynamo"]

logger = logging.getLogger("obs")
# [obs's C Module.__call__, the Module.__call__ it calls]: read by the stand-in when Dynamo traces, and when a
# module is wrapped by torch.compile
_original: list[Any] = [None, None]
_registered: set[int] = set()


def _register(descriptor: Any) -> None:
    if id(descriptor) in _registered:
        return
    _registered.add(id(descriptor))
    try:
        import torch
        from torch._dynamo.decorators import substitute_in_graph

        torch_call = torch.nn.Module._wrapped_call_impl
        if _original[1] is torch_call:
            # A copy of torch's own function (its code, file and line): the frame Dynamo shows in "from user
            # code" tracebacks is torch's `_wrapped_call_impl`, as without obs, never a frame of obs's.  It is
            # registered once per process: were obs installed later over someone else's Module.__call__, Dynamo
            # would trace torch's call beneath theirs, never a stale function of theirs.
            stand_in = types.FunctionType(torch_call.__code__, torch_call.__globals__, torch_call.__name__,
                                          torch_call.__defaults__, torch_call.__closure__)
        else:
            def stand_in(module: Any, *args: Any, **kwargs: Any) -> Any:
                return _original[1](module, *args, **kwargs)
        substitute_in_graph(descriptor, skip_signature_check=True)(stand_in)
    except Exception as exc:  # noqa: BLE001 - compiled models still run, with a graph break per module call
        logger.warning("obs: torch.compile will break its graphs at every module call while obs records modules "
                       "(the C Module.__call__ could not be registered with Dynamo: %r)", exc)


def _after_dynamo(then: Any) -> None:
    after_import("torch._dynamo", then)


def _compile_torch_call() -> None:
    """Have ``OptimizedModule`` compile the ``Module.__call__`` obs's C wrapper calls, not the C wrapper, when it is
    made while that wrapper is ``Module.__call__`` (whatever obs wraps at that moment)."""
    try:
        import torch
        from torch._dynamo.eval_frame import OptimizedModule
    except Exception as exc:  # noqa: BLE001 - compiled modules then compile one frame more around a graph break
        logger.warning("obs: torch.compile(module) may compile an extra frame while obs records modules (%r)", exc)
        return
    initialize = OptimizedModule._initialize
    if getattr(initialize, "_obs", False):
        return

    def _initialize(self: Any) -> None:
        installed, (ours, original) = torch.nn.Module.__call__, _original
        if installed is not ours or original is None:
            return initialize(self)
        torch.nn.Module.__call__ = original  # only while the wrapper binds its forward
        try:
            return initialize(self)
        finally:
            torch.nn.Module.__call__ = installed

    _initialize._obs = True  # type: ignore[attr-defined]
    OptimizedModule._initialize = _initialize  # type: ignore[method-assign]


def teach_dynamo(descriptor: Any, original: Any) -> None:
    """Make Dynamo inline ``original`` where it meets ``descriptor`` (obs's C ``Module.__call__``), and compile
    modules wrapped by ``torch.compile`` from ``original``."""
    _original[:] = [descriptor, original]
    _after_dynamo(lambda: _register(descriptor))
    _after_dynamo(_compile_torch_call)


def _skip(code: Any, recursive: bool) -> None:
    try:
        from torch._C._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy

        nested = FrameAction.SKIP if recursive else FrameAction.DEFAULT
        set_code_exec_strategy(code, FrameExecStrategy(FrameAction.SKIP, nested))
    except Exception as exc:  # noqa: BLE001 - Dynamo may then compile a frame of obs's own
        logger.warning("obs: torch.compile may compile %s of obs as a frame of its own (%r)", code.co_name, exc)


def skip_frames(code: Any, *, recursive: bool = False) -> None:
    """Have Dynamo run frames of ``code`` without compiling them; calls they make too when ``recursive``."""
    _after_dynamo(lambda: _skip(code, recursive))


def _no_op(*args: Any, **kwargs: Any) -> None:
    return None


def _substitute_no_op(fn: Any) -> None:
    try:
        from torch._dynamo.decorators import substitute_in_graph

        substitute_in_graph(fn, skip_signature_check=True)(_no_op)
    except Exception as exc:  # noqa: BLE001 - compiled code then breaks its graph where it would call fn
        logger.warning("obs: torch.compile will break graphs at each call of %r (%r)", fn, exc)


def hidden_from_dynamo(fn: Any) -> Any:
    """A hook that torch.compile leaves out of the graphs it traces (it returns None there) and whose frames,
    run between compiled graphs, it does not compile.  ``fn`` is a C callable or a Python one."""
    if not hasattr(fn, "__code__") and not hasattr(getattr(fn, "__func__", None), "__code__"):
        _after_dynamo(lambda: _substitute_no_op(fn))
        return fn
    from torch.compiler import is_compiling

    def hidden(*args: Any, **kwargs: Any) -> Any:
        if is_compiling():
            return None
        return fn(*args, **kwargs)

    skip_frames(hidden.__code__, recursive=True)
    return hidden
