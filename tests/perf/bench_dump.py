"""Cost of exception_dump (armed, nothing failing), the NaN/Inf check and the statistic data dump on training steps.

Run: python tests/perf/bench_dump.py [--rounds 12] [--processes 3] [--out bench-dump.json]
     python tests/perf/bench_dump.py --instructions  (instructions per step under callgrind: _instructions.py)
Targets (issue 14), on the foundation's CNN step:
- statistic dump of every op, every step: <= 1.10 over the same run with op interception alone (an
  OP_OUTPUT subscriber that does nothing: the same dispatch mode);
- NaN check at module granularity: <= 1.05 over plain PyTorch;
- exception_dump armed at module granularity, nothing failing: <= 1.02 over plain PyTorch.
Each process is pinned to one core (one torch thread) and rotates the variants within each round; a round
times a block of steps per variant, in wall time and in the training thread's CPU time (``time.thread_time_ns``:
what the step itself costs, without the time other tenants of a shared machine take the core away).  "ratio"
is the median over processes of each process's median step times' ratio; "paired" the median over processes of
the median over rounds of (variant / its baseline in the same round), which cancels the machine's drift between
rounds.  The MLP is shown too (many small ops: the worst case).  The NaN check also runs on its Python path
(``OBS_NATIVE_DUMP=0``), the measure of what its C++ hooks (``obs/features/dump/nan/_fast_nan.cpp``) save.
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
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def make_variants(tmp: str) -> dict[str, object]:
    """Each variant's setup (returns its teardown); files go under ``tmp``."""
    import obs

    from _harness import env_config_variant

    def plain():
        return lambda: None

    def with_config(name: str, body: dict) -> object:
        return env_config_variant(tmp, name, body)

    def python_path(setup):
        """``setup`` with obs.dump's C++ extensions switched off while it installs (``OBS_NATIVE_DUMP=0``)."""
        def run():
            before = os.environ.get("OBS_NATIVE_DUMP")
            os.environ["OBS_NATIVE_DUMP"] = "0"
            try:
                return setup()
            finally:
                if before is None:
                    del os.environ["OBS_NATIVE_DUMP"]
                else:
                    os.environ["OBS_NATIVE_DUMP"] = before
        return run

    def exception_dump():
        obs.set_context(ascend_config={"exception_dump": "2"})
        return obs.reset_context

    def interception():
        sub = obs.subscribe(obs.Event.OP_OUTPUT, lambda name, args, kwargs, output: None)
        return sub.remove

    statistic = {"dump": {"common_dump_settings": {
        "dump_mode": 0, "path": os.path.join(tmp, "dump"), "net_name": "Net", "iteration": "all",
        "saved_data": "statistic", "input_output": 0, "kernels": [], "support_device": [0]}}}
    return {"plain": plain, "exception_dump armed": exception_dump,
            "nan_check module": with_config("nan", {"nan_check": {"enable": True, "path": tmp}}),
            "nan_check module, Python path": python_path(with_config("nan", {"nan_check": {"enable": True,
                                                                                         "path": tmp}})),
            "op interception alone": interception,
            "statistic dump (every op)": with_config("stat", statistic)}


def child(rounds: int, root: str) -> dict[str, dict[str, float]]:
    """One process's timed rounds; its files go to a new folder under ``root``, which the parent removes."""
    import torch

    from _harness import cnn, mlp, paired_ratios

    variants = make_variants(tempfile.mkdtemp(prefix="process-", dir=root))
    torch.manual_seed(0)
    results: dict[str, dict[str, float]] = {}
    for workload in (cnn(), mlp()):
        names = list(variants)
        wall: dict[str, list[float]] = {name: [] for name in names}
        cpu: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(3):
            workload.step()  # warm-up: allocator, thread pools
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                teardown = variants[name]()
                try:
                    workload.step()  # untimed: the first step after a switch
                    t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
                    for _ in range(workload.steps_per_round):
                        workload.step()
                    wall[name].append((time.perf_counter_ns() - t0) / 1e6 / workload.steps_per_round)
                    cpu[name].append((time.thread_time_ns() - c0) / 1e6 / workload.steps_per_round)
                finally:
                    teardown()
        w = workload.name
        results[w] = {name: statistics.median(v) for name, v in wall.items()}
        results[f"{w} (CPU time)"] = {name: statistics.median(v) for name, v in cpu.items()}
        for label, per_round in (("", wall), (" (CPU time)", cpu)):
            plain, dump = paired_ratios(per_round, "plain"), paired_ratios(per_round, "op interception alone")
            results[f"{w}{label} paired"] = {**plain, "statistic dump (every op) / op interception":
                                             dump["statistic dump (every op)"]}
    return results


COUNTED_STEPS = {"cnn": 3, "mlp": 20}  #: steps counted per variant under callgrind (after 2 / 12 untimed ones)


