"""Bus handlers that write module and op events into a ring: the C hot path when built, Python otherwise.

Shared by every writer of a ring (the Running Data Recorder, the profiler's ring).  Each handler
writes its slot inline (one Python call per event): every attribute lookup and call here is paid per
module call or per aten op.  ``state.step`` is the step the Python module handlers stamp; a C
``SlotWriter`` has its own ``step`` attribute, which the owner sets at each step begin.
"""

from __future__ import annotations

from typing import Any

from recorder.layout import Kind
from recorder.ring import RingWriter

__all__ = ["describe_args", "module_handlers", "op_handler", "unsubscribe"]


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


def unsubscribe(subs: list[Any], writers: list[Any]) -> None:
    """Remove ``subs`` (bus subscriptions), then release ``writers`` (C SlotWriters, before their ring closes);
    both lists are emptied."""
    for sub in subs:
        sub.remove()
    subs.clear()
    for writer in writers:
        writer.release()
    writers.clear()
