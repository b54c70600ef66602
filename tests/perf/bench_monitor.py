"""Cost of the training-health monitor on training steps: its default set, and activations of every module.

Run: python tests/perf/bench_monitor.py [--rounds 12] [--out bench-monitor.json]
(it re-runs itself with glibc malloc kept from handing memory back, ``_harness.STEADY_MALLOC``, as bench_rdr's
processes run)
One process pinned to one core (torch on one thread), every variant timed in rounds alternating with plain
PyTorch, a few untimed steps after each switch (a run's start, its folder and worker thread, is paid once in a
real job).  The table gives each variant's median step time, its ratio to plain and the paired ratio (the median
over rounds of variant / plain in the same round).
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


def main() -> None:
    if any(os.environ.get(k) != v for k, v in STEADY_MALLOC.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **STEADY_MALLOC})
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--out", default="bench-monitor.json")
    args = parser.parse_args()
    pin_to_one_core()
    torch.set_num_threads(1)
    variants = {
        "plain": plain,
        "env config, monitor off": env_config_variant(TMP, "off", {"monitor": {"enable": False}}),
        "monitor default": env_config_variant(TMP, "default", {"monitor": {"enable": True, "path": TMP}}),
        "monitor + xy every module": env_config_variant(TMP, "xy", {"monitor": {
            "enable": True, "path": TMP, "xy_distribution": True, "all_xy": True}}),
    }
    results, paired = {}, {}
    for workload in (mlp(), cnn()):
        per_round = measure_rounds(workload, variants, args.rounds, settle=3)
        results[workload.name] = {name: sorted(v)[len(v) // 2] for name, v in per_round.items()}
        paired[workload.name] = paired_ratios(per_round, "plain")
    report("training-health monitor", results, "plain", args.out, paired=paired)


if __name__ == "__main__":
    main()
