"""The tests' one training loop: a small MLP trained with SGD, a step per batch through ``obs.steps`` (instead of a
copy of this loop in each test file)."""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise

import torch

import obs


def mlp(*widths: int) -> torch.nn.Sequential:
    """Linear layers of ``widths`` (8, 8, 2 by default) with a ReLU between each two."""
    widths = widths or (8, 8, 2)
    layers: list[torch.nn.Module] = []
    for n, (a, b) in enumerate(pairwise(widths), 1):
        layers += [torch.nn.Linear(a, b)] + ([torch.nn.ReLU()] if n < len(widths) - 1 else [])
    return torch.nn.Sequential(*layers)


def train(steps: int, model: torch.nn.Module | None = None, *, batch: int = 4, seed: int | None = None,
          loss: Callable[[torch.Tensor], torch.Tensor] = torch.sum,
          after: Callable[[int, torch.Tensor], None] | None = None) -> float | None:
    """``steps`` steps of ``model`` (an :func:`mlp` by default) on random batches of ``batch`` rows, each an
    ``obs.steps`` step: zero_grad, forward, ``loss(output)``, backward, SGD.  ``seed``: torch's seed, first;
    ``after(n, loss)``: called at the end of step n (from 1).  Returns the last step's loss."""
    if seed is not None:
        torch.manual_seed(seed)
    model = model if model is not None else mlp()
    inputs = next(p for p in model.parameters() if p.dim() == 2).shape[1]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    last = None
    for n, x in enumerate(obs.steps([torch.randn(batch, inputs) for _ in range(steps)]), 1):
        opt.zero_grad()
        value = loss(model(x))
        value.backward()
        opt.step()
        if after is not None:
            after(n, value)
        last = value.item()
    return last
