"""The tests' training loops, instead of a copy in each test file: :func:`train` (a small MLP, or any model, trained
with SGD, a step per batch through ``obs.steps`` or detected by obs), :func:`train_under` (given batches, with an env
config file in force) and :func:`train_compiled` (a model compiled afresh, with Dynamo's counters)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import torch

import obs
from obs.runtime.steps import tracker


def mlp(*widths: int) -> torch.nn.Sequential:
    """Linear layers of ``widths`` (8, 8, 2 by default) with a ReLU between each two."""
    widths = widths or (8, 8, 2)
    layers: list[torch.nn.Module] = []
    for n, (a, b) in enumerate(pairwise(widths), 1):
        layers += [torch.nn.Linear(a, b)] + ([torch.nn.ReLU()] if n < len(widths) - 1 else [])
    return torch.nn.Sequential(*layers)


def train(steps: int, model: torch.nn.Module | None = None, *, batch: int = 4, seed: int | None = None,
          loss: Callable[[torch.Tensor], torch.Tensor] = torch.sum,
          after: Callable[[int, torch.Tensor], None] | None = None, marked: bool = True) -> float | None:
    """``steps`` steps of ``model`` (an :func:`mlp` by default) on random batches of ``batch`` rows, each an
    ``obs.steps`` step: zero_grad, forward, ``loss(output)``, backward, SGD.  ``seed``: torch's seed, first;
    ``after(n, loss)``: called at the end of step n (from 1); ``marked=False``: a plain loop, whose steps obs detects
    from ``optimizer.step`` as in a script that marks none.  Returns the last step's loss."""
    if seed is not None:
        torch.manual_seed(seed)
    model = model if model is not None else mlp()
    inputs = next(p for p in model.parameters() if p.dim() == 2).shape[1]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    last = None
    batches = [torch.randn(batch, inputs) for _ in range(steps)]
    for n, x in enumerate(obs.steps(batches) if marked else batches, 1):
        opt.zero_grad()
        value = loss(model(x))
        value.backward()
        opt.step()
        if after is not None:
            after(n, value)
        last = value.item()
    return last


def train_under(config: str | os.PathLike[str], net: torch.nn.Module, opt: torch.optim.Optimizer,
                data: list[torch.Tensor], *, compiled: bool = False) -> None:
    """A step of ``net`` per batch of ``data`` (loss: the output's sum) with the env config file ``config`` in force,
    compiled with aot_eager when ``compiled``; the settings, the step count and Dynamo are reset after."""
    run = torch.compile(net, backend="aot_eager") if compiled else net
    obs.set_context(env_config_path=str(config))
    try:
        for x in data:
            run(x).sum().backward()
            opt.step()
            opt.zero_grad()
    finally:
        obs.reset_context()
        tracker.reset()
        if compiled:
            torch._dynamo.reset()


@dataclass
class CompiledRun:
    """What :func:`train_compiled` saw: each step's loss, and Dynamo's counters."""

    losses: list[float]
    frames: dict[str, int]  #: Dynamo's ``frames`` counters (``total``, ``ok``)
    breaks: dict[str, int]  #: each graph break's reason (its first line) and how often


def train_compiled(model: torch.nn.Module, steps: int, inputs: Callable[[], tuple[Any, ...]], *,
                   backend: str = "inductor", lr: float = 0.1, momentum: float = 0.0) -> CompiledRun:
    """``model`` compiled afresh by ``torch.compile`` (Dynamo reset, its counters cleared) with ``backend``, and
    ``steps`` steps of SGD on ``inputs()`` (a call's arguments, drawn each step); the loss is the output when it is a
    scalar, else its mean square.  Steps are not marked: obs detects them, as in a user's script."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    losses = []
    for _ in range(steps):
        out = compiled(*inputs())
        loss = out if out.dim() == 0 else out.square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    breaks = {reason.splitlines()[0]: n for reason, n in counters["graph_break"].items()}
    return CompiledRun(losses, dict(counters["frames"]), breaks)
