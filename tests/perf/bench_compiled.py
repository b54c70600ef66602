"""Cost of the statistic data dump and the NaN/Inf check on a torch.compile'd (Inductor) training step.

Run: python tests/perf/bench_compiled.py [--rounds 10] [--processes 3] [--out bench-compiled.json]
Targets (issue 28), on the CNN of _harness.py compiled with Inductor:
- statistic data dump of every node, every step: <= 1.3 x the compiled step without obs;
- NaN check (module granularity: the compiled graphs count their own NaN/Inf): <= 1.05 x.
A graph compiled while the dump or the check is on carries its reductions (obs.runtime.torch._graph_taps), so
each variant trains its own copy of the model, compiled under that variant (the same weights): "plain" a copy
compiled without obs.  Each process is pinned to one core and rotates the variants within each round (a block
of steps each); "ratio" is the median over processes of each process's median step times' ratio, "paired" the
median over processes of the median over rounds of (variant / plain in the same round).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

STEPS_PER_ROUND = 12


def make_variants(tmp: str) -> dict[str, object]:
    """Each variant's setup (returns its teardown); files go under ``tmp``."""
    from _harness import env_config_variant

    def plain():
        return lambda: None

    def with_config(name: str, body: dict) -> object:
        return env_config_variant(tmp, name, body)

    statistic = {"dump": {"common_dump_settings": {
        "dump_mode": 0, "path": os.path.join(tmp, "dump"), "net_name": "Net", "iteration": "all",
        "saved_data": "statistic", "input_output": 0, "kernels": [], "support_device": [0]}}}
    return {"plain": plain, "statistic dump (every node)": with_config("stat", statistic),
            "nan_check module": with_config("nan", {"nan_check": {"enable": True, "path": tmp}})}


def child(rounds: int, root: str) -> dict[str, dict[str, float]]:
    import torch

    from _harness import paired_ratios

    torch.manual_seed(0)
    base = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(64 * 4 * 4, 10))
    x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
    variants = make_variants(tempfile.mkdtemp(prefix="process-", dir=root))
    steps = {}
    for name, setup in variants.items():  # each copy compiled under its variant
        model = copy.deepcopy(base)
        compiled = torch.compile(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def step(compiled=compiled, opt=opt) -> None:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(compiled(x), y).backward()
            opt.step()

        teardown = setup()
        try:
            for _ in range(3):
                step()
        finally:
            teardown()
        steps[name] = step
    names = list(variants)
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            teardown = variants[name]()
            try:
                steps[name]()  # untimed: the first step after a switch
                t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
                for _ in range(STEPS_PER_ROUND):
                    steps[name]()
                wall[name].append((time.perf_counter_ns() - t0) / 1e6 / STEPS_PER_ROUND)
                cpu[name].append((time.thread_time_ns() - c0) / 1e6 / STEPS_PER_ROUND)
            finally:
                teardown()
    return {"cnn compiled": {n: statistics.median(v) for n, v in wall.items()},
            "cnn compiled (CPU time)": {n: statistics.median(v) for n, v in cpu.items()},
            "cnn compiled paired": paired_ratios(wall, "plain"),
            "cnn compiled (CPU time) paired": paired_ratios(cpu, "plain")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--out", default="bench-compiled.json")
    parser.add_argument("--child", metavar="ROOT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        import torch

        from _harness import pin_to_one_core

        pin_to_one_core()
        torch.set_num_threads(1)
        print(json.dumps(child(args.rounds, args.child)))
        return
    from _harness import STEADY_MALLOC, in_processes, report

    root = tempfile.mkdtemp(prefix="obs-bench-compiled-")
    try:
        runs = in_processes(os.path.abspath(__file__), [root, "--rounds", str(args.rounds)], args.processes,
                            env={**STEADY_MALLOC, "TORCHINDUCTOR_COMPILE_THREADS": "1",
                                 "TORCHINDUCTOR_CACHE_DIR": os.path.join(root, "inductor-cache")})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    timed = [w for w in runs[0] if not w.endswith("paired")]
    medians = {w: {v: statistics.median(run[w][v] for run in runs) for v in runs[0][w]} for w in timed}
    ratios = {w: {v: round(statistics.median(run[w][v] / run[w]["plain"] for run in runs), 4)
                  for v in runs[0][w] if v != "plain"} for w in timed}
    paired = {w: {v: statistics.median(run[f"{w} paired"][v] for run in runs) for v in runs[0][w]} for w in timed}
    report("bench_compiled", medians, "plain", args.out, {
        "processes": args.processes, "rounds": args.rounds, "ratios": ratios, "per_process": runs,
        "targets": {"cnn compiled": {"statistic dump (every node)": "<= 1.3", "nan_check module": "<= 1.05"}}},
        paired=paired)


if __name__ == "__main__":
    main()
