"""PHASE events for backward and the optimizer: a wrapper of ``torch.autograd.backward`` and optimizer step hooks.

Installed by the adapter only while someone subscribes to PHASE (the profiler, the recorder).  ``loss.backward()``
goes through ``torch.autograd.backward``, so wrapping that one function finds every backward without
user code.  The forward phase comes from the module wrapper (a root module call), the data phase
from ``obs.steps``.  The wrapper (:mod:`obs.runtime.torch._autograd_calls`) leaves no frame in a user's traceback.

A step's phases do not overlap.  ``optimizer.step(closure)`` (LBFGS, Lightning's automatic optimization) runs
forward and backward inside the closure: the pre-hook hands the optimizer a wrapped closure, and the optimizer
phase is the step's time outside its closure calls, one PHASE event per stretch (each ends where a call begins,
the last at the step's end).  A step without a closure gets no wrapper and one event, as before.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch
from torch.optim import optimizer as torch_optimizer

from obs._core.events import Event, bus
from obs.runtime.torch._autograd_calls import AutogradCall

__all__ = ["PhaseHooks", "emit_phase"]


def emit_phase(name: str, begin_ns: int, end_ns: int) -> None:
    bus.emit(Event.PHASE, name, begin_ns, end_ns)


class PhaseHooks:
    """Wraps ``torch.autograd.backward`` and hooks every optimizer's step until ``remove()``."""

    def __init__(self) -> None:
        clock = time.perf_counter_ns
        self._backward = AutogradCall(torch.autograd, "backward", on_start=lambda roots: clock(),
                                      on_end=lambda begin: emit_phase("backward", begin, clock()))
        started: dict[int, int] = {}  # id(optimizer) -> where its current optimizer stretch began

        def pre(opt: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            started[id(opt)] = clock()
            if len(args) > 1 or kwargs:  # args[0] is the optimizer: anything more may be a closure
                return _with_closure(opt, args, kwargs, started)
            return None

        def post(opt: Any, args: Any, kwargs: Any) -> None:
            begin = started.pop(id(opt), None)
            if begin is not None:
                emit_phase("optimizer", begin, clock())

        self._handles = [torch_optimizer.register_optimizer_step_pre_hook(pre),
                         torch_optimizer.register_optimizer_step_post_hook(post)]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._backward.unwrap()  # someone who wrapped after us keeps their wrapper


def _with_closure(opt: Any, args: tuple[Any, ...], kwargs: dict[str, Any], started: dict[int, int]) -> Any:
    """``step``'s arguments with its closure wrapped (None, to leave them as they are, when it has none): each call
    ends the optimizer stretch before it, and a new one begins where it returns."""
    closure = args[1] if len(args) > 1 else kwargs.get("closure")
    if not callable(closure):
        return None
    key, clock, getframe = id(opt), time.perf_counter_ns, sys._getframe

    def obs_closure(*a: Any, **k: Any) -> Any:
        begin, now = started.get(key), clock()
        if begin is not None and now > begin:
            emit_phase("optimizer", begin, now)
        try:
            return closure(*a, **k)
        except BaseException as exc:
            tb = exc.__traceback__
            if tb is not None and tb.tb_frame is getframe():
                exc.__traceback__ = tb.tb_next  # this wrapper leaves the user's traceback
            raise
        finally:
            if begin is not None and key in started:  # not after step returned (a closure kept and called later)
                started[key] = clock()

    if len(args) > 1:
        return (args[0], obs_closure, *args[2:]), kwargs
    return args, {**kwargs, "closure": obs_closure}