def count_child(workload_name: str) -> None:
    """Under callgrind (``--instructions``): each variant's counted steps on one workload, after untimed ones."""
    import torch

    from _harness import cnn, mlp
    from _instructions import Counter, count_steps

    counter = Counter()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    tmp = tempfile.mkdtemp(prefix="obs-bench-dump-count-")
    workload = {"cnn": cnn, "mlp": mlp}[workload_name]()
    for _ in range(3):
        workload.step()
    count_steps(counter, workload.step, make_variants(tmp), 2 if workload_name == "cnn" else 12,
                COUNTED_STEPS[workload_name])
    shutil.rmtree(tmp, ignore_errors=True)
    os._exit(0)  # the counts are written; skip the interpreter's slow exit under valgrind


def instructions(out: str) -> None:
    """Instructions per step of each variant on both workloads (every thread), against each target's baseline."""
    from _instructions import available, run_counted

    why = available()
    if why is not None:
        raise SystemExit(f"--instructions: {why}")
    names = ("cnn", "mlp")
    counts = run_counted([[os.path.abspath(__file__), "--count-child", w] for w in names])
    table = {w: {v: n / COUNTED_STEPS[w] for v, n in c.items()} for w, c in zip(names, counts)}
    ratios = {w: {"statistic dump / op interception": t["statistic dump (every op)"] / t["op interception alone"],
                  "nan_check / plain": t["nan_check module"] / t["plain"],
                  "exception_dump / plain": t["exception_dump armed"] / t["plain"],
                  "op interception / plain": t["op interception alone"] / t["plain"]} for w, t in table.items()}
    for w in names:
        print(f"{w}: " + ", ".join(f"{v} {n:,.0f}" for v, n in table[w].items()) + " instructions per step")
        print(f"{w}: " + ", ".join(f"{k} = {r:.4f}" for k, r in ratios[w].items()))
    with open(out, "w") as fh:
        json.dump({"benchmark": "bench_dump --instructions", "steps": COUNTED_STEPS,
                   "instructions_per_step": {w: {v: round(n) for v, n in t.items()} for w, t in table.items()},
                   "ratios": {w: {k: round(r, 4) for k, r in rs.items()} for w, rs in ratios.items()}}, fh, indent=2)
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--out", default="bench-dump.json")
    parser.add_argument("--instructions", action="store_true",
                        help="count instructions per step under callgrind instead (needs valgrind)")
    parser.add_argument("--child", metavar="ROOT", help=argparse.SUPPRESS)
    parser.add_argument("--count-child", choices=("cnn", "mlp"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.count_child:
        count_child(args.count_child)
    if args.instructions:
        instructions(args.out)
        return
    if args.child:
        import torch

        from _harness import pin_to_one_core

        pin_to_one_core()

        torch.set_num_threads(1)  # one core: a second intra-op thread would only wait for it (slow reductions)
        print(json.dumps(child(args.rounds, args.child)))
        return
    runs = []
    # Every process's files are kept until the last process ends: ext4 without a journal skips the inodes freed
    # within the last minute or more when it allocates one, so a removal just before a process would slow that
    # process's file creations (measured: mkdir + create + write of a step's files 30 us on a quiet disk, 300 us
    # after 600 removals).
    root = tempfile.mkdtemp(prefix="obs-bench-dump-")
    try:
        for i in range(args.processes):
            out = subprocess.run([sys.executable, __file__, "--child", root, "--rounds", str(args.rounds)],
                                 capture_output=True, text=True, check=True)
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"process {i + 1}/{args.processes} done", file=sys.stderr)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    timed = [w for w in runs[0] if not w.endswith("paired")]
    medians = {w: {v: statistics.median(run[w][v] for run in runs) for v in runs[0][w]} for w in timed}
    from _harness import report

    def ratios(w: str) -> dict[str, float]:
        def ratio(a: str, b: str) -> float:
            return round(statistics.median(run[w][a] / run[w][b] for run in runs), 4)

        def paired(key: str) -> float:
            return round(statistics.median(run[f"{w} paired"][key] for run in runs), 4)

        return {"statistic dump / op interception": ratio("statistic dump (every op)", "op interception alone"),
                "statistic dump / op interception, paired": paired("statistic dump (every op) / op interception"),
                "nan_check / plain": ratio("nan_check module", "plain"),
                "nan_check / plain, paired": paired("nan_check module"),
                "nan_check Python path / plain, paired": paired("nan_check module, Python path"),
                "exception_dump / plain": ratio("exception_dump armed", "plain"),
                "exception_dump / plain, paired": paired("exception_dump armed")}

    all_ratios = {w: ratios(w) for w in timed}
    for w, r in all_ratios.items():
        print(f"{w}: " + ", ".join(f"{k} = {v:.3f}" for k, v in r.items()))
    report("bench_dump", medians, "plain", args.out, {
        "processes": args.processes, "rounds": args.rounds, "ratios": all_ratios, "per_process": runs,
        "targets": {"cnn": {"statistic dump / op interception": "<= 1.10", "nan_check / plain": "<= 1.05",
                            "exception_dump / plain": "<= 1.02"}}})


if __name__ == "__main__":
    main()
