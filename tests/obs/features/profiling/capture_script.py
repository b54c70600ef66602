"""A job for test_capture_window.py: the RDR and the profiler on (training_trace), steps detected from the optimizer
(no obs.steps); prints ``ready`` after step 2, trains until the file ``stop`` appears beside its config, and 5 steps
more (a window asked for just before ``stop`` runs to its end)."""

from __future__ import annotations

import os
import sys
import time

import torch

import obs
from obs.runtime.steps import tracker

config = sys.argv[1]
stop = os.path.join(os.path.dirname(config), "stop")
obs.set_context(env_config_path=config)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(4, 8)
more = None
for _ in range(3000):
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    if tracker.step == 2:
        print("ready", flush=True)
    if more is None and os.path.exists(stop):
        more = 5
    if more is not None:
        more -= 1
        if more < 0:
            break
    time.sleep(0.01)
print("steps", tracker.step, flush=True)
