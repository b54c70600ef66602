"""Bus handlers that write module and op events into a ring: the C hot path when built, Python otherwise.

Shared by every writer of a ring (the Running Data Recorder, the profiler's ring).  Each handler
writes its slot inline (one Python call per event): every attribute lookup and call here is paid per
module call or per aten op.  ``state.step`` is the step the Python module handlers stamp; a C
``SlotWriter`` has its own ``step`` attribute, which the owner sets at each step begin.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from obs._core.events import Event, Subscription, bus
from recorder.hotpath import hotpath
from recorder.layout import DeviceTarget, Kind
from recorder.ring import RingWriter

__all__ = ["RingSubscriptions", "describe_args", "module_handlers", "op_handler", "timed_module_handlers"]


def _slot_args(ring: RingWriter, name: str) -> tuple[Any, ...]:
    target = ring.slots(name)
    return (target.mm, target.base, target.capacity, target.counter, target.seq, ring.ids, ring.intern)


def module_handlers(ring: RingWriter, hot: Any, state: Any) -> tuple[Any, Any, Any]:
    """``(on_enter, on_exit, c_writer_or_None)`` writing MODULE_ENTER / MODULE_EXIT slots of ``ring``."""
    if hot is not None:
        writer = hot.SlotWriter(*_slot_args(ring, "module"))
        return writer.enter, writer.exit, writer
    pack, mm, base, cap, size, counter, seq, clock = ring.slots("module")
    ids, intern = ring.ids, ring.intern
    enter_kind, exit_kind = int(Kind.MODULE_ENTER), int(Kind.MODULE_EXIT)

    def on_enter(scope: str, module: Any) -> None:
        sid = ids.get(scope)
        if sid is None:
            sid = intern(scope)
        idx = next(counter)
        pack(mm, base + (idx % cap) * size, next(seq), idx + 1, clock(), enter_kind, 0, sid, state.step, 0, 0)

    def on_exit(scope: str, module: Any, error: Any) -> None:
        sid = ids.get(scope)
        if sid is None:
            sid = intern(scope)
        idx = next(counter)
        pack(mm, base + (idx % cap) * size, next(seq), idx + 1, clock(), exit_kind, error is not None, sid,
             state.step, 0, 0)

    return on_enter, on_exit, None


def timed_module_handlers(ring: RingWriter, state: Any, timer: Any, depth: int) -> tuple[Any, Any]:
    """``(on_enter, on_exit)`` writing MODULE_ENTER / MODULE_EXIT slots as :func:`module_handlers`' Python pair does,
    each call down to ``depth`` also timed on the device by ``timer`` (``obs.runtime.device_time.DeviceTimer``): its
    pair is keyed by the seq of its MODULE_ENTER slot, which only a writer of that slot knows (a DEVICE_TIME slot of
    target MODULE)."""
    from obs._core.internal import SUPPRESSION

    pack, mm, base, cap, size, counter, seq, clock = ring.slots("module")
    ids, intern = ring.ids, ring.intern
    enter_kind, exit_kind, target = int(Kind.MODULE_ENTER), int(Kind.MODULE_EXIT), int(DeviceTarget.MODULE)
    begin, end = timer.begin, timer.end
    local = threading.local()  # per thread: (start event, enter seq) of each open call, innermost last

    def on_enter(scope: str, module: Any) -> None:
        sid = ids.get(scope)
        if sid is None:
            sid = intern(scope)
        idx, number = next(counter), next(seq)
        pack(mm, base + (idx % cap) * size, number, idx + 1, clock(), enter_kind, 0, sid, state.step, 0, 0)
        try:
            calls = local.calls
        except AttributeError:
            calls = local.calls = []
        # the wrapper pushed this call's scope before calling us: the stack's length is its depth
        calls.append((begin() if len(SUPPRESSION.stack) <= depth else None, number, sid))

    def on_exit(scope: str, module: Any, error: Any) -> None:
        sid = ids.get(scope)
        if sid is None:
            sid = intern(scope)
        idx = next(counter)
        pack(mm, base + (idx % cap) * size, next(seq), idx + 1, clock(), exit_kind, error is not None, sid,
             state.step, 0, 0)
        calls = getattr(local, "calls", None)
        if calls:
            start, number, entered = calls.pop()
            if start is not None:
                end(start, target, entered, number)

    return on_enter, on_exit


def op_handler(ring: RingWriter, hot: Any) -> tuple[Any, Any]:
    """``(on_op, c_writer_or_None)`` writing OP slots (name, scope, duration, input signature) of ``ring``."""
    import torch

    from obs._core.internal import SUPPRESSION

    ids, intern = ring.ids, ring.intern
    signatures: dict[tuple[Any, ...], tuple[int, int]] = {}
    tensor_type = torch.Tensor
    kind = int(Kind.OP)

    def describe(name: str, args: Any) -> tuple[int, int]:
        return intern(name.removesuffix(".default")), intern(describe_args(args))

    if hot is not None:
        writer = hot.SlotWriter(*_slot_args(ring, "op"), tensor_type=tensor_type, signatures=signatures,
                                describe=describe, state=SUPPRESSION)
        return writer.op, writer
    pack, mm, base, cap, size, counter, seq, clock = ring.slots("op")

    def on_op(name: str, args: Any, kwargs: Any, duration_ns: int, error: Any) -> None:
        key: list[Any] = [name]
        for arg in args:
            if isinstance(arg, tensor_type):
                key.append(arg.shape)
                key.append(arg.dtype)
            else:
                key.append(arg.__class__)
        key_t = tuple(key)
        ids_pair = signatures.get(key_t)
        if ids_pair is None:
            ids_pair = signatures[key_t] = describe(name, args)
        stack = SUPPRESSION.stack
        scope = stack[-1] if stack else ""
        sid = ids.get(scope)
        if sid is None:
            sid = intern(scope)
        idx = next(counter)
        pack(mm, base + (idx % cap) * size, next(seq), idx + 1, clock(), kind, error is not None, ids_pair[0],
             sid, duration_ns, ids_pair[1])

    return on_op, None


def describe_args(args: Any) -> str:
    """``float32[64, 784]@cpu float32[784, 256]@cpu int`` for an op's positional inputs (once per signature)."""
    parts = []
    for arg in args:
        if hasattr(arg, "shape") and hasattr(arg, "dtype") and hasattr(arg, "device"):
            parts.append(f"{str(arg.dtype).removeprefix('torch.')}{list(arg.shape)}@{arg.device}")
        else:
            parts.append(type(arg).__name__)
    return " ".join(parts)


