"""isend and irecv wrapped so that torch's point-to-point checks still pass: for every wrapper of them (the
recorder's collectives, the monitor's ``cc``).

torch checks a ``P2POp``'s function by *equality* with ``distributed_c10d.isend``/``irecv`` when the op is made
(``_check_op``), and ``batch_isend_irecv`` tells an isend from an irecv by *identity* with ``c10d.isend``.  A plain
wrapper breaks both for a module that imported ``isend`` before obs wrapped it (``ValueError: Invalid op``), and a
``P2POp`` made while a wrapper was in place and used after it came off gets its peer under the wrong keyword.
:class:`Peer` is equal to the function it wraps and takes a peer given under the other's keyword as its own;
:func:`same_ops` hands a ``P2POp`` made with an earlier function the one in place now.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["Peer", "same_ops"]


def _chain(function: Any) -> list[Any]:
    """``function`` and the functions it wraps (``__wrapped__``, as functools.wraps sets it)."""
    out = []
    while function is not None and len(out) < 8:
        out.append(function)
        function = getattr(function, "__wrapped__", None)
    return out


class Peer:
    """``wrapper`` (isend's or irecv's, by ``name``) as torch's P2POp needs it: equal to ``original`` and to what
    that wraps, a peer under the other's keyword (``group_src`` for an isend) taken as its own."""

    def __init__(self, name: str, wrapper: Any, original: Any) -> None:
        functools.update_wrapper(self, original)
        self._call, self._original = wrapper, original
        self._keys = ("group_src", "group_dst") if name == "isend" else ("group_dst", "group_src")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        wrong, right = self._keys
        if wrong in kwargs and right not in kwargs:
            kwargs[right] = kwargs.pop(wrong)
        return self._call(*args, **kwargs)

    def __eq__(self, other: object) -> bool:
        return other is self or any(other is f for f in _chain(self._original))

    def __hash__(self) -> int:
        return hash(self._original)


def same_ops(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """``batch_isend_irecv``'s arguments: a P2POp made with a function equal to the isend/irecv in place now (one
    imported before they were wrapped) gets the one in place."""
    from torch.distributed import distributed_c10d as c10d

    current = [c10d.isend, c10d.irecv]
    for op in (args[0] if args else kwargs.get("p2p_op_list")) or ():
        for function in current:
            if getattr(op, "op", None) is not function and function == getattr(op, "op", None):
                op.op = function
