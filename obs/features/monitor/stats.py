"""The monitor's statistics of one tensor or a list of them (msprobe's ``ops``), as float32 vectors on their device,
and msprobe's ``print_struct`` entries."""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["NORM", "shape_of", "stats", "stats_all", "struct_of", "tensors_in"]

NORM = ("norm",)


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The floating-point tensors of a module's inputs or outputs (a tensor, or a tuple or list of them)."""
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, (tuple, list)):
        return [v for v in value if isinstance(v, torch.Tensor) and v.is_floating_point()]
    return []


def shape_of(t: torch.Tensor) -> str:
    return str(list(t.shape))


def stats(t: torch.Tensor, ops: tuple[str, ...], eps: float) -> torch.Tensor:
    """One tensor's statistics (msprobe's ops), as one float32 vector on its device."""
    t = t.detach()
    if t.numel() == 0:
        return torch.full((len(ops),), math.nan, device=t.device)
    if ops == NORM:
        return torch.linalg.vector_norm(t, dtype=torch.float32).reshape(1)
    f = t.float()
    out = []
    for op in ops:
        if op == "norm":
            out.append(torch.linalg.vector_norm(f))
        elif op == "min":
            out.append(f.min())
        elif op == "max":
            out.append(f.max())
        elif op == "mean":
            out.append(f.mean())
        elif op == "zeros":
            out.append((f.abs() < eps).float().mean())
        elif op == "nans":
            out.append(f.isnan().sum().float())
        else:  # id: the value of a one-element tensor
            out.append(f.reshape(-1)[0] if f.numel() == 1 else torch.tensor(math.nan, device=f.device))
    return torch.stack(out)


def stats_all(tensors: list[torch.Tensor], ops: tuple[str, ...], eps: float) -> torch.Tensor:
    """The statistics of each tensor, one after another, in one float32 vector (norms alone: one fused op)."""
    if ops == NORM:
        return torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32))
    return torch.cat([stats(t, ops, eps) for t in tensors])


def struct_of(value: Any) -> dict[str, Any]:
    """msprobe's print_struct entry of a module's inputs or outputs."""
    if isinstance(value, torch.Tensor):
        return {"config": "tensor", "tensor": f"size={tuple(value.shape)}, dtype={value.dtype}"}
    if isinstance(value, (tuple, list)):
        out: dict[str, Any] = {"config": f"{type(value).__name__}[{len(value)}]"}
        for i, v in enumerate(value):
            out[str(i)] = (f"size={tuple(v.shape)}, dtype={v.dtype}" if isinstance(v, torch.Tensor)
                           else str(type(v)))
        return out
    return {"config": str(type(value))}
