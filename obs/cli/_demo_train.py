"""obs demo's training script: its model, one training step, and the evaluation its fault is injected into.

``obs demo`` copies this file into ``obs_demo/train.py`` and runs it from there, so the fault it injects is raised
in a script in your folder, as in your own runs: the RDR bundle's "raised at" names this file's line.  obs itself
never imports it.
"""

from __future__ import annotations

from typing import Any

import torch


class Fault(torch.nn.Module):
    """Passes its input through; raises ``error`` while one is set (obs demo sets one to inject a fault)."""

    error: Exception | None = None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.error is not None:
            raise self.error
        return h


def build_model() -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), Fault(), torch.nn.Linear(64, 4))


def training_data(device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """512 samples of a noisy linear map, to learn in a few dozen steps."""
    x = torch.randn(512, 32, device=device)
    return x, x[:, :4] * 2.0 + 0.1 * torch.randn(512, 4, device=device)


def train_step(net: Any, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(net(x), y)
    loss.backward()
    optimizer.step()
    return loss


def evaluate(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x)
