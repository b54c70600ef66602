"""Cost of the training-health monitor on training steps: its default set, and activations of every module.

Run: python tests/perf/bench_monitor.py [--rounds 12] [--out bench-monitor.json]
     python tests/perf/bench_monitor.py --instructions [--variants "a|b"]  (instructions per step: _instructions.py)
(it re-runs itself with glibc malloc kept from handing memory back, ``_harness.STEADY_MALLOC``, as bench_rdr's
processes run)
One process pinned to one core (torch on one thread), every variant timed in rounds alternating with plain
PyTorch, a few untimed steps after each switch (a run's start, its folder and worker thread, is paid once in a
real job).  The table gives each variant's median step time, its ratio to plain and the paired ratio (the median
over rounds of variant / plain in the same round).  A second table gives the paired ratio of round *means*, the
worker's queue flushed inside each round: the worker drains every 50 ms, so its work lands on a few steps of a
round, which a median leaves out; on one pinned core it is the training's time all the same.
Targets (issue 41): the default set (per-parameter gradient and update norms, update ratios, global gradient norm,
loss; CSV files and the rules on the worker thread) <= 1.03 on the MLP and the CNN; activations of every module
(``xy_distribution`` with ``all_xy``) <= 1.15.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch

from _harness import (
    STEADY_MALLOC,
    cnn,
    env_config_variant,
    measure_rounds,
    mlp,
    paired_ratios,
    pin_to_one_core,
    report,
)

TMP = tempfile.mkdtemp(prefix="obs-bench-monitor-")
atexit.register(shutil.rmtree, TMP, ignore_errors=True)


def plain():
    return lambda: None


VARIANTS = {
    "plain": plain,
    "env config, monitor off": env_config_variant(TMP, "off", {"monitor": {"enable": False}}),
    "monitor default": env_config_variant(TMP, "default", {"monitor": {"enable": True, "path": TMP}}),
    "monitor + xy every module": env_config_variant(TMP, "xy", {"monitor": {
        "enable": True, "path": TMP, "xy_distribution": True, "all_xy": True}}),
}
COUNTED_STEPS = {"mlp": 40, "cnn": 4}  #: a CNN step: ~10x an MLP step's instructions
SETTLE = 3


def count_child(workload_name: str, only: list[str]) -> None:
    """Under callgrind (``--instructions``): each variant's counted steps on one workload, after untimed ones.  The
    monitor's worker thread is flushed after the settling steps (before counting) and after the last counted step
    (inside the count): its per-step work counts."""
    from _instructions import count_child as count

    torch.manual_seed(0)
    workload = {"mlp": mlp, "cnn": cnn}[workload_name]()
    calls = [0]
    flush_at = (SETTLE, SETTLE + COUNTED_STEPS[workload_name])

    def step() -> None:
        workload.step()
        calls[0] += 1
        if calls[0] in flush_at:
            flush_worker()

    def fresh(setup):
        def install():
            calls[0] = 0
            return setup()
        return install

    count(step, {name: fresh(VARIANTS[name]) for name in only}, SETTLE, COUNTED_STEPS[workload_name], TMP)


def instructions(only: list[str], out: str) -> None:
    """Instructions per step of each variant on both workloads (every thread), and the ratio to plain."""
    from _instructions import per_step, write_table

    table = per_step(os.path.abspath(__file__), ["--variants", "|".join(only)], COUNTED_STEPS)
    write_table("bench_monitor", table, COUNTED_STEPS, out)


def main() -> None:
    # not under callgrind (--count-child): it does not follow an exec
    if "--count-child" not in sys.argv and any(os.environ.get(k) != v for k, v in STEADY_MALLOC.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **STEADY_MALLOC})
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--out", default="bench-monitor.json")
    parser.add_argument("--variants", default="", metavar="NAME|...",
                        help=f"only these variants (plain always): some of {'|'.join(VARIANTS)}")
    parser.add_argument("--instructions", action="store_true",
                        help="count instructions per step under callgrind instead (needs valgrind)")
    parser.add_argument("--count-child", choices=("mlp", "cnn"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    only = ["plain"] + [v for v in args.variants.split("|") if v and v != "plain"] if args.variants else list(VARIANTS)
    if unknown := [v for v in only if v not in VARIANTS]:
        parser.error(f"--variants: unknown {unknown}; expected some of {list(VARIANTS)}")
    if args.count_child:
        count_child(args.count_child, only)
    if args.instructions:
        instructions(only, args.out)
        return
    pin_to_one_core()
    torch.set_num_threads(1)
    variants = {name: VARIANTS[name] for name in only}
    results, paired, with_worker = {}, {}, {}
    for workload in (mlp(), cnn()):
        means: dict[str, list[float]] = {}
        per_round = measure_rounds(workload, variants, args.rounds, settle=SETTLE, finish=flush_worker, means=means)
        results[workload.name] = {name: sorted(v)[len(v) // 2] for name, v in per_round.items()}
        paired[workload.name] = paired_ratios(per_round, "plain")
        with_worker[workload.name] = paired_ratios(means, "plain")
    report("training-health monitor", results, "plain", args.out, paired=paired,
           extra={"paired_mean_with_worker": with_worker})
    print("paired ratio of round means, the worker's queue flushed inside each round (its time counted):")
    for workload, ratios in with_worker.items():
        for name, ratio in ratios.items():
            print(f"{workload:<8} {name:<28} {ratio:>8.3f}")


def flush_worker() -> None:
    """Wait for the monitor's worker thread to judge and write every step handed to it (none: nothing)."""
    from obs.features.monitor.feature import feature

    if feature.monitor is not None:
        feature.monitor.flush()


if __name__ == "__main__":
    main()
