"""Op-level interception: a TorchDispatchMode that publishes one OP event per aten op.

It costs 5–16 µs per op (docs/benchmarks.md), so it is pushed only while someone subscribes to OP,
on the thread that subscribed (dispatch modes are thread-local; autograd carries them into
backward).  Our own tensor work runs under ``suppressed()`` and passes straight through.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from obs._core.events import Event, bus
from obs._core.internal import SUPPRESSION, report_internal_error, suppressed
from obs.runtime.torch._failures import failure_hooks

__all__ = ["OpInterceptor", "set_inputs_before_writes"]


def _emit(name: str, args: Any, kwargs: Any, duration_ns: int, error: BaseException | None) -> None:
    for handler in bus.handlers(Event.OP):
        try:
            handler(name, args, kwargs, duration_ns, error)
        except Exception as exc:  # noqa: BLE001 - reported; a handler's bug must not break the op
            report_internal_error("OP handler", exc)


#: While true (the data dump records inputs in a dumped step), the tensors an op writes in place are handed to
#: OP_OUTPUT handlers as they were before the op (copies): an in-place op's input is not its output.  Its output is
#: handed as a copy too: the version counter of a tensor written in place is bumped only after this mode returns,
#: so a handler keying what it read by tensor and version would take the output for the input it already read.
inputs_before_writes = False
_written: dict[Any, tuple[int, ...]] = {}  # op -> positions of the arguments it writes in place
#: Ops that write arguments their schema does not mark as written: eager BatchNorm's running statistics in training.
_UNDECLARED_WRITES = {"aten::native_batch_norm": (3, 4), "aten::cudnn_batch_norm": (3, 4),
                      "aten::miopen_batch_norm": (3, 4)}


def set_inputs_before_writes(on: bool) -> None:
    """Hand OP_OUTPUT handlers the tensors an op writes in place as they were before it (see
    :data:`inputs_before_writes`), or stop."""
    global inputs_before_writes
    inputs_before_writes = bool(on)


def _written_positions(func: Any) -> tuple[int, ...]:
    found = _written.get(func)
    if found is None:
        schema = func._schema
        found = _written[func] = _UNDECLARED_WRITES.get(schema.name) or tuple(
            i for i, a in enumerate(schema.arguments)
            if not a.kwarg_only and a.alias_info is not None and a.alias_info.is_write)
    return found


def _copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_copy(v) for v in value) if isinstance(value, tuple) else [_copy(v) for v in value]
    return value


def _before_writes(args: tuple[Any, ...], positions: tuple[int, ...]) -> tuple[Any, ...]:
    """``args`` with the tensors at ``positions`` (those the op writes in place) copied."""
    copied = list(args)
    for i in positions:
        if i < len(copied):
            copied[i] = _copy(copied[i])
    return tuple(copied)


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
        if SUPPRESSION.depth or func._namespace == "obs":  # obs's own ops (graph statistics, Print in a graph)
            return func(*args, **kwargs)
        name = func.__name__
        seen, before = args, None
        if inputs_before_writes:  # a dict lookup per op; copies only for the ops that write in place
            positions = _written.get(func)
            if positions is None:
                positions = _written_positions(func)
            if positions:
                with suppressed():
                    seen = before = _before_writes(args, positions)
        start = time.perf_counter_ns()
        try:
            out = func(*args, **kwargs)
        except Exception as exc:
            if failure_hooks.snapshot:  # exception_dump: before FAULT, so the RDR bundle can name the dump
                failure_hooks.call(exc, "op", name, args, kwargs)
            _emit(name, args, kwargs, time.perf_counter_ns() - start, exc)
            if not getattr(exc, "_obs_fault_reported", False):
                exc._obs_fault_reported = True  # type: ignore[attr-defined]
                bus.emit(Event.FAULT, "op_error", name, exc)
            raise
        _emit(name, args, kwargs, time.perf_counter_ns() - start, None)
        shown = out
        if before is not None:
            with suppressed():
                shown = _copy(out)
        for handler in bus.handlers(Event.OP_OUTPUT):
            try:
                handler(name, seen, kwargs, shown)
            except Exception as exc:  # noqa: BLE001 - reported; a handler's bug must not break the op
                report_internal_error("OP_OUTPUT handler", exc)
        return out

    def install(self) -> OpInterceptor:
        self.__enter__()
        return self

    def remove(self) -> None:
        self.__exit__(None, None, None)
