"""The small training run whose op records the hot-path and native-observer tests compare."""

from __future__ import annotations

import torch


def train_and_fail() -> None:
    """Two SGD steps of a 4-8-2 MLP, then a shape error in the last Linear (caught here)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(2):
        net(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    try:
        net[2](torch.ones(3, 5))
    except RuntimeError:
        pass
    else:
        raise AssertionError("the last Linear accepted a wrong shape")
