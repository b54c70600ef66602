"""Cost of ``obs.Print`` to a file inside the training loop: the loss printed every 10 steps, and every step.

Run: python tests/perf/bench_print_steps.py [--rounds 12] [--processes 3] [--out bench-print-steps.json]
     python tests/perf/bench_print_steps.py --instructions  (instructions per step: _instructions.py)
Target (issue "A/B benchmark"): Print every 10 steps <= 1.03 on the MLP, <= 1.01 on the CNN.  Each process is
pinned to one core and times every variant in rounds alternating with plain PyTorch (the same loop without the
Print), after a few untimed steps per switch; the table gives the median over processes of each variant's ratio
to plain, and of its paired ratio (the median over rounds of variant / plain in the same round).
``tests/perf/ab.py --bench print`` runs the same child on two trees.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch

import obs

from _harness import (
    STEADY_MALLOC,
    Workload,
    cnn,
    in_processes,
    measure_rounds,
    median_ratios,
    mlp,
    paired_ratios,
    pin_to_one_core,
)

TMP = tempfile.mkdtemp(prefix="obs-bench-print-steps-")
atexit.register(shutil.rmtree, TMP, ignore_errors=True)
SETTLE = {"mlp": 12, "cnn": 2}
_every = [0]  # the variant on now prints the loss every this many steps; 0: never (plain)


def printing(workload: Workload) -> Workload:
    """The workload's loop with ``obs.Print("loss:", loss)`` every ``_every[0]`` steps."""
    count = [0]
    base = workload.step

    def step() -> None:
        loss = base()
        every = _every[0]
        if every:
            count[0] += 1
            if count[0] % every == 0:
                obs.Print("loss:", loss)
    return Workload(workload.name, step, workload.steps_per_round)


def plain():
    return lambda: None


def print_every(steps: int):
    rounds = [0]

    def setup():
        rounds[0] += 1  # a file per round: obs never appends to an existing print file
        obs.set_context(print_file_path=os.path.join(TMP, f"print-{steps}-{rounds[0]}.pb"))
        _every[0] = steps

        def teardown():
            _every[0] = 0
            obs.reset_context()
        return teardown
    return setup


VARIANTS = {"plain": plain, "Print every 10 steps": print_every(10), "Print every step": print_every(1)}
COUNTED_STEPS = {"mlp": 20, "cnn": 10}  #: under callgrind: multiples of 10, so that "every 10 steps" prints as often


def count_child(workload_name: str) -> None:
    """Under callgrind (``--instructions``): each variant's counted steps on one workload, after untimed ones."""
    from _instructions import count_child as count

    torch.manual_seed(0)
    workload = printing({"mlp": mlp, "cnn": cnn}[workload_name]())
    count(workload.step, VARIANTS, SETTLE[workload_name], COUNTED_STEPS[workload_name], TMP)


def child(rounds: int) -> dict[str, object]:
    pin_to_one_core()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    out: dict[str, object] = {}
    for workload in (printing(mlp()), printing(cnn())):
        per_round = measure_rounds(workload, VARIANTS, rounds, settle=SETTLE[workload.name])
        out[workload.name] = {name: statistics.median(values) for name, values in per_round.items()}
        out[f"{workload.name} paired"] = paired_ratios(per_round, "plain")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--out", default="bench-print-steps.json")
    parser.add_argument("--instructions", action="store_true",
                        help="count instructions per step under callgrind instead (needs valgrind)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--count-child", choices=("mlp", "cnn"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.count_child:
        count_child(args.count_child)
    if args.instructions:
        from _instructions import per_step, write_table

        write_table("bench_print_steps", per_step(os.path.abspath(__file__), [], COUNTED_STEPS), COUNTED_STEPS,
                    args.out)
        return
    if args.child:
        print(json.dumps(child(args.rounds)))
        return
    runs = in_processes(os.path.abspath(__file__), ["--rounds", str(args.rounds)], args.processes, STEADY_MALLOC)
    workloads = ("mlp", "cnn")
    ratios = median_ratios([{w: run[w] for w in workloads} for run in runs], "plain")
    paired = {w: {v: statistics.median(run[f"{w} paired"][v] for run in runs) for v in VARIANTS} for w in workloads}
    print(f"{'workload':<8} {'variant':<24} {'ms/step':>9} {'ratio':>8} {'paired':>8}   (median of {args.processes} "
          "processes)")
    for w in workloads:
        for v in VARIANTS:
            ms = statistics.median(run[w][v] for run in runs)
            print(f"{w:<8} {v:<24} {ms:>9.3f} {ratios[w][v]:>8.3f} {paired[w][v]:>8.3f}")
    data = {"benchmark": "print steps", "torch": torch.__version__, "rounds": args.rounds,
            "processes": args.processes, "ratios": ratios, "paired": paired, "per_process": runs}
    with open(args.out, "w") as fh:
        json.dump(data, fh, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
