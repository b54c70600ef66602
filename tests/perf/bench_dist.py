"""Cost of recording collectives on a 2-rank DDP training loop (gloo, CPU).

Run: python tests/perf/bench_dist.py [--rounds 30] [--jobs 3] [--steps 20] [--out bench-dist.json]
Target (issue "Multi-rank"): recording collectives adds <= 2% per step over the same run without obs.

Two ranks (torch.multiprocessing, one core each where the machine has two) train the same
DistributedDataParallel model; in each round both switch between variants in the same order:

- ``plain``: obs off; DDP reduces its buckets in C++ (no hook).
- ``DDP relay, obs off``: a model built while obs recorded collectives keeps obs's comm-hook relay
  (PyTorch's allreduce_hook in Python): the relay's own cost.
- ``rdr step``: the RDR records steps and collectives (every bucket all_reduce, scheduled and completed).
- ``rdr module``: the RDR's default granularity (modules too).

Each job reports rank 0's median step time per variant; the table is the median over ``--jobs`` jobs.
The same loop on one rank (a world of 1: DDP still reduces through gloo) shows the per-step cost
without the other rank's noise: on a shared 2-core machine two ranks wait on each other's
scheduling, and their ratios move by several percent from job to job.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import obs  # noqa: E402
from _harness import Workload, measure, report  # noqa: E402

WORLD = 2  #: ranks of the multi-rank job (a one-rank job runs first)
WARMUP = 5  #: untimed steps after a variant is switched on


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                               torch.nn.ReLU(), torch.nn.Linear(256, 10))


def _workload(ddp: torch.nn.Module, name: str) -> Workload:
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x, y = torch.randn(64, 784), torch.randint(0, 10, (64,))

    def step() -> None:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    return Workload(name, step, 40)


def _rdr(tmp: str, granularity: str):
    def setup():
        path = os.path.join(tmp, f"{granularity}.json")
        with open(path, "w") as fh:
            json.dump({"rdr": {"enable": True, "path": tmp, "granularity": granularity}}, fh)
        obs.set_context(env_config_path=path)
        return obs.reset_context
    return setup


def _noop():
    """Collectives wrapped and published to a subscriber that does nothing (no recorder)."""
    return obs.subscribe(obs.Event.COLLECTIVE, lambda record: None).remove


def _rank(rank: int, world: int, store: str, rounds: int, steps: int, out: str) -> None:
    if len(os.sched_getaffinity(0)) >= world:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank]})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    tmp = tempfile.mkdtemp(prefix=f"obs-bench-dist-{rank}-")
    plain = _workload(torch.nn.parallel.DistributedDataParallel(_model(0)), "plain")
    stop = _rdr(tmp, "step")()
    model = torch.nn.parallel.DistributedDataParallel(_model(0))  # built while recording: it has the relay
    stop()
    assert hasattr(model, "_obs_relay") and not hasattr(plain, "_obs_relay")
    relayed = _workload(model, "relayed")
    variants = {"plain": (plain, None), "DDP relay, obs off": (relayed, None),
                "relay + no-op subscriber": (relayed, _noop),
                "rdr step, no relay": (plain, _rdr(tmp, "step")),
                "rdr step": (relayed, _rdr(tmp, "step")), "rdr module": (relayed, _rdr(tmp, "module"))}
    current = {"workload": plain}

    def switch(name):
        workload, setup = variants[name]

        def run():
            current["workload"] = workload
            teardown = setup() if setup is not None else (lambda: None)
            for _ in range(WARMUP):  # past the start of obs's threads: a rank slowed by them slows the other
                workload.step()
            return teardown
        return run

    mixed = Workload("ddp mlp", lambda: current["workload"].step(), steps)
    medians = measure(mixed, {name: switch(name) for name in variants}, rounds)
    collectives = []
    with obs.subscribe(obs.Event.COLLECTIVE, collectives.append):
        relayed.step()
    dist.barrier()
    if rank == 0:
        with open(out, "w") as fh:
            json.dump({"medians": medians, "collectives_per_step": len(collectives)}, fh)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--jobs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant per round")
    parser.add_argument("--out", default="bench-dist.json")
    args = parser.parse_args()
    results, per_job, events = {}, {}, 0
    for world in (1, WORLD):
        jobs = []
        for job in range(args.jobs):
            tmp = tempfile.mkdtemp(prefix="obs-bench-dist-")
            result = os.path.join(tmp, "result.json")
            mp.spawn(_rank, args=(world, os.path.join(tmp, "store"), args.rounds, args.steps, result), nprocs=world,
                     join=True)
            with open(result) as fh:
                jobs.append(json.load(fh))
            print(f"{world} rank(s), job {job + 1}/{args.jobs}: "
                  + "  ".join(f"{k} {v:.3f} ms" for k, v in jobs[-1]["medians"].items()))
        name = f"ddp mlp, {world} rank{'s' if world > 1 else ''}"
        results[name] = {v: statistics.median(j["medians"][v] for j in jobs) for v in jobs[0]["medians"]}
        per_job[name] = [j["medians"] for j in jobs]
        events = jobs[0]["collectives_per_step"]
    report("bench_dist (gloo, DDP MLP)", results, "plain", args.out, {
        "jobs": args.jobs, "rounds": args.rounds, "steps_per_round": args.steps,
        "collective_events_per_step": events, "per_job": per_job, "targets": {"rdr step": "<= 1.02"}})

if __name__ == "__main__":
    main()
