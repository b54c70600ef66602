"""Cost of recording collectives on a 2-rank DDP training loop (gloo, CPU).

Run: python tests/perf/bench_dist.py [--rounds 16] [--jobs 3] [--steps 40] [--out bench-dist.json]
     python tests/perf/bench_dist.py --instructions [--out bench-dist-instructions.json]
         (valgrind: see _instructions.py)
Target (issue "Multi-rank"): recording collectives adds <= 2% per step over the same run without obs.

Two ranks (torch.multiprocessing, one core each where the machine has two) train the same
DistributedDataParallel model; in each round both switch between variants in the same order:

- ``plain``: obs off; DDP reduces its buckets in C++ (no hook).  PyTorch's Flight Recorder is on, as
  torch 2.13 has it by default (2,000 entries) and as obs sets it.
- ``rdr step``: the RDR records steps and collectives; the model, built while obs records, has obs's
  comm-hook relay: each bucket on record as it is issued (scheduled and completed), what ``obs top`` reads.
- ``rdr step, buckets from the Flight Recorder``: the same on a model built before obs (no relay: DDP
  reduces in C++, its buckets read from the Flight Recorder at dump time): nothing of obs runs per bucket.
- ``rdr module``: the RDR's default granularity (modules too), on the model without the relay.
- ``DDP relay, obs off``: the model with the relay, obs off: its reduction in Python, the relay's own cost.
- ``plain, TORCH_FR_BUFFER_SIZE=0``: on one rank, jobs of their own beside the others (the buffer size
  is read when the group is made): what the Flight Recorder itself costs, obs or not.

Each job reports rank 0's median step time per variant (the table: the median over ``--jobs`` jobs) and
each round's median; the paired ratio is the median over every job's rounds of (variant / plain in the
same round), which cancels the machine's drift between rounds.
The same loop on one rank (a world of 1: DDP still reduces through gloo) shows the per-step cost
without the other rank's noise: on a shared 2-core machine two ranks wait on each other's
scheduling, and their ratios move by several percent from job to job.  Rank 0 also times obs's own
work per step directly (a step boundary's two events into the ring), and counts the bucket records
a dump holds for one step (the Flight Recorder route at work).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import obs

from _harness import Workload, measure, measure_rounds, paired_ratios, report

WORLD = 2  #: ranks of the multi-rank job (a one-rank job runs first)
#: untimed steps after a variant is switched on: a recorder's first ~10 steps on two ranks are up to twice as slow
#: (its start: ring file, threads, marker), which a real run pays once, and this bench would pay every round
WARMUP = 50


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


def _relayed(tmp: str) -> Workload:
    """The model built while obs records: it has the relay."""
    stop = _rdr(tmp, "step")()
    model = torch.nn.parallel.DistributedDataParallel(_model(0))
    stop()
    assert hasattr(model, "_obs_relay")
    return _workload(model, "relayed")


def _boundary_us(n: int = 20000) -> float:
    """obs's own work at a step boundary with the RDR on (the optimizer hooks' begin and end: two ring events)."""
    from obs.runtime.steps import tracker

    times = []
    for _ in range(5):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            tracker.auto_begin()
            tracker.auto_end()
        times.append((time.perf_counter_ns() - t0) / n / 1e3)
    tracker.reset()
    return statistics.median(times)


def _rank(rank: int, world: int, store: str, rounds: int, steps: int, out: str) -> None:
    if len(os.sched_getaffinity(0)) >= world:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank]})
    torch.set_num_threads(1)
    logging.getLogger("obs").setLevel(logging.ERROR)  # the forced relay's log line, once per rank
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    tmp = tempfile.mkdtemp(prefix=f"obs-bench-dist-{rank}-")
    plain = _workload(torch.nn.parallel.DistributedDataParallel(_model(0)), "plain")
    if os.environ.get("TORCH_FR_BUFFER_SIZE") == "0":  # the Flight Recorder's own cost: plain PyTorch without it
        medians = measure(plain, {"plain": lambda: (lambda: None)}, rounds)
        if rank == 0:
            with open(out, "w") as fh:
                json.dump({"medians": medians}, fh)
        dist.destroy_process_group()
        shutil.rmtree(tmp, ignore_errors=True)
        return
    relayed = _relayed(tmp)
    assert "_obs_relay" not in plain.__dict__
    variants = {"plain": (plain, None), "rdr step": (relayed, _rdr(tmp, "step")),
                FR_ROUTE: (plain, _rdr(tmp, "step")), "rdr module": (plain, _rdr(tmp, "module")),
                "DDP relay, obs off": (relayed, None)}
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
    per_round = measure_rounds(mixed, {name: switch(name) for name in variants}, rounds)
    medians = {name: statistics.median(values) for name, values in per_round.items()}
    stop = _rdr(tmp, "step")()
    boundary = _boundary_us()
    for _ in range(2):
        with obs.step():
            plain.step()
    from obs import rdr

    bundle = rdr.dump("manual")
    stop()
    with open(os.path.join(bundle, "collectives.jsonl")) as fh:
        records = [json.loads(line) for line in fh]
    last = max(r["step"] for r in records)
    from_fr = [r["desc"] for r in records if r["step"] == last and r.get("source") == "flight_recorder"]
    dist.barrier()
    if rank == 0:
        with open(out, "w") as fh:
            json.dump({"medians": medians, "per_round": per_round, "step_boundary_us": boundary,
                       "bucket_records_per_step": from_fr}, fh)
    dist.destroy_process_group()
    shutil.rmtree(tmp, ignore_errors=True)


FR_OFF = "plain, TORCH_FR_BUFFER_SIZE=0 (own jobs)"
FR_ROUTE = "rdr step, buckets from the Flight Recorder"
#: the variants whose instructions per step --instructions counts
COUNTED = ("plain", "rdr step", FR_ROUTE, "rdr module")


def _count_child(steps: int) -> None:
    """Under callgrind (``--instructions``): a one-rank DDP job counting each variant's steps after untimed ones."""
    from _instructions import Counter, count_steps

    counter = Counter()
    torch.set_num_threads(1)
    logging.getLogger("obs").setLevel(logging.ERROR)
    tmp = tempfile.mkdtemp(prefix="obs-bench-dist-count-")
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
    plain = _workload(torch.nn.parallel.DistributedDataParallel(_model(0)), "plain")
    relayed = _relayed(tmp)
    current = {"workload": plain}

    def on(workload: Workload, setup: Any) -> Any:
        def run() -> Any:
            current["workload"] = workload
            return setup()
        return run

    setups = {"plain": on(plain, lambda: (lambda: None)), "rdr step": on(relayed, _rdr(tmp, "step")),
              FR_ROUTE: on(plain, _rdr(tmp, "step")), "rdr module": on(plain, _rdr(tmp, "module"))}
    count_steps(counter, lambda: current["workload"].step(), {name: setups[name] for name in COUNTED}, 15, steps)
    dist.destroy_process_group()
    shutil.rmtree(tmp, ignore_errors=True)
    os._exit(0)  # the counts are written; skip the interpreter's slow exit under valgrind


