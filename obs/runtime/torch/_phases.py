"""The optimizer's step hooks and the backward wrapper: detected step boundaries and PHASE events (backward, optimizer).

One pair of global optimizer step hooks serves both the step tracker (a detected step ends when ``optimizer.step``
returns) and the optimizer phase, so a step pays one Python call before the optimizer and one after it, whichever of
the two is wanted.  The backward phase comes from a timing wrapper of ``torch.autograd.backward`` (``loss.backward()``
goes through it, so every backward is found without user code), installed only while someone subscribes to PHASE (the
profiler, the recorder); it leaves no frame in a user's traceback.  PHASE's handlers are called directly from a
snapshot the adapter refreshes whenever subscriptions change.  The forward phase comes from the module wrapper (a root
module call), the data phase from ``obs.steps``.

A step's phases do not overlap.  ``optimizer.step(closure)`` (LBFGS, Lightning's automatic optimization) runs
forward and backward inside the closure: the pre-hook hands the optimizer a wrapped closure, and the optimizer
phase is the step's time outside its closure calls, one PHASE event per stretch (each ends where a call begins,
the last at the step's end).  A step without a closure gets no wrapper and one event.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.optim import optimizer as torch_optimizer

from obs._core.internal import leave_traceback, report_internal_error
from obs.runtime.steps import tracker
from obs.runtime.torch._autograd_calls import AutogradCall

__all__ = ["TrainingHooks"]

Emit = Callable[[str, int, int], None]


class TrainingHooks:
    """The optimizer step hooks and the backward wrapper, kept to what :meth:`sync` asks for: ``steps`` (the tracker's
    detected boundaries) and ``handlers`` (PHASE's subscribers: the optimizer and backward phases)."""

    def __init__(self) -> None:
        self.steps = False
        self.handlers: tuple[Any, ...] = ()
        self._handles: list[Any] = []
        self._backward: AutogradCall | None = None

    @property
    def installed(self) -> bool:
        return bool(self._handles)

    def sync(self, *, steps: bool, handlers: tuple[Any, ...]) -> None:
        """Install or remove hooks to match: optimizer hooks while either is wanted, the backward wrapper with
        phases."""
        self.steps, self.handlers = steps, handlers
        if (steps or handlers) and not self._handles:
            self._handles = self._optimizer_hooks()
        elif not (steps or handlers) and self._handles:
            for handle in self._handles:
                handle.remove()
            self._handles = []
        if handlers and self._backward is None:
            self._backward = AutogradCall(torch.autograd, "backward", on_span=functools.partial(self.emit, "backward"))
        elif not handlers and self._backward is not None:
            self._backward.unwrap()  # someone who wrapped after us keeps their wrapper
            self._backward = None

    def remove(self) -> None:
        self.sync(steps=False, handlers=())

    def emit(self, name: str, begin_ns: int, end_ns: int) -> None:
        """One PHASE event to its handlers (a failing one is reported, never raised)."""
        for handler in self.handlers:
            try:
                handler(name, begin_ns, end_ns)
            except Exception as exc:  # noqa: BLE001 - reported; a handler's bug must not break training
                report_internal_error("PHASE handler", exc)

    def _optimizer_hooks(self) -> list[Any]:
        me, clock, emit = self, time.perf_counter_ns, self.emit
        started: dict[int, int] = {}  # id(optimizer) -> where its current optimizer stretch began

        def pre(opt: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if me.steps and not tracker.explicit and not tracker.in_step:  # tracker.auto_begin(), inlined
                tracker.begin()
            if not me.handlers:
                return None
            started[id(opt)] = clock()
            if len(args) > 1 or kwargs:  # args[0] is the optimizer: anything more may be a closure
                return _with_closure(opt, args, kwargs, started, emit)
            return None

        def post(opt: Any, args: Any, kwargs: Any) -> None:
            if me.steps and not tracker.explicit:  # tracker.auto_end(); the step ends before its optimizer phase
                tracker.end()
            begin = started.pop(id(opt), None)
            if begin is not None:
                emit("optimizer", begin, clock())

        return [torch_optimizer.register_optimizer_step_pre_hook(pre),
                torch_optimizer.register_optimizer_step_post_hook(post)]


def _with_closure(opt: Any, args: tuple[Any, ...], kwargs: dict[str, Any], started: dict[int, int],
                  emit: Emit) -> Any:
    """``step``'s arguments with its closure wrapped (None, to leave them as they are, when it has none): each call
    ends the optimizer stretch before it, and a new one begins where it returns."""
    closure = args[1] if len(args) > 1 else kwargs.get("closure")
    if not callable(closure):
        return None
    key, clock, getframe = id(opt), time.perf_counter_ns, sys._getframe

    def obs_closure(*a: Any, **k: Any) -> Any:
        begin, now = started.get(key), clock()
        if begin is not None and now > begin:
            emit("optimizer", begin, now)
        try:
            return closure(*a, **k)
        except BaseException as exc:
            leave_traceback(exc, getframe())  # this wrapper leaves the user's traceback
            raise
        finally:
            if begin is not None and key in started:  # not after step returned (a closure kept and called later)
                started[key] = clock()

    if len(args) > 1:
        return (args[0], obs_closure, *args[2:]), kwargs
    return args, {**kwargs, "closure": obs_closure}
