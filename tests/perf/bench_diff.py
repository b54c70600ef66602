"""Speed and memory of ``obs dump diff`` on dumps made by obs.

Run: python tests/perf/bench_diff.py [--rows 100000] [--tensors 1] [--repeat 3] [--out bench-diff.json]
Also the alignment alone where it costs most: an eager step against a compiled one whose ops carry one scope.
Every measure runs in a process of its own (a child's peak RSS counts the parent's at the fork).
Targets (issue 30):
- two statistic dumps of 100,000 rows each: diffed in <= 5 s (``compare_dumps`` in a process, and the whole
  ``obs dump diff A B --json`` command, interpreter start included);
- two tensor dumps of 1 GiB each: read one pair of tensors at a time, so the diff's peak memory is the interpreter's
  plus about two of the largest tensor, whatever the dump's size.
The statistic dumps come from a deep MLP (Linear, LayerNorm, GELU blocks) trained with the dump on until each has
``--rows`` rows; B differs from A in one block's GELU (tanh) and one extra op (``x * 1.0``), so that the diff aligns
around an inserted op and finds a producer.  The tensor dumps come from one step of a wide Linear layer (4400 × 4400:
74 MiB a weight; just over 1 GiB a dump), B at another learning rate.  Each diff runs in a process of its own: its
wall time, CPU time and peak RSS (``ru_maxrss``) are measured, and a process that imports the same modules and diffs
nothing gives the baseline RSS.  Everything is written under a temporary folder, removed at the end.  On a shared
machine, read the CPU times: the wall times include the time other tenants take the cores away.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MAKE = r'''
import glob, json, sys
import torch, obs
from obs.runtime.steps import tracker

kind, root, variant, target = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])

class Block(torch.nn.Module):
    def __init__(self, width, tanh, extra):
        super().__init__()
        self.fc = torch.nn.Linear(width, width)
        self.norm = torch.nn.LayerNorm(width)
        self.act = torch.nn.GELU(approximate="tanh" if tanh else "none")
        self.extra = extra

    def forward(self, x):
        x = self.act(self.norm(self.fc(x)))
        return x * 1.0 if self.extra else x

b = variant == "b"
torch.manual_seed(0)
if kind == "statistic":
    width, depth, lr = 8, 64, 1e-3
    model = torch.nn.Sequential(*[Block(width, b and i == 40, b and i == 20) for i in range(depth)])
else:  # tensor: a wide layer, 74 MiB a weight, just over 1 GiB a step
    width, depth, lr = 4400, 1, 1.01e-3 if b else 1e-3
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])
cfg = {"dump": {"common_dump_settings": {
    "dump_mode": 0, "path": root, "net_name": "Net", "iteration": "all", "saved_data": kind, "input_output": 0,
    "kernels": [], "support_device": [0], "statistic_category": ["max", "min", "avg", "nan count", "l2norm"]}}}
with open(root + ".json", "w") as f:
    json.dump(cfg, f)
opt = torch.optim.SGD(model.parameters(), lr=lr)
x = torch.randn(4 if kind == "statistic" else 64, width)
obs.set_context(env_config_path=root + ".json")
steps = 0
rows = 0
while True:
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
    steps += 1
    if kind == "tensor":
        break
    rows = sum(sum(1 for _ in open(p)) - 1 for p in glob.glob(root + "/rank_0/Net/0/*/statistic.csv"))
    if rows >= target:
        break
obs.reset_context()
tracker.reset()
print(json.dumps({"steps": steps, "rows": rows}))
'''

DIFF = r'''
import json, resource, sys, time
mode, a, b = sys.argv[1], sys.argv[2], sys.argv[3]
from obs.features.dump import DumpReader
from obs.features.dump.diff import compare_dumps
from obs.features.dump.diff.render import report_dict
import obs.cli
wall, cpu = time.perf_counter(), time.process_time()
out = {}
if mode == "diff":
    report = compare_dumps(DumpReader(a), DumpReader(b))
    doc = report_dict(report, a=a, b=b, top=10)
    p = report.producer
    out = {"ops": len(report.ops), "compared": report.compared, "mode": report.mode,
           "inserted": len(report.inserted), "removed": len(report.removed), "divergent": len(report.divergent),
           "producer": p and {"name": p.name, "iteration": p.iteration, "parameter": p.parameter},
           "json_bytes": len(json.dumps(doc))}
out.update(wall_s=time.perf_counter() - wall, cpu_s=time.process_time() - cpu,
           peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
print(json.dumps(out))
'''


ALIGN = r'''
# The alignment alone, on the worst case it meets: an eager step against a compiled one whose ops all carry the
# compiled module's scope (no op pairs by scope), the compiled side without the eager side's views, sums and detaches
# and with detaches and copies of its own; keys as obs.features.dump.diff makes them, each op a value of its own.
import json, resource, sys, time
from obs.features.dump.diff.align import align

layers = int(sys.argv[1])
forward = ["LayerNorm", "Addmm", "View", "Split", "Bmm", "Softmax", "Bmm", "View", "Addmm", "Add", "LayerNorm",
           "Addmm", "Gelu", "Addmm", "Add"]
backward = [t + "Backward" for t in forward] + ["Mm", "T", "Mm", "T", "Sum", "View", "Detach"] * 3

def step(compiled):
    ops, seen = [], {}
    for phase, types, order in (("forward", forward, range(layers)), ("backward", backward, reversed(range(layers)))):
        for layer in order:
            scope = "net" if compiled else f"net_h_{layer}"
            extra = ["Detach" if phase == "forward" else "Copy"] if compiled else []
            for t in extra + [t for t in types if not (compiled and t in ("View", "Sum", "Detach"))]:
                seen[(phase, t)] = seen.get((phase, t), 0) + 1
                ops.append(((phase, t), scope, ("(8,64)",), hash((phase, t, seen[(phase, t)]))))
    return ops

eager, compiled = step(False), step(True)
cpu = time.process_time()
pairs = align(eager, compiled, lambda op: op)
print(json.dumps({"ops": [len(eager), len(compiled)], "cpu_s": time.process_time() - cpu,
                  "unpaired": sum(1 for p in pairs if None in p),
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
'''


def _run(script: str, *args: str, timeout: float = 1800) -> dict:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"bench_diff: a child failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _size(folder: str) -> tuple[int, int]:
    """Bytes of the ``.npy`` files under ``folder``, and of the largest."""
    sizes = [os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(folder) for n in names
             if n.endswith(".npy")]
    return sum(sizes), max(sizes, default=0)


def _command(a: str, b: str) -> dict:
    """The whole command, in a process: interpreter start, imports, reading, diffing, the JSON document."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "obs", "dump", "diff", a, b, "--json"], capture_output=True,
                          text=True, timeout=600, env=env, cwd=ROOT)
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode not in (0, 1):
        raise SystemExit(f"bench_diff: obs dump diff failed:\n{done.stderr[-4000:]}")
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return {"wall_s": wall, "cpu_s": cpu, "exit": done.returncode, "json_bytes": len(done.stdout)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=100_000, help="statistic.csv rows per dump (default 100000)")
    parser.add_argument("--tensors", type=int, default=1, help="0: skip the tensor dumps (1 GiB each)")
    parser.add_argument("--repeat", type=int, default=3, help="diff processes per measurement (median)")
    parser.add_argument("--out", default="bench-diff.json")
    args = parser.parse_args()
    tmp = tempfile.mkdtemp(prefix="obs-bench-diff-")
    result: dict = {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count()}
    try:
        a, b = os.path.join(tmp, "stat_a"), os.path.join(tmp, "stat_b")
        made = {"a": _run(MAKE, "statistic", a, "a", str(args.rows)), "b": _run(MAKE, "statistic", b, "b",
                                                                                str(args.rows))}
        baseline = [_run(DIFF, "baseline", a, b) for _ in range(args.repeat)]
        diffs = [_run(DIFF, "diff", a, b) for _ in range(args.repeat)]
        commands = [_command(a, b) for _ in range(args.repeat)]
        result["statistics"] = {
            "rows": {k: v["rows"] for k, v in made.items()}, "steps": {k: v["steps"] for k, v in made.items()},
            "compare_wall_s": statistics.median(d["wall_s"] for d in diffs),
            "compare_cpu_s": statistics.median(d["cpu_s"] for d in diffs),
            "command_wall_s": statistics.median(c["wall_s"] for c in commands),
            "command_cpu_s": statistics.median(c["cpu_s"] for c in commands),
            "peak_rss_mib": statistics.median(d["peak_rss_bytes"] for d in diffs) / 2**20,
            "baseline_rss_mib": statistics.median(d["peak_rss_bytes"] for d in baseline) / 2**20,
            "target_s": 5.0, **{k: diffs[0][k] for k in ("ops", "compared", "mode", "inserted", "removed",
                                                          "divergent", "producer")}}
        shutil.rmtree(a), shutil.rmtree(b)
        result["alignment_eager_against_compiled"] = [_run(ALIGN, str(layers)) for layers in (100, 300)]
        if args.tensors:
            a, b = os.path.join(tmp, "tensor_a"), os.path.join(tmp, "tensor_b")
            _run(MAKE, "tensor", a, "a", "0")
            _run(MAKE, "tensor", b, "b", "0")
            (size_a, largest_a), (size_b, largest_b) = _size(a), _size(b)
            baseline = [_run(DIFF, "baseline", a, b) for _ in range(args.repeat)]
            diffs = [_run(DIFF, "diff", a, b) for _ in range(args.repeat)]
            base = statistics.median(d["peak_rss_bytes"] for d in baseline)
            peak = statistics.median(d["peak_rss_bytes"] for d in diffs)
            largest = max(largest_a, largest_b)
            result["tensors"] = {
                "dump_mib": {"a": size_a / 2**20, "b": size_b / 2**20}, "largest_tensor_mib": largest / 2**20,
                "compare_wall_s": statistics.median(d["wall_s"] for d in diffs),
                "compare_cpu_s": statistics.median(d["cpu_s"] for d in diffs),
                "peak_rss_mib": peak / 2**20, "baseline_rss_mib": base / 2**20,
                "above_baseline_mib": (peak - base) / 2**20,
                "above_baseline_in_largest_tensors": (peak - base) / largest,
                **{k: diffs[0][k] for k in ("ops", "compared", "mode", "divergent", "producer")}}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    s = result["statistics"]
    print(f"statistic dumps: {s['rows']['a']} and {s['rows']['b']} rows ({s['steps']['a']} steps), {s['ops']} ops "
          f"aligned, {s['inserted']} inserted, {s['divergent']} divergent")
    print(f"  compare_dumps: {s['compare_wall_s']:.2f} s wall, {s['compare_cpu_s']:.2f} s CPU; "
          f"obs dump diff --json: {s['command_wall_s']:.2f} s wall, {s['command_cpu_s']:.2f} s CPU (target <= "
          f"{s['target_s']:.0f} s)")
    print(f"  producer: {s['producer']}")
    for found in result["alignment_eager_against_compiled"]:
        print(f"alignment alone, eager against compiled, {found['ops'][0]} against {found['ops'][1]} ops in a step: "
              f"{found['cpu_s']:.2f} s CPU, peak RSS {found['peak_rss_mib']:.0f} MiB ({found['unpaired']} unpaired)")
    if "tensors" in result:
        t = result["tensors"]
        print(f"tensor dumps: {t['dump_mib']['a']:.0f} and {t['dump_mib']['b']:.0f} MiB, largest tensor "
              f"{t['largest_tensor_mib']:.0f} MiB; {t['compared']} tensors in {t['compare_wall_s']:.2f} s wall")
        print(f"  peak RSS {t['peak_rss_mib']:.0f} MiB, the same imports diffing nothing {t['baseline_rss_mib']:.0f} "
              f"MiB: {t['above_baseline_mib']:.0f} MiB above, {t['above_baseline_in_largest_tensors']:.2f}x the "
              f"largest tensor; producer {t['producer']}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
