"""One rank of a small DDP job (gloo, CPU) with the profiler's metrics on (from the OTEL_* variables the test sets)
and the Running Data Recorder's ring, reporting its loss through obs.scalar; run under torchrun by
tests/exporters/test_prometheus.py.  Rank 1 sleeps 0.2 s in its data loading at every step: its peer waits for it
in DDP's bucket all_reduce.

``argv[1]``: a file whose existence asks every rank to stop training (they agree through an all_reduce, so all stop
at the same step); each rank then writes ``held_{rank}`` beside it and idles, its metrics still served and its ring
still mapped, until a file ``release`` appears there; ``argv[2]``: a folder where each worker leaves ``{pid}.pid``
(the test kills leftovers by pid); ``argv[3]``: the env config file (the profiler on, its output, the batch size
and tokens per step, the recorder).
"""

import os
import sys
import time

import torch
import torch.distributed as dist

import obs

SLOW_S = 0.2
stop_file, pids, config = sys.argv[1:4]
folder = os.path.dirname(stop_file)
open(os.path.join(pids, f"{os.getpid()}.pid"), "w").close()
obs.set_context(env_config_path=config)
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(rank)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                                                      torch.nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
deadline = time.monotonic() + 60  # never longer than this, whatever the test does


def batches():
    while True:
        if rank == 1:
            time.sleep(SLOW_S)
        yield torch.randn(16, 8)


steps = obs.steps(batches())
for x in steps:
    opt.zero_grad()
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    obs.scalar("loss", loss)
    done = torch.tensor([float(os.path.exists(stop_file) or time.monotonic() > deadline)])
    dist.all_reduce(done)  # every rank stops at the same step
    if done.item():
        break
steps.close()  # the last step ends here
open(os.path.join(folder, f"held_{rank}"), "w").close()
while not os.path.exists(os.path.join(folder, "release")) and time.monotonic() < deadline:
    time.sleep(0.05)
dist.destroy_process_group()
