"""One rank of a gloo job under torchrun with a slow rank (see test_doctor.py).

Usage: torchrun --nproc-per-node N doctor_script.py CONFIG PIDS_DIR SCENARIO STEPS

ddp: a DistributedDataParallel model; rank 1's backward is slowed by 0.2 s at every step by a hook.
ddp_data: a DistributedDataParallel model; the last rank sleeps 0.2 s in its data loading at every step (its first
sync is DDP's bucket all_reduce).
Each step ends with an all_reduce of a stop flag and the loss.  With STEPS 0 the job runs until a file ``stop``
appears beside PIDS_DIR.
"""

from __future__ import annotations

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

import obs

config, pids, scenario, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
SLOW_S = 0.2
stop_file = os.path.join(os.path.dirname(pids), "stop")


class Batches:
    """A data loader whose last rank is slow (scenario ddp_data)."""

    def __init__(self, rank: int, world: int) -> None:
        self.slow = scenario == "ddp_data" and rank == world - 1

    def __iter__(self):
        step = 0
        while not steps or step < steps:
            step += 1
            if self.slow:
                time.sleep(SLOW_S)
            yield torch.randn(8, 16)


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    with open(os.path.join(pids, f"{os.getpid()}.pid"), "w") as fh:  # the test kills whatever is left
        fh.write(str(rank))
    obs.set_context(env_config_path=config)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=20))
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    if scenario == "ddp" and rank == 1:
        net[2].register_full_backward_hook(lambda *_: time.sleep(SLOW_S))  # the first layer backward reaches
    net = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    for batch in obs.steps(Batches(rank, world)):
        loss = net(batch).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        # Every rank stops at the same step: whoever sees the stop file first tells the others.
        stop = torch.tensor([float(os.path.exists(stop_file)), loss.item()])
        dist.all_reduce(stop, dist.ReduceOp.MAX)
        if stop[0] > 0:
            break
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
