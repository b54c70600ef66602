"""Cost of exception_dump (armed, nothing failing), the NaN/Inf check and the statistic data dump on training steps.

Run: python tests/perf/bench_dump.py [--rounds 12] [--processes 3] [--out bench-dump.json]
Targets (issue 14), on the foundation's CNN step:
- statistic dump of every op, every step: <= 1.10 over the same run with op interception alone (an
  OP_OUTPUT subscriber that does nothing: the same dispatch mode);
- NaN check at module granularity: <= 1.05 over plain PyTorch;
- exception_dump armed at module granularity, nothing failing: <= 1.02 over plain PyTorch.
Each process is pinned to one core (one torch thread) and rotates the variants round by round (tests/perf/_harness.py);
the figures are medians over the processes.  The MLP is shown too (many small ops: the worst case).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def child(rounds: int) -> dict[str, dict[str, float]]:
    import torch

    import obs
    from _harness import cnn, measure, mlp

    tmp = tempfile.mkdtemp(prefix="obs-bench-dump-")

    def plain():
        return lambda: None

    def with_config(name: str, body: dict) -> object:
        def setup():
            path = os.path.join(tmp, f"{name}.json")
            with open(path, "w") as fh:
                json.dump(body, fh)
            obs.set_context(env_config_path=path)
            return obs.reset_context
        return setup

    def exception_dump():
        obs.set_context(ascend_config={"exception_dump": "2"})
        return obs.reset_context

    def interception():
        sub = obs.subscribe(obs.Event.OP_OUTPUT, lambda name, args, kwargs, output: None)
        return sub.remove

    statistic = {"dump": {"common_dump_settings": {
        "dump_mode": 0, "path": os.path.join(tmp, "dump"), "net_name": "Net", "iteration": "all",
        "saved_data": "statistic", "input_output": 0, "kernels": [], "support_device": [0]}}}
    variants = {"plain": plain, "exception_dump armed": exception_dump,
                "nan_check module": with_config("nan", {"nan_check": {"enable": True, "path": tmp}}),
                "op interception alone": interception,
                "statistic dump (every op)": with_config("stat", statistic)}
    torch.manual_seed(0)
    try:
        return {w.name: measure(w, variants, rounds) for w in (cnn(), mlp())}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--out", default="bench-dump.json")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
        import torch

        torch.set_num_threads(1)  # one core: a second intra-op thread would only wait for it (slow reductions)
        print(json.dumps(child(args.rounds)))
        return
    runs = []
    for i in range(args.processes):
        out = subprocess.run([sys.executable, __file__, "--child", "--rounds", str(args.rounds)], capture_output=True,
                             text=True, check=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"process {i + 1}/{args.processes} done", file=sys.stderr)
    medians = {w: {v: statistics.median(run[w][v] for run in runs) for v in runs[0][w]} for w in runs[0]}
    from _harness import report

    ratios = {w: {"statistic dump / op interception": round(m["statistic dump (every op)"]
                                                            / m["op interception alone"], 4),
                  "nan_check / plain": round(m["nan_check module"] / m["plain"], 4),
                  "exception_dump / plain": round(m["exception_dump armed"] / m["plain"], 4)}
              for w, m in medians.items()}
    for w, r in ratios.items():
        print(f"{w}: " + ", ".join(f"{k} = {v:.3f}" for k, v in r.items()))
    report("bench_dump", medians, "plain", args.out, {
        "processes": args.processes, "rounds": args.rounds, "ratios": ratios, "per_process": runs,
        "targets": {"cnn": {"statistic dump / op interception": "<= 1.10", "nan_check / plain": "<= 1.05",
                            "exception_dump / plain": "<= 1.02"}}})


if __name__ == "__main__":
    main()
