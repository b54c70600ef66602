"""One rank of a small DDP job (gloo, CPU) with the profiler's metrics on (from the OTEL_* variables the test sets),
reporting its loss through obs.scalar; run under torchrun by tests/exporters/test_prometheus.py.

``argv[1]``: a file whose existence asks every rank to stop (they agree through an all_reduce, so all stop at
the same step); ``argv[2]``: a folder where each worker leaves ``{pid}.pid`` (the test kills leftovers by pid);
``argv[3]``: the env config file (the profiler on, the batch size and tokens per step).
"""

import os
import sys
import time

import torch
import torch.distributed as dist

import obs

stop_file, pids, config = sys.argv[1:4]
open(os.path.join(pids, f"{os.getpid()}.pid"), "w").close()
obs.set_context(env_config_path=config)
dist.init_process_group("gloo")
torch.manual_seed(dist.get_rank())
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                                                      torch.nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
deadline = time.monotonic() + 40  # never longer than this, whatever the test does


def batches():
    while True:
        done = torch.tensor([float(os.path.exists(stop_file) or time.monotonic() > deadline)])
        dist.all_reduce(done)  # every rank stops at the same step
        if done.item():
            return
        yield torch.randn(16, 8)


for x in obs.steps(batches()):
    opt.zero_grad()
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    obs.scalar("loss", loss)
    time.sleep(0.05)
dist.destroy_process_group()
