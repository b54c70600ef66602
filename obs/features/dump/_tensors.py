"""Tensors as dumps see them: host numpy copies, MindSpore dtype names, the tensors inside arguments.

Everything here runs under :func:`obs._core.internal.suppressed` so obs's own copies and
reductions are invisible to obs's hooks.  A tensor that cannot be read (a CUDA context broken by
the failure, a fake tensor under ``obs.compile``, a freed saved tensor) gives a reason instead of
an array; callers record it and go on.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from obs._core.internal import suppressed
from printsink.dtypes import NAME_OF_TORCH

__all__ = ["UNINITIALISED_OPS", "describe", "host_array", "keep_scopes", "ms_dtype", "read_after_the_step",
           "tensors_in"]

#: aten ops (name prefixes) whose outputs are uninitialised memory (any bits, NaN included) until something writes them
UNINITIALISED_OPS = ("empty", "new_empty", "empty_like", "empty_strided", "new_empty_strided", "resize")

_WIDEN = {torch.bfloat16: torch.float32}
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # subclasses (fake, functional, DTensor) may have no memory to copy


def read_after_the_step(tensor: torch.Tensor, cpu: bool = False) -> bool:
    """Whether a dump reads ``tensor``'s values after the step, through :mod:`obs.runtime.device_readback`, rather than
    as it is made: a plain strided CUDA tensor (a CPU one too where ``cpu``: the tests drive that path without a
    GPU)."""
    return (tensor.is_cuda or (cpu and tensor.is_cpu)) and type(tensor) in _PLAIN and tensor.layout is torch.strided


def ms_dtype(tensor: torch.Tensor) -> str:
    """MindSpore's name of the tensor's dtype (``Float32``); torch's own name for the others."""
    return NAME_OF_TORCH.get(str(tensor.dtype)) or str(tensor.dtype).removeprefix("torch.")


def host_array(tensor: torch.Tensor) -> np.ndarray:
    """A C-contiguous numpy copy on the host (bfloat16 widened to float32, as MindSpore's dump does)."""
    with suppressed():
        t = tensor.detach()
        if t.layout is not torch.strided:
            t = t.to_dense()
        if t.device.type != "cpu":
            t = t.to("cpu")
        if t.is_conj() or t.is_neg():
            t = t.resolve_conj().resolve_neg()
        if t.dtype in _WIDEN:
            t = t.to(_WIDEN[t.dtype])
        try:
            return np.ascontiguousarray(t.numpy())
        except TypeError:  # a dtype numpy lacks (float8, ...): the values, widened
            return np.ascontiguousarray(t.to(torch.float32).numpy())


def describe(tensor: torch.Tensor) -> dict[str, Any]:
    """Shape, dtype and device of a tensor for meta files (no data is read)."""
    return {"shape": [int(d) for d in tensor.shape], "dtype": ms_dtype(tensor), "device": str(tensor.device)}


def tensors_in(args: Any, kwargs: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(where, tensor)`` for every tensor in positional and keyword arguments, lists and tuples flattened
    (``args[0]``, ``args[1][2]``, ``kwargs['mask']``); dict values too."""
    for i, value in enumerate(args or ()):
        yield from _walk(value, f"args[{i}]", 0)
    for key, value in (kwargs or {}).items():
        yield from _walk(value, f"kwargs[{key!r}]", 0)


def _walk(value: Any, where: str, depth: int) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        yield where, value
    elif depth < 4 and isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _walk(item, f"{where}[{i}]", depth + 1)
    elif depth < 4 and isinstance(value, dict):
        for key, item in value.items():
            yield from _walk(item, f"{where}[{key!r}]", depth + 1)


def keep_scopes(scope: str, module: Any) -> None:
    """A MODULE_ENTER subscriber that does nothing: it keeps the module wrapper, and so the scope stack that
    names ops and findings, installed."""
