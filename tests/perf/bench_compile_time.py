"""Inductor's compile time and step time on a ResNet-18 with the graph taps (statistic dump, NaN check) and without.

Run: python tests/perf/bench_compile_time.py [--processes 3] [--steps 6] [--out bench-compile-time.json]
Target (issue 38): the first compile with the taps within 2x of plain torch.compile's.  Each variant compiles in a
process of its own with an empty Inductor cache (a cold compile, as a job's first), pinned to one core with one
compile thread; "compile" is the first training step (forward and backward graphs compiled, one step run), "step"
the median of the next steps.  The losses are compared too: every variant must give plain's, to the bit.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VARIANTS = {
    "plain": None,
    "statistic dump (every node)": {"dump": {"common_dump_settings": {
        "dump_mode": 0, "path": "{tmp}/dump", "net_name": "Net", "iteration": "all", "saved_data": "statistic",
        "input_output": 0, "kernels": [], "support_device": [0]}}},
    "nan_check module": {"nan_check": {"enable": True, "path": "{tmp}"}},
    "nan_check op": {"nan_check": {"enable": True, "granularity": "op", "path": "{tmp}"}},
}


def child(variant: str, steps: int, tmp: str) -> dict[str, object]:
    import torch

    import obs
    from tests.obs.runtime.compiled_corpus import ResNet

    body = VARIANTS[variant]
    if body is not None:
        path = os.path.join(tmp, "env.json")
        with open(path, "w") as f:
            f.write(json.dumps(body).replace("{tmp}", tmp))
        obs.set_context(env_config_path=path)
    torch.manual_seed(0)
    model = ResNet((2, 2, 2, 2), 64, 10)
    compiled = torch.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    times, losses = [], []
    for _ in range(steps):
        x, y = torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
        start = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(compiled(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item().hex())
        times.append(time.perf_counter() - start)
    return {"compile_s": times[0], "step_ms": statistics.median(times[1:]) * 1e3, "losses": losses}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default="bench-compile-time.json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        with tempfile.TemporaryDirectory(prefix="obs-bench-") as tmp:
            print(json.dumps(child(args.child, args.steps, tmp)))
        return 0
    runs: dict[str, list[dict[str, object]]] = {v: [] for v in VARIANTS}
    for _ in range(args.processes):
        for variant in VARIANTS:  # alternating, so a load that comes and goes touches every variant alike
            with tempfile.TemporaryDirectory(prefix="obs-inductor-") as cache:
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TORCHINDUCTOR_COMPILE_THREADS": "1",
                       "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
                done = subprocess.run(["taskset", "-c", "0", sys.executable, __file__, "--child", variant,
                                       "--steps", str(args.steps)], capture_output=True, text=True, env=env, cwd=ROOT)
            if done.returncode:
                sys.stderr.write(done.stderr[-3000:])
                return 2
            runs[variant].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"{variant}: {runs[variant][-1]['compile_s']:.1f} s", file=sys.stderr, flush=True)
    plain = runs["plain"]
    table = {}
    for variant, got in runs.items():
        compile_s = statistics.median(r["compile_s"] for r in got)  # type: ignore[misc]
        step_ms = statistics.median(r["step_ms"] for r in got)  # type: ignore[misc]
        table[variant] = {"compile_s": round(compile_s, 1), "step_ms": round(step_ms, 1),
                          "compile_ratio": round(compile_s / statistics.median(r["compile_s"] for r in plain), 2),
                          "step_ratio": round(step_ms / statistics.median(r["step_ms"] for r in plain), 2),
                          "same_losses": all(r["losses"] == plain[0]["losses"] for r in got),
                          "runs": got}
    print("| variant | first compile (s) | ratio | step (ms) | ratio | losses as plain's |")
    print("|---|---|---|---|---|---|")
    for variant, row in table.items():
        print(f"| {variant} | {row['compile_s']} | {row['compile_ratio']} | {row['step_ms']} | {row['step_ratio']} "
              f"| {'yes' if row['same_losses'] else 'NO'} |")
    with open(args.out, "w") as f:
        json.dump({"processes": args.processes, "steps": args.steps, "variants": table}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
