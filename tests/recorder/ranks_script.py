"""Two ranks (gloo) all-reduce their gradients each step; at step 3 rank 1 dies or stalls.

Usage: python ranks_script.py RANK WORLD STORE CONFIG {dies|stalls|blocks}
dies: rank 1 raises; rank 0's all_reduce fails (op_timeout 60 s).  stalls: rank 1 sleeps 6 s in its data loading;
rank 0 waits in all_reduce (op_timeout 2 s: both ranks dump a hang), then both finish.
blocks: rank 1 never joins step 3's all_reduce (it sleeps 120 s); rank 0 prints BLOCKED and
blocks in it (gloo timeout 120 s, op_timeout 900 s): the test signals it there.
"""

from __future__ import annotations

import datetime
import sys
import time

import torch
import torch.distributed as dist
from sgd import SGD  # this folder's: torch.optim would import torch._dynamo

import obs

rank, world, store, config, scenario = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]


def load_batch(step):
    if rank == 1 and step == 3:
        if scenario == "dies":
            raise RuntimeError("rank 1 lost its data loader at step 3")
        time.sleep(120 if scenario == "blocks" else 6)
    if rank == 0 and step == 3 and scenario == "blocks":
        print("BLOCKED", flush=True)
    return torch.randn(2, 4)


blocks = scenario == "blocks"
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                        timeout=datetime.timedelta(seconds=120 if blocks else 20))
# dies: the survivor's all_reduce fails when the peer's process ends, which under load can take longer than a
# stall's 2 s after the peer raised: a 2 s watchdog would then also dump a hang
obs.set_context(env_config_path=config, op_timeout={"blocks": 900, "dies": 60}.get(scenario, 2))
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
opt = SGD(net.parameters(), lr=0.1)
for step in range(1, 6):
    with obs.step():
        net(load_batch(step)).sum().backward()
        for p in net.parameters():
            dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()
dist.destroy_process_group()