def _instructions(steps: int) -> dict[str, dict[str, float]]:
    """Instructions per step of the one-rank job (every thread: the training thread's and gloo's), and the
    ratio to plain."""
    from _instructions import available, run_counted

    why = available()
    if why is not None:
        raise SystemExit(f"--instructions: {why}")
    [counts] = run_counted([[os.path.abspath(__file__), "--count-child", "--steps", str(steps)]])
    per_step = {name: counts[name] / steps for name in COUNTED}
    return {name: {"per_step": round(n), "ratio": round(n / per_step["plain"], 4)} for name, n in per_step.items()}


def _job(world: int, args: argparse.Namespace, *, fr_off: bool = False) -> dict:
    tmp = tempfile.mkdtemp(prefix="obs-bench-dist-")
    result = os.path.join(tmp, "result.json")
    saved = os.environ.get("TORCH_FR_BUFFER_SIZE")
    if fr_off:
        os.environ["TORCH_FR_BUFFER_SIZE"] = "0"
    try:
        mp.spawn(_rank, args=(world, os.path.join(tmp, "store"), args.rounds, args.steps, result), nprocs=world,
                 join=True)
    finally:
        if saved is None:
            os.environ.pop("TORCH_FR_BUFFER_SIZE", None)
        else:
            os.environ["TORCH_FR_BUFFER_SIZE"] = saved
    try:
        with open(result) as fh:
            return json.load(fh)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--jobs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40, help="timed steps per variant per round")
    parser.add_argument("--out", default="bench-dist.json")
    parser.add_argument("--instructions", action="store_true",
                        help="count instructions per step under callgrind instead (one rank; needs valgrind)")
    parser.add_argument("--count-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.count_child:
        _count_child(args.steps)
    if args.instructions:
        counted = _instructions(min(args.steps, 20))
        print("bench_dist --instructions (gloo, DDP MLP, 1 rank; callgrind, every thread)")
        for name, row in counted.items():
            print(f"  {name:<12} {row['per_step']:>12,} instructions per step  {row['ratio']:.4f}")
        with open(args.out, "w") as fh:
            json.dump({"benchmark": "bench_dist --instructions", "torch": torch.__version__,
                       "steps": min(args.steps, 20), "instructions": counted, "targets": {"rdr step": "<= 1.02"}},
                      fh, indent=2)
        print(f"wrote {args.out}")
        return
    results, per_job, events, boundary, paired = {}, {}, [], {}, {}
    for world in (1, WORLD):
        jobs, without_fr = [], []
        for job in range(args.jobs):
            jobs.append(_job(world, args))
            print(f"{world} rank(s), job {job + 1}/{args.jobs}: "
                  + "  ".join(f"{k} {v:.3f} ms" for k, v in jobs[-1]["medians"].items()))
            if world == 1:  # beside each job, one whose process group has no Flight Recorder
                without_fr.append(_job(world, args, fr_off=True)["medians"]["plain"])
                print(f"  plain, TORCH_FR_BUFFER_SIZE=0: {without_fr[-1]:.3f} ms")
        name = f"ddp mlp, {world} rank{'s' if world > 1 else ''}"
        results[name] = {v: statistics.median(j["medians"][v] for j in jobs) for v in jobs[0]["medians"]}
        if without_fr:
            results[name][FR_OFF] = statistics.median(without_fr)
        per_job[name] = [j["medians"] for j in jobs]
        rounds = {v: [x for j in jobs for x in j["per_round"][v]] for v in jobs[0]["per_round"]}  # every job's rounds
        paired[name] = paired_ratios(rounds, "plain")
        events = jobs[0]["bucket_records_per_step"]
        boundary[name] = statistics.median(j["step_boundary_us"] for j in jobs)
    report("bench_dist (gloo, DDP MLP)", results, "plain", args.out, {
        "jobs": args.jobs, "rounds": args.rounds, "steps_per_round": args.steps,
        "flight_recorder_records_per_step": events, "step_boundary_us": boundary, "per_job": per_job,
        "targets": {"rdr step": "<= 1.02 (paired)"}}, paired=paired)

if __name__ == "__main__":
    main()
