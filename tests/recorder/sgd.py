"""SGD by hand, for the recorder's scripts (imported from the script's folder): a ``torch.optim`` optimizer imports
torch._dynamo when it is made, ~1.8 s of CPU in every process, and no script here is about the optimizer (each marks
its steps with ``obs.step``)."""

from __future__ import annotations

from collections.abc import Iterable

import torch


class SGD:
    """``torch.optim.SGD(params, lr)`` without momentum: ``step()`` and ``zero_grad()`` (grads set to None)."""

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float) -> None:
        self.params, self.lr = list(params), lr

    @torch.no_grad()
    def step(self) -> None:
        for p in self.params:
            if p.grad is not None:
                p.add_(p.grad, alpha=-self.lr)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
