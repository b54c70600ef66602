"""One rank of a gloo job under torchrun; a scenario goes wrong at step 3 (see test_dist.py).

Usage: torchrun --nproc-per-node N dist_script.py CONFIG PIDS_DIR SCENARIO
   or: python dist_script.py CONFIG PIDS_DIR spawn   (two ranks by torch.multiprocessing.spawn, DDP)
   or: obs run --config CONFIG dist_script.py CONFIG PIDS_DIR launcher   (two ranks as Lightning's DDP launcher
       starts them: this script again by subprocess, with LOCAL_RANK and WORLD_SIZE but no RANK; rank 1 raises at
       step 3 as in raises; obs only from obs run, no set_context)
Each step: the gradients of a small net all_reduced (4 collectives), then the loss all_reduced and
a stop flag broadcast from rank 0.

clean: also a subgroup {0, last} passed by position, an async all_reduce, a send/recv pair each way between ranks 0
    and 1, then a batch_isend_irecv pair between them (its P2POps made with isend/irecv imported before obs).
    Ranks 0 and 2 record through the recorder's C hot path, ranks 1 and 3 through its Python handlers
    (OBS_NATIVE_RECORDER=0): with 4 ranks each path has a rank in the subgroup and one out of it, one in the pair and
    one out of it.
skip: the last rank skips step 3's loss all_reduce (it goes on to the broadcast).
size: rank 1 all_reduces its loss as 2 numbers at step 3.
raises: rank 1 raises in its data loading at step 3.
kill: rank 1 SIGKILLs itself at step 3, once rank 0 waits in step 3's first collective (rank 1 on the C hot path,
    rank 0 on the Python handlers; ddp_kill the other way round).
nan: rank 1's batch at step 3 is NaN (the NaN check finds it there; the all_reduce spreads it to rank 0).
ddp: the net is a DistributedDataParallel (its bucket all_reduces), no explicit gradient reduction; rank 1 without
    PyTorch's Flight Recorder (TORCH_FR_BUFFER_SIZE=0: obs records its buckets through a Python communication hook).
ddp_kill: ddp, and rank 1 SIGKILLs itself at step 3 as in kill (its ring holds the bucket all_reduces it issued).
ddp_kill_first: ddp, and rank 1 SIGKILLs itself at step 3 while rank 0 is still in its data loading (torchrun
    stops rank 0 before it waits on rank 1: no collective disagrees).
ddp_hang: ddp, and rank 1 stalls 12 s there: rank 0's watchdog (op_timeout 2 s) dumps a hang while it waits in the
    bucket all_reduce, then that all_reduce times out (gloo, 6 s) in its backward.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import time

config, pids, scenario = sys.argv[1], sys.argv[2], sys.argv[3]

if __name__ == "__main__" and scenario == "launcher" and "LOCAL_RANK" not in os.environ:
    # As lightning.fabric's _SubprocessScriptLauncher (which does it once torch is imported: here before, so that the
    # two ranks import it side by side)
    import subprocess

    from tests.recorder._jobs import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2", LOCAL_RANK="0")
    subprocess.Popen([sys.executable, os.path.abspath(__file__), *sys.argv[1:]], env={**os.environ, "LOCAL_RANK": "1"})

#: the ranks whose recorder takes its Python handlers (OBS_NATIVE_RECORDER=0), the others its C hot path
PYTHON_RANKS = {"clean": ("1", "3"), "kill": ("0",), "ddp_kill": ("1",)}
if scenario in PYTHON_RANKS:  # torchrun gives every rank one environment: each rank sets its own switch
    for name in ("OBS_NATIVE", "OBS_NATIVE_RECORDER"):
        os.environ.pop(name, None)
    if os.environ["RANK"] in PYTHON_RANKS[scenario]:
        os.environ["OBS_NATIVE_RECORDER"] = "0"
if scenario == "ddp" and os.environ["RANK"] == "1":
    os.environ["TORCH_FR_BUFFER_SIZE"] = "0"  # before obs sets its own size

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from sgd import SGD  # noqa: E402  (this folder's: torch.optim would import torch._dynamo)
from torch.distributed import irecv, isend  # noqa: E402  (before obs wraps them, as an early import has them)

import obs  # noqa: E402


def load_batch(rank, step):
    if step == 3 and rank == 1 and scenario in ("raises", "launcher"):
        raise RuntimeError("rank 1 lost its data loader at step 3")
    if step == 3 and scenario in ("kill", "ddp_kill", "ddp_kill_first"):
        here = os.path.join(os.path.dirname(pids), "rank0_at_step3")
        if rank == 0:
            open(here, "w").close()
            if scenario == "ddp_kill_first":
                time.sleep(60)  # torchrun stops it once it sees rank 1 gone
        elif rank == 1:
            while not os.path.exists(here):
                time.sleep(0.01)
            time.sleep(0.5)  # rank 0 waits in its first collective of step 3 before rank 1 dies
            os.kill(os.getpid(), signal.SIGKILL)
    if step == 3 and rank == 1 and scenario == "ddp_hang":
        time.sleep(12)
    if step == 3 and rank == 1 and scenario == "nan":
        return torch.full((2, 4), float("nan"))
    return torch.randn(2, 4)


def train(rank, world, init_method="env://"):
    with open(os.path.join(pids, f"{os.getpid()}.pid"), "w") as fh:  # the test kills whatever is left
        fh.write(str(rank))
    if scenario != "launcher":
        # a job that ends well waits on no rank for long; under load a 2 s watchdog would still fire there
        obs.set_context(env_config_path=config, op_timeout=60 if scenario in ("clean", "ddp", "nan", "spawn") else 2)
    if scenario in PYTHON_RANKS:
        from recorder.hotpath import hotpath

        print(f"rank {rank} records through {'the C hot path' if hotpath() else 'the Python handlers'}", flush=True)
    # spawn, launcher: the ranks start one after the other, outside torchrun; under load one can be more than 6 s
    # behind the other at the rendezvous or in a collective, and neither scenario waits on gloo's timeout
    timeout = 60 if scenario in ("spawn", "launcher") else 6
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout))
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    ddp = scenario.startswith("ddp") or scenario == "spawn"
    if ddp:
        net = torch.nn.parallel.DistributedDataParallel(net)
    opt = SGD(net.parameters(), lr=0.1)
    sub = dist.new_group([0, world - 1])  # every rank makes every group, in the same order
    for step in range(1, 5):
        with obs.step():
            loss = net(load_batch(rank, step)).sum()
            loss.backward()
            if not ddp:
                for p in net.parameters():
                    dist.all_reduce(p.grad)
            opt.step()
            opt.zero_grad()
            total = loss.detach().reshape(1)
            if scenario == "size" and step == 3 and rank == 1:
                total = torch.cat([total, total])
            if not (scenario == "skip" and step == 3 and rank == world - 1):
                dist.all_reduce(total)
            stop = torch.zeros(1)
            dist.broadcast(stop, 0)
            if scenario == "clean":
                dist.all_reduce(total, dist.ReduceOp.MAX, sub)  # the group by position; a no-op off the group
                dist.all_reduce(total, async_op=True).wait()
                if rank == 0:
                    dist.send(total, 1)
                    dist.recv(total, 1)
                elif rank == 1:
                    dist.recv(total, 0)
                    dist.send(total, 0)
                if rank < 2:  # and a batched pair, its P2POps made with the isend/irecv imported before obs
                    peer, got = 1 - rank, torch.zeros(1)
                    pair = [dist.P2POp(isend, total, peer), dist.P2POp(irecv, got, peer)]
                    for work in dist.batch_isend_irecv(pair if rank == 0 else pair[::-1]):
                        work.wait()
    dist.destroy_process_group()


if __name__ == "__main__":
    if scenario == "spawn":  # torch.multiprocessing: no RANK in the environment, the rank known at init
        import torch.multiprocessing as mp

        mp.spawn(train, args=(2, f"file://{os.path.join(os.path.dirname(pids), 'store')}"), nprocs=2)
    elif scenario == "launcher":  # rank 1 was started above
        train(int(os.environ["LOCAL_RANK"]), 2)
    else:
        train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
