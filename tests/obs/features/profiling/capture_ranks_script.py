"""One rank of a 2-rank DDP job (gloo, CPU) for test_capture_ranks.py, run by ``obs run`` under torchrun.

Usage: torchrun --nproc-per-node 2 -m obs run --config CONFIG capture_ranks_script.py FOLDER
Writes ``{pid}.pid`` into FOLDER/pids at start and ``ready_{rank}`` into FOLDER after step 2, then trains until 5
steps after the file FOLDER/stop appears (at most 3,000 steps); the ranks agree on it each step, so they stop at the
same one.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

import obs

folder = sys.argv[1]
with open(os.path.join(folder, "pids", f"{os.getpid()}.pid"), "w"):
    pass
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                                                      torch.nn.Linear(16, 2)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
stop, last = os.path.join(folder, "stop"), 0
for step, x in enumerate(obs.steps(torch.randn(4, 8) for _ in range(3000)), start=1):
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    if step == 2:
        with open(os.path.join(folder, f"ready_{rank}"), "w"):
            pass
    flag = torch.tensor([float(os.path.exists(stop))])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() and not last:
        last = step + 5  # a few steps more: the test sees steps after the capture without module spans
    if step == last:
        break
    time.sleep(0.01)
dist.destroy_process_group()
