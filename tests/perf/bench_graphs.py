"""Cost of save_graphs: obs.compile's first call at level 2 vs 0, and writing a 10 000-node graph.

Run: python tests/perf/bench_graphs.py [--processes 3] [--rounds 2] [--out bench-graphs.json]
Targets (issue "Graph/IR dumping"): level 2 adds <= 10% to the first-call time (forward + backward,
Dynamo + AOT autograd) of obs.compile with the aot_eager backend on a ResNet-18-sized network built
here; a 10 000-node graph is written (described, .ir text, file) in <= 1 s.

Each process is pinned to one core and alternates the variants round by round (plain torch.compile,
obs level 0, obs level 2), each a fresh compile after ``torch._dynamo.reset()``; the report takes
the median over all processes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import obs  # noqa: E402

VARIANTS = ("torch.compile", "obs level 0", "obs level 2")


class Block(torch.nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(cout)
        self.conv2 = torch.nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(cout)
        self.shortcut = torch.nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = torch.nn.Sequential(torch.nn.Conv2d(cin, cout, 1, stride, bias=False),
                                                torch.nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet18(torch.nn.Module):
    """ResNet-18 (CIFAR layout: 11.2 M parameters, 4 stages of 2 basic blocks)."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(64)
        layers, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers.append(torch.nn.Sequential(Block(cin, cout, stride), Block(cout, cout, 1)))
            cin = cout
        self.layers = torch.nn.Sequential(*layers)
        self.fc = torch.nn.Linear(512, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layers(torch.relu(self.bn1(self.conv1(x))))
        return self.fc(torch.flatten(torch.nn.functional.adaptive_avg_pool2d(out, 1), 1))


def first_call(variant: str, folder: str) -> float:
    """Seconds of a fresh compile's first forward + backward."""
    torch._dynamo.reset()
    obs.reset_context()
    torch.manual_seed(0)
    model = ResNet18()
    x = torch.randn(8, 3, 32, 32)
    if variant == "torch.compile":
        compiled = torch.compile(model, backend="aot_eager")
    else:
        level = 2 if variant == "obs level 2" else 0
        obs.set_context(mode=obs.GRAPH_MODE, save_graphs=level, save_graphs_path=folder)
        compiled = obs.compile(model, backend="aot_eager")
    t0 = time.perf_counter()
    compiled(x).sum().backward()
    return time.perf_counter() - t0


def big_graph(nodes: int) -> torch.fx.GraphModule:
    """An FX graph of ``nodes`` aten ops with fake values in ``meta['val']`` (as AOT autograd leaves them)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        for i in range(nodes // 2):
            x = torch.relu(x @ w) if i % 2 else torch.add(x, 1.0).sin()
        return x

    return make_fx(f, tracing_mode="fake")(torch.randn(16, 16), torch.randn(16, 16))


def write_big(nodes: int, repeats: int) -> dict[str, float]:
    """Median seconds to describe and write a ``nodes``-op graph at level 1 (.ir) and level 3 (+verbose, .dot)."""
    from obs.features.graphs import feature
    from obs.features.graphs.describe import describe

    gm = big_graph(nodes)
    out: dict[str, float] = {"nodes": float(sum(1 for n in gm.graph.nodes if n.op == "call_function"))}
    with tempfile.TemporaryDirectory() as folder:
        obs.set_context(save_graphs_path=folder)
        for level in (1, 3):
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                doc = describe(gm, "big", stage="fx")
                feature.publish(doc, "fx", "big", level=level)
                times.append(time.perf_counter() - t0)
            out[f"level {level} s"] = statistics.median(times)
        out["ir bytes"] = float(max(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)
                                    if f.endswith(".ir")))
    obs.reset_context()
    return out


def child(rounds: int, core: int) -> dict[str, object]:
    from obs.features.graphs import feature

    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
    spent: list[float] = []
    graph_work: list[float] = []  # seconds of obs's own graph work (describe, text, files) per level-2 compile
    handler = feature._on_compiled

    def timed(*args: object) -> None:
        t0 = time.perf_counter()
        handler(*args)
        spent.append(time.perf_counter() - t0)

    feature._on_compiled = timed  # type: ignore[method-assign]
    with tempfile.TemporaryDirectory() as folder:
        first_call("torch.compile", folder)  # warm-up: imports, Dynamo's first-use costs
        for r in range(rounds):
            order = VARIANTS[r % 3:] + VARIANTS[:r % 3]
            for variant in order:
                spent.clear()
                samples[variant].append(first_call(variant, folder))
                if variant == "obs level 2":
                    graph_work.append(sum(spent))
    return {"first_call_s": samples, "graph_work_s": graph_work, "write": write_big(10_000, 3)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="bench-graphs.json")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.rounds, args.child)))
        return 0
    cores = sorted(os.sched_getaffinity(0))
    runs = []
    for p in range(args.processes):
        done = subprocess.run([sys.executable, __file__, "--child", str(cores[p % len(cores)]), "--rounds",
                               str(args.rounds)], capture_output=True, text=True, check=True)
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first = {v: statistics.median([s for run in runs for s in run["first_call_s"][v]]) for v in VARIANTS}
    # The machine's load drifts over minutes: the ratios of each round's neighbouring samples are steadier.
    paired = {v: statistics.median([a / b for run in runs for a, b in zip(run["first_call_s"][v],
                                                                          run["first_call_s"]["obs level 0"])])
              for v in VARIANTS}
    work = statistics.median([w for run in runs for w in run["graph_work_s"]])
    write = {k: statistics.median([run["write"][k] for run in runs]) for k in runs[0]["write"]}
    print("obs.compile first call (forward + backward, aot_eager, ResNet-18 CIFAR, batch 8), median s")
    for v in VARIANTS:
        print(f"  {v:<15} {first[v]:8.3f}   ratio vs obs level 0: {first[v] / first['obs level 0']:.3f} "
              f"(median of per-round ratios {paired[v]:.3f})")
    print(f"  obs's own graph work at level 2 (3 graphs described, 6 files): {work:.3f} s median, "
          f"{work / first['obs level 0']:.1%} of the level-0 first call")
    print(f"writing a {int(write['nodes'])}-node graph: level 1 (.ir) {write['level 1 s']:.3f} s, "
          f"level 3 (.ir + verbose + .dot) {write['level 3 s']:.3f} s, .ir {write['ir bytes'] / 1e6:.1f} MB")
    data = {"benchmark": "graphs", "torch": torch.__version__, "python": platform.python_version(),
            "processes": args.processes, "rounds": args.rounds, "first_call_s": first,
            "level2_ratio": first["obs level 2"] / first["obs level 0"], "paired_ratios": paired,
            "graph_work_s": work, "graph_work_share": work / first["obs level 0"],
            "obs_level0_vs_torch": first["obs level 0"] / first["torch.compile"], "write": write, "runs": runs}
    with open(args.out, "w") as fh:
        json.dump(data, fh, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
