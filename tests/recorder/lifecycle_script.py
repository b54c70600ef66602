"""Runs of a small training loop for the recorder's file lifecycle; tests/recorder/test_lifecycle.py runs it.

Usage: python lifecycle_script.py SCENARIO [RDR_PATH]

disk_full   trains, then limits file size (RLIMIT_FSIZE, SIGXFSZ ignored: writes fail with EFBIG,
            as on a full disk) and raises in a forward: the bundle cannot be written
clean       trains and exits 0 (RDR from the environment: MS_RDR_ENABLE=1, maybe no path)
crash       trains and raises in a forward
spawn       two ranks by torch.multiprocessing.spawn (no RANK): set_context before
            init_process_group (gloo), three steps with all_reduce, then a manual dump each
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys

import torch
from sgd import SGD  # this folder's: torch.optim would import torch._dynamo

import obs

SCENARIO = sys.argv[1]
RDR_PATH = sys.argv[2] if len(sys.argv) > 2 else ""


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)
        self.fail = False

    def forward(self, x):
        if self.fail:
            raise ValueError("boom in forward")
        return self.fc2(torch.relu(self.fc1(x)))


def train(net, steps, all_reduce=False):
    opt = SGD(net.parameters(), lr=0.01)
    for _ in range(steps):
        with obs.step():
            net(torch.randn(2, 4)).sum().backward()
            if all_reduce:
                import torch.distributed as dist

                for p in net.parameters():
                    dist.all_reduce(p.grad)
            opt.step()
            opt.zero_grad()


def use_config():
    config = os.path.join(RDR_PATH, f"obs-{os.getpid()}.json")
    with open(config, "w") as fh:
        json.dump({"rdr": {"enable": True, "path": RDR_PATH}}, fh)
    obs.set_context(env_config_path=config)


def spawned(rank, store):
    import datetime

    import torch.distributed as dist

    use_config()  # before init_process_group: the rank is not known yet
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    train(Net(), 3, all_reduce=True)
    # One write of a whole line (atomic on a pipe): print() writes the text and the newline apart, and the
    # two ranks' lines could interleave.
    sys.stdout.write(json.dumps({"rank": rank, "bundle": obs.rdr.dump("manual")}) + "\n")
    sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    if SCENARIO == "spawn":
        import torch.multiprocessing as mp

        mp.spawn(spawned, args=(os.path.join(RDR_PATH, "store"),), nprocs=2, join=True)
        sys.exit(0)
    if SCENARIO == "disk_full":
        use_config()
    net = Net()
    train(net, 20)
    if SCENARIO == "disk_full":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (8192, resource.RLIM_INFINITY))
    if SCENARIO in ("disk_full", "crash"):
        net.fail = True
        train(net, 1)
    print("DONE", flush=True)
