"""One rank of a 2-rank gloo job under torchrun, for test_snapshot.py: a rank busy elsewhere while the other waits.

Usage: torchrun --nproc-per-node 2 snapshot_script.py CONFIG PIDS_DIR SCENARIO
Each of 3 steps: a small net's forward and backward, then its loss all_reduced.  Files beside PIDS_DIR say where
the ranks are (``rank0_waits``: rank 0 is about to enter step 2's all_reduce; ``rank1_spins``: rank 1 spins).

spin: at step 2 rank 1 spins in a Python loop (spin(), the lines marked "the spin loop") until the file ``release``
    beside PIDS_DIR exists (at most 60 s), while rank 0 waits in the all_reduce (op_timeout 600 s: no hang).
stall: rank 0's op_timeout is 2 s, rank 1's 0 (never): rank 1 sleeps 5 s in its data loading at step 2; rank 0's
    watchdog fires in the all_reduce and asks rank 1 for its stacks.
"""

from __future__ import annotations

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

import obs

config, pids, scenario = sys.argv[1], sys.argv[2], sys.argv[3]
here = os.path.dirname(pids)


def say(name):
    with open(os.path.join(here, name), "w"):
        pass


def spin(release):
    deadline = time.monotonic() + 60
    total = 0
    while time.monotonic() < deadline:  # the spin loop
        for i in range(200_000):  # the spin loop
            total += i  # the spin loop
        if os.path.exists(release):  # the spin loop
            break
    return total


def load_batch(rank, step):
    if scenario == "stall" and rank == 1 and step == 2:
        time.sleep(5)
    return torch.randn(2, 4)


def main():
    rank = int(os.environ["RANK"])
    with open(os.path.join(pids, f"{os.getpid()}.pid"), "w") as fh:  # the test kills whatever is left
        fh.write(str(rank))
    op_timeout = 600 if scenario == "spin" else (2 if rank == 0 else 0)
    obs.set_context(env_config_path=config, op_timeout=op_timeout)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    for step in range(1, 4):
        with obs.step():
            loss = net(load_batch(rank, step)).sum()
            loss.backward()
            total = loss.detach().reshape(1)
            if scenario == "spin" and step == 2:
                if rank == 1:
                    say("rank1_spins")
                    spin(os.path.join(here, "release"))
                else:
                    say("rank0_waits")
            dist.all_reduce(total)
    dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()
