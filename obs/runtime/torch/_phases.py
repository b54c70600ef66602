"""PHASE events for backward and the optimizer: a wrapper of ``torch.autograd.backward`` and optimizer step hooks.

Installed by the adapter only while someone subscribes to PHASE (the profiler).  ``loss.backward()``
goes through ``torch.autograd.backward``, so wrapping that one function finds every backward without
user code.  The forward phase comes from the module wrapper (a root module call), the data phase
from ``obs.steps``.  The wrapper (:mod:`obs.runtime.torch._autograd_calls`) leaves no frame in a user's traceback.
"""

from __future__ import annotations

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
        started: dict[int, int] = {}

        def pre(opt: Any, args: Any, kwargs: Any) -> None:
            started[id(opt)] = clock()

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
