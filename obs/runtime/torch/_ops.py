"""Op-level interception: a TorchDispatchMode that publishes one OP event per aten op.

It costs 5–16 µs per op (docs/benchmarks.md), so it is pushed only while someone subscribes to OP,
on the thread that subscribed (dispatch modes are thread-local; autograd carries them into
backward).  Our own tensor work runs under ``suppressed()`` and passes straight through.
"""

from __future__ import annotations

import time
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

from obs._core.events import Event, bus
from obs._core.internal import SUPPRESSION, report_internal_error

__all__ = ["OpInterceptor"]


def _emit(name: str, args: Any, kwargs: Any, duration_ns: int, error: BaseException | None) -> None:
    for handler in bus.handlers(Event.OP):
        try:
            handler(name, args, kwargs, duration_ns, error)
        except Exception as exc:  # noqa: BLE001 - reported; a handler's bug must not break the op
            report_internal_error("OP handler", exc)


#: Called as ``hook(error, "op", name, args, kwargs)`` when an aten op raises.
failure_hooks: tuple[Any, ...] = ()


class OpInterceptor(TorchDispatchMode):
    """Times every aten op and publishes it; entered with ``install()``, left with ``remove()``."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # torch.compile then compiles as without obs (any other dispatch mode makes Dynamo skip every
        # frame) and turns this mode off while it traces; compiled code runs with it on again, so the
        # ops a compiled graph still dispatches (aot_eager's, Inductor's extern kernels) are seen.
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if SUPPRESSION.depth:
            return func(*args, **kwargs)
        name = func.__name__
        start = time.perf_counter_ns()
        try:
            out = func(*args, **kwargs)
        except Exception as exc:
            for hook in failure_hooks:  # exception_dump: before FAULT, so the RDR bundle can name the dump
                try:
                    hook(exc, "op", name, args, kwargs)
                except Exception as inner:  # noqa: BLE001 - reported; a handler's bug must not break the op
                    report_internal_error("op failure hook", inner)
            _emit(name, args, kwargs, time.perf_counter_ns() - start, exc)
            if not getattr(exc, "_obs_fault_reported", False):
                exc._obs_fault_reported = True  # type: ignore[attr-defined]
                bus.emit(Event.FAULT, "op_error", name, exc)
            raise
        _emit(name, args, kwargs, time.perf_counter_ns() - start, None)
        for handler in bus.handlers(Event.OP_OUTPUT):
            try:
                handler(name, args, kwargs, out)
            except Exception as exc:  # noqa: BLE001 - reported; a handler's bug must not break the op
                report_internal_error("OP_OUTPUT handler", exc)
        return out

    def install(self) -> OpInterceptor:
        self.__enter__()
        return self

    def remove(self) -> None:
        self.__exit__(None, None, None)