class RingSubscriptions:
    """The bus subscriptions that fill one ring and the C writers they hold (the recorder's and the profiler's).

    ``state.step`` is the step the Python module handlers stamp; :meth:`step_begins` sets the C writers' own.
    :meth:`close` removes the subscriptions, then releases the writers (before their ring closes)."""

    def __init__(self, ring: RingWriter) -> None:
        self.ring = ring
        self.subs: list[Subscription] = []
        self.writers: list[Any] = []  # C SlotWriters (recorder/_hotpath.c) and the native op observer
        self.module_writer: Any = None  # the C module writer, which keeps scopes for the native op observer

    def __bool__(self) -> bool:
        return bool(self.subs)

    def add(self, event: Event, handler: Any) -> None:
        self.subs.append(bus.subscribe(event, handler))

    def appender(self, name: str) -> Callable[[int, int, int, int, int, int], None]:
        """``append(kind, flags, a, b, c, d)`` into the ring's ``name`` slots (steps, phases, memory: a few per
        step): a C ``SlotWriter``'s where the hot path is built, released with the others at :meth:`close`, else
        the ring's Python appender."""
        hot = hotpath()
        if hot is None or not hasattr(hot.SlotWriter, "append"):
            return self.ring.appender(name)
        writer = hot.SlotWriter(*_slot_args(self.ring, name))
        self.writers.append(writer)
        return writer.append  # type: ignore[no-any-return]

    def step_begins(self, number: int) -> None:
        for writer in self.writers:
            writer.step = number

    # The module and op handlers write their slot inline, through the C hot path when it is built; the
    # Python ones are the fallback and the reference.
    def modules(self, state: Any, *, timer: Any = None, depth: int = 0) -> None:
        """MODULE_ENTER / MODULE_EXIT into the ring's ``module`` slots; with a device ``timer``, calls down to
        ``depth`` timed on the device too (the Python handlers: the C ones do not time)."""
        if timer is not None:
            enter, exit_ = timed_module_handlers(self.ring, state, timer, depth)
            self.add(Event.MODULE_ENTER, enter)
            self.add(Event.MODULE_EXIT, exit_)
            return
        enter, exit_, writer = module_handlers(self.ring, hotpath(), state)
        self.module_writer = writer
        if writer is not None:
            self.writers.append(writer)
        self.add(Event.MODULE_ENTER, enter)
        self.add(Event.MODULE_EXIT, exit_)

    def ops(self, *, native: bool) -> None:
        """Op records into the ring's ``op`` slots: with ``native``, from PyTorch's RecordFunction observed in C++
        (recorder/native_ops.py) where it can be built (no Python per op); otherwise the dispatch mode's OP
        events."""
        if native:
            from recorder import native_ops

            observer = native_ops.attach(self.ring, self.module_writer)
            if observer is not None:
                self.writers.append(observer)
                return
        handler, writer = op_handler(self.ring, hotpath())
        if writer is not None:
            self.writers.append(writer)
        self.add(Event.OP, handler)

    def close(self) -> None:
        for sub in self.subs:
            sub.remove()
        self.subs.clear()
        for writer in self.writers:
            writer.release()
        self.writers.clear()
        self.module_writer = None
