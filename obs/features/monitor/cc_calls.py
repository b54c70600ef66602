"""A collective call as the monitor's ``cc`` sees it (:mod:`obs.features.monitor.collectives`): the ops wrapped, a
call's tensor arguments by parameter and the call stack in msprobe's form (isend/irecv's wrapping that torch's
``P2POp`` checks need: :mod:`obs.runtime.torch._p2p`)."""

from __future__ import annotations

import re
import sys
from typing import Any

import torch

from obs.features.monitor.stats import shape_of

__all__ = ["OPS", "OUTPUT_ONLY", "call_stack", "described", "tensor_args"]

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
