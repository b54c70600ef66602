"""Interleaved timing of training-step variants in one process: medians, ratios, JSON."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

Setup = Callable[[], Callable[[], None]]  # installs a variant, returns its teardown


@dataclass
class Workload:
    name: str
    step: Callable[[], Any]  #: one training step; mlp() and cnn() return its loss
    steps_per_round: int


def mlp() -> Workload:
    model = torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 784), torch.randint(0, 10, (64,))

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss
    return Workload("mlp", step, 60)


def cnn() -> Workload:
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(64 * 4 * 4, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss
    return Workload("cnn", step, 12)


def measure_rounds(workload: Workload, variants: dict[str, Setup], rounds: int, settle: int = 1,
                   finish: Callable[[], None] | None = None, means: dict[str, list[float]] | None = None
                   ) -> dict[str, list[float]]:
    """Per variant, the median step time (ms) of each round; variants rotate order every round to spread drift.

    ``settle`` untimed steps follow each switch, for every variant: what a variant's start costs once (cold
    caches, first pages of a new ring) is not a per-step cost, and a round re-creates it.

    ``means``, when given, gets each round's mean step time, ``finish()`` (called after the round's last step, for
    every variant) timed with it: the work a variant hands to a thread of its own (on the same pinned core), which a
    median leaves out when it lands on a few steps of the round, and which ``finish`` waits for."""
    samples: dict[str, list[list[float]]] = {name: [] for name in variants}
    names = list(variants)
    for _ in range(3):
        workload.step()  # warm-up: allocator, thread pools
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            teardown = variants[name]()
            times = []
            try:
                for _ in range(settle):
                    workload.step()
                for _ in range(workload.steps_per_round):
                    t0 = time.perf_counter_ns()
                    workload.step()
                    times.append((time.perf_counter_ns() - t0) / 1e6)
                if means is not None:
                    t0 = time.perf_counter_ns()
                    if finish is not None:
                        finish()
                    means.setdefault(name, []).append((sum(times) + (time.perf_counter_ns() - t0) / 1e6)
                                                      / len(times))
            finally:
                teardown()
            samples[name].append(times)
    return {name: [statistics.median(times) for times in per_round] for name, per_round in samples.items()}


def measure(workload: Workload, variants: dict[str, Setup], rounds: int) -> dict[str, float]:
    """Median step time (ms) per variant: the median of its rounds' medians."""
    return {name: statistics.median(values) for name, values in measure_rounds(workload, variants, rounds).items()}


def paired_ratios(per_round: dict[str, list[float]], baseline: str) -> dict[str, float]:
    """Per variant, the median over rounds of (its round median / the baseline's in the same round): the
    machine's drift between rounds cancels, as each round times every variant within a second."""
    base = per_round[baseline]
    return {name: statistics.median(v / b for v, b in zip(values, base)) for name, values in per_round.items()}


def report(title: str, results: dict[str, dict[str, float]], baseline: str, out: str,
           extra: dict[str, object] | None = None,
           paired: dict[str, dict[str, float]] | None = None) -> dict[str, object]:
    """Print and write the table: median ms, ratio of medians and, where given, the paired round ratio."""
    data: dict[str, object] = {
        "benchmark": title, "torch": torch.__version__, "python": platform.python_version(),
        "machine": platform.machine(), "threads": torch.get_num_threads(), "results": {}}
    print(f"{title}  (median ms per step; ratio vs {baseline}" + ("; paired: median of per-round ratios)" if paired
                                                                  else ")"))
    print(f"{'workload':<8} {'variant':<28} {'ms/step':>9} {'ratio':>8}" + (f" {'paired':>8}" if paired else ""))
    for workload, medians in results.items():
        base = medians[baseline]
        pairs = (paired or {}).get(workload, {})
        rows = {}
        for variant, ms in medians.items():
            rows[variant] = {"median_ms": round(ms, 4), "ratio": round(ms / base, 4)}
            line = f"{workload:<8} {variant:<28} {ms:>9.3f} {ms / base:>8.3f}"
            if variant in pairs:
                rows[variant]["paired_ratio"] = round(pairs[variant], 4)
                line += f" {pairs[variant]:>8.3f}"
            print(line)
        data["results"][workload] = rows  # type: ignore[index]
    data.update(extra or {})
    with open(out, "w") as fh:
        json.dump(data, fh, indent=2)
    print(f"wrote {out}")
    return data


def env_config_variant(tmp: str, name: str, body: dict[str, Any]) -> Setup:
    """A variant that turns obs on through an env config file holding ``body`` (written under ``tmp`` as
    ``{name}.json``); its teardown is ``obs.reset_context``."""
    def setup() -> Callable[[], None]:
        import obs

        path = os.path.join(tmp, f"{name}.json")
        with open(path, "w") as fh:
            json.dump(body, fh)
        obs.set_context(env_config_path=path)
        return obs.reset_context
    return setup


def pin_to_one_core() -> None:
    """Run on one core (the last one: the first tends to take the interrupts)."""
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[-1]})


#: glibc malloc kept from handing memory back to the OS.  With its defaults a CPU training step frees and
#: re-maps its large buffers: ~1,000 minor page faults per CNN step, a count that depends on the heap's state
#: (which any variant perturbs) and on this VM's memory reclaim, and moves a variant's ratio by several percent.
#: The same setting holds for every variant, plain PyTorch included (PyTorch's CPU tuning guides swap the
#: allocator for jemalloc or tcmalloc for the same reason).
STEADY_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(1 << 32), "MALLOC_TRIM_THRESHOLD_": str(1 << 32),
                 "MALLOC_TOP_PAD_": str(64 << 20)}


def in_processes(script: str, args: list[str], processes: int, env: dict[str, str] | None = None
                 ) -> list[dict[str, Any]]:
    """Run ``script --child ARGS`` ``processes`` times, one after another (``env`` added to the environment);
    each prints one JSON line last."""
    runs = []
    for i in range(processes):
        out = subprocess.run([sys.executable, script, "--child", *args], capture_output=True, text=True, check=True,
                             env={**os.environ, **(env or {})})
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"process {i + 1}/{processes} done", file=sys.stderr)
    return runs


def median_ratios(runs: list[dict[str, dict[str, float]]], baseline: str) -> dict[str, dict[str, float]]:
    """Per workload and variant: the median over processes of (variant / baseline in the same process)."""
    return {w: {v: statistics.median(run[w][v] / run[w][baseline] for run in runs) for v in runs[0][w]}
            for w in runs[0]}
