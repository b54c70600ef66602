"""A collective call as the monitor's ``cc`` sees it (:mod:`obs.features.monitor.collectives`): the ops wrapped, a
call's tensor arguments by parameter, the call stack in msprobe's form, and isend/irecv wrapped so that torch's
``P2POp`` checks still pass."""

from __future__ import annotations

import functools
import re
import sys
from typing import Any

import torch

from obs.features.monitor.stats import shape_of

__all__ = ["OPS", "OUTPUT_ONLY", "Peer", "call_stack", "described", "same_ops", "tensor_args"]

#: msprobe's distributed_ops.yaml, then the all-to-alls the issue names
OPS = ("send", "recv", "isend", "irecv", "batch_isend_irecv", "broadcast", "all_reduce", "reduce", "scatter",
       "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor", "all_gather", "gather", "_all_gather_base",
       "all_gather_into_tensor", "all_to_all", "all_to_all_single")
#: each op's arguments that only receive (uninitialised memory before the call): no pre rows
OUTPUT_ONLY = {"recv": {"tensor"}, "irecv": {"tensor"}, "scatter": {"tensor"}, "reduce_scatter": {"output"},
               "_reduce_scatter_base": {"output"}, "reduce_scatter_tensor": {"output"}, "all_gather": {"tensor_list"},
               "gather": {"gather_list"}, "_all_gather_base": {"output_tensor"},
               "all_gather_into_tensor": {"output_tensor"}, "all_to_all": {"output_tensor_list"},
               "all_to_all_single": {"output"}}
#: msprobe's stack_blacklist.yaml, with obs's own wrappers in place of msprobe's
_BLACKLIST = re.compile(r"obs/features/monitor/(collectives|cc_calls)\.py|obs/runtime/torch/_collectives\.py|"
                        r"torch/nn/modules/module\.py|multiprocessing|debugpy")



def call_stack() -> list[str]:
    """msprobe's call stack of a collective: ``path[line]   function`` per frame of the caller's, innermost first,
    the blacklisted frames (this module's among them) left out; frames are walked, no source is read."""
    frame: Any = sys._getframe(1)
    out = []
    while frame is not None:
        line = f"{frame.f_code.co_filename}[{frame.f_lineno}]"
        if not _BLACKLIST.search(line):
            out.append(f"{line}   {frame.f_code.co_name}")
        frame = frame.f_back
    return out


def tensor_args(params: tuple[str, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[str, Any]]:
    """The call's tensor arguments (a tensor, or a list of them), each with its parameter's name, in the function's
    parameter order (msprobe's order for a call by position: positional, then keyword; by keyword, the same places)."""
    import torch.distributed as dist

    if params and len(args) <= len(params):
        named = {**dict(zip(params, args)), **kwargs}
        given = [(p, named[p]) for p in params if p in named] + [(k, v) for k, v in kwargs.items() if k not in params]
    else:
        given = [("", a) for a in args] + list(kwargs.items())
    out: list[tuple[str, Any]] = []
    for name, arg in given:
        if isinstance(arg, torch.Tensor):
            out.append((name, arg))
        elif isinstance(arg, (list, tuple)) and arg:
            if all(isinstance(a, torch.Tensor) for a in arg):
                out.append((name, list(arg)))
            elif all(isinstance(a, dist.P2POp) for a in arg):
                out.append((name, [a.tensor for a in arg]))
    return out


def described(arg: torch.Tensor | list[torch.Tensor]) -> tuple[torch.Tensor, str, str]:
    """One argument as one tensor to measure (a list flattened into one, as msprobe stacks it), its shape and dtype."""
    if isinstance(arg, torch.Tensor):
        t, shape, dtype = arg.detach(), shape_of(arg), str(arg.dtype)
    else:
        first = arg[0]
        same = all(a.shape == first.shape for a in arg)
        shape = str([len(arg), *first.shape]) if same else str([sum(a.numel() for a in arg)])
        t, dtype = torch.cat([a.detach().reshape(-1) for a in arg]), str(first.dtype)
    if not (t.is_floating_point() or t.is_complex()):
        t = t.float()
    elif t.is_complex():
        t = torch.view_as_real(t)
    return t, shape, dtype


def _chain(function: Any) -> list[Any]:
    """``function`` and the functions it wraps (``__wrapped__``, as functools.wraps sets it)."""
    out = []
    while function is not None and len(out) < 8:
        out.append(function)
        function = getattr(function, "__wrapped__", None)
    return out


class Peer:
    """isend or irecv wrapped, as torch's P2POp needs it: equal to the function it wraps (a P2POp's op is checked
    against ``c10d.isend``/``irecv`` by equality when it is made: one made with a function imported before the
    monitor started passes), and a peer given under the other's key taken as its own (``batch_isend_irecv`` picks
    the key by identity with ``c10d.isend``: a P2POp made while this was in place, used after, passes its peer as
    ``group_src``)."""

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
    """A P2POp made with a function equal to this module's isend/irecv (one imported before they were wrapped) gets
    them: ``batch_isend_irecv`` tells isends from irecvs by identity."""
    from torch.distributed import distributed_c10d as c10d

    current = [c10d.isend, c10d.irecv]
    for op in (args[0] if args else kwargs.get("p2p_op_list")) or ():
        for function in current:
            if getattr(op, "op", None) is not function and function == getattr(op, "op", None):
                op.op = function
