"""One rank of the 2-rank DDP job of test_ranks.py (gloo, CPU): a small MLP trained STEPS steps with Adam, each rank
on its own data shard, rank 1's batch scaled x1000 at step BAD.  It trains once with the monitor (activations of the
first layers on), then once without it, and writes each run's losses to ``{out}/losses_{rank}.json``.  Each step
all_reduces its loss (summed over the ranks, as a script does for its log) and sends it to the other rank
(``batch_isend_irecv`` of one P2POp pair made once, with ``isend``/``irecv`` imported before obs wrapped them, used in
both runs) through the Python API: the monitor's collectives (``cc``).

Rank 0 is started as torchrun starts its workers (``RANK`` and ``WORLD_SIZE`` in the environment), rank 1 as
``torch.multiprocessing.spawn`` does (nothing: its monitor starts before ``init_process_group`` without knowing its
rank, and learns it at the first step).

Usage: python ddp_script.py OUT CONFIG RANK
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import irecv, isend  # before obs wraps them, as a module imported early has them
from torch.nn.parallel import DistributedDataParallel

import obs

STEPS, BAD = 150, 120


def train(rank: int, exchange: list[dist.P2POp]) -> list[float]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
    ddp = DistributedDataParallel(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    shard = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    w = torch.randn(16, 1, generator=torch.Generator().manual_seed(7))
    losses = []
    for step in range(STEPS):
        x = torch.randn(32, 16, generator=shard)
        if rank == 1 and step == BAD:
            x = x * 1e3  # the bad shard
        loss = nn.functional.mse_loss(ddp(x), x @ w)
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)  # the job's loss, summed over the ranks, for a log: a Python collective (cc)
        exchange[0].tensor.copy_(loss.detach().reshape(1))  # and sent to the other rank, its loss received
        for work in dist.batch_isend_irecv(exchange):
            work.wait()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def main() -> None:
    out, config = sys.argv[1], sys.argv[2]
    rank, world = int(sys.argv[3]), 2
    torch.set_num_threads(1)
    obs.set_context(env_config_path=config)  # as a script under obs run: before init_process_group
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=world)
    # one P2POp pair for both runs, made with the functions imported before the monitor wrapped them
    exchange = [dist.P2POp(isend, torch.zeros(1), 1 - rank), dist.P2POp(irecv, torch.zeros(1), 1 - rank)]
    watched = train(rank, exchange)
    from obs.features.monitor.feature import feature

    assert feature.monitor is not None and feature.monitor.flush()
    obs.reset_context()  # the monitor ends, its files complete
    plain = train(rank, exchange)  # the pair made while the monitor's wrappers were in place, used after
    with open(os.path.join(out, f"losses_{rank}.json"), "w") as fh:
        json.dump({"plain": plain, "watched": watched}, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
