"""Cost of obs on GPU training steps: GPT-2 124M (bf16 autocast, synthetic tokens) and ResNet-50 (synthetic
images), one process per model, against plain PyTorch and torch.profiler; and the host syncs each variant adds.

Run (GPU): python tests/perf/bench_gpu.py [--budget-s 420] [--compile] [--out bench-gpu.json]
Smoke (CPU, no Python errors): python tests/perf/bench_gpu.py --device cpu --quick
Targets (issue 31): RDR module <= 1.01; RDR op <= 1.03 and below torch.profiler; NaN check <= 1.03; spans with GPU
time <= 1.02; statistic dump every step <= 1.15; host syncs added per step: 0.

The method of tests/perf/: variants alternate within each round (their order rotates every round), each switch
is followed by untimed settle steps, a round times a block of steps per variant between two device syncs (outside
the steps), and the figure is the median over rounds; "paired" is the median over rounds of (variant / plain in
the same round).  Rounds are added while the model's share of ``--budget-s`` lasts.  Host syncs are counted after
the timing, a few steps per variant: PyTorch's sync debug mode (a warning per synchronising call), and PyTorch's
GPU trace callbacks (stream, event and device synchronisations; turned on last: they cannot be turned off).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [HERE, ROOT]

MODELS = ("gpt2", "resnet50")
VARIANTS = ("plain", "rdr module", "rdr op", "spans + GPU time", "nan check", "statistic dump every step",
            "torch.profiler")
TARGETS = {"rdr module": 1.01, "rdr op": 1.03, "nan check": 1.03, "spans + GPU time": 1.02,
           "statistic dump every step": 1.15}
Teardown = Callable[[], None]


def versions() -> dict[str, Any]:
    """The card, driver, CUDA and torch the numbers belong to."""
    import torch

    out: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
                           "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None}
    if torch.cuda.is_available():
        out["card"] = torch.cuda.get_device_name(0)
        out["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        out["nvidia-smi"] = smi.stdout.strip() or None
        out["driver"] = smi.stdout.split(",")[1].strip() if smi.stdout.count(",") >= 2 else None
    except (OSError, subprocess.SubprocessError):
        out["driver"] = None
    return out


def make_variants(tmp: str, device: str, extra_profiler: dict[str, Any]) -> dict[str, Callable[[], Teardown]]:
    """Each variant's setup, returning its teardown; obs's are turned on through an env config file."""
    import torch

    from _harness import env_config_variant  # type: ignore[import-not-found]  # beside this file

    def with_config(name: str, body: dict[str, Any]) -> Callable[[], Teardown]:
        return env_config_variant(tmp, name, body)

    def rdr(granularity: str) -> Callable[[], Teardown]:
        return with_config(f"rdr_{granularity}", {"rdr": {"enable": True, "path": os.path.join(tmp, "rdr"),
                                                          "granularity": granularity}})

    # step, phase and module spans; the profiler times them on the device by itself once CUDA is in use
    profiler: dict[str, Any] = {"enable": True, "options": "training_trace:task_trace",
                                "output": os.path.join(tmp, "profile"), **extra_profiler}
    statistic = {"dump": {"common_dump_settings": {
        "dump_mode": 0, "path": os.path.join(tmp, "dump"), "net_name": "Net", "iteration": "all",
        "saved_data": "statistic", "input_output": 0, "kernels": [], "support_device": [0]}}}

    def torch_profiler() -> Teardown:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        prof = torch.profiler.profile(activities=activities)
        prof.__enter__()
        return lambda: prof.__exit__(None, None, None)  # its processing is not a step's cost: outside the timing

    return {"plain": lambda: (lambda: None), "rdr module": rdr("module"), "rdr op": rdr("op"),
            "spans + GPU time": with_config("spans", {"profiler": profiler}),
            "nan check": with_config("nan", {"nan_check": {"enable": True, "path": os.path.join(tmp, "nan")}}),
            "statistic dump every step": with_config("stat", statistic), "torch.profiler": torch_profiler}


def build(model: str, device: Any, args: argparse.Namespace) -> tuple[Callable[[], None], str]:
    from _gpu_models import gpt2, resnet50

    if model == "gpt2":
        batch = args.batch or (2 if args.quick else 8)
        _, step, source = gpt2(device, quick=args.quick, batch=batch, seq=32 if args.quick else 1024,
                               compile=args.compile)
        return step, f"GPT-2 124M{' (quick: 2 layers)' if args.quick else ''}, batch {batch}, {source}"
    batch = args.batch or (2 if args.quick else 64)
    _, step, source = resnet50(device, quick=args.quick, batch=batch, compile=args.compile)
    return step, f"ResNet-50, batch {batch}, {source}"


def child(model: str, args: argparse.Namespace) -> dict[str, Any]:
    """One model in this process: timed rounds, then the host syncs per step of each variant."""
    import torch

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if args.quick and not cuda:
        torch.set_num_threads(1)  # a smoke test on a shared machine
    start = time.monotonic()
    budget = args.budget_s / len(args.models)
    torch.manual_seed(0)
    step, description = build(model, device, args)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(args.warmup):
        step()
    sync()
    tmp = tempfile.mkdtemp(prefix="obs-bench-gpu-")
    try:
        variants = make_variants(tmp, device.type, json.loads(args.profiler_extra))
        names = [v for v in VARIANTS if v in variants]
        per_round: dict[str, list[float]] = {name: [] for name in names}
        failed: dict[str, str] = {}
        steps = args.steps or (1 if args.quick else 10)
        rounds, round_s = 0, 0.0
        while rounds < args.max_rounds:
            elapsed = time.monotonic() - start
            # a round more while it fits, keeping room for the sync count (about one round)
            if rounds >= args.min_rounds and elapsed + 2.2 * round_s > budget:
                break
            t_round = time.monotonic()
            for name in names[rounds % len(names):] + names[:rounds % len(names)]:
                try:
                    teardown = variants[name]()
                except Exception as exc:  # noqa: BLE001 - a variant that cannot start here (a package missing)
                    failed[name] = repr(exc)
                    continue
                try:
                    for _ in range(args.settle):
                        step()
                    sync()
                    t0 = time.perf_counter_ns()
                    for _ in range(steps):
                        step()
                    sync()
                    per_round[name].append((time.perf_counter_ns() - t0) / 1e6 / steps)
                finally:
                    teardown()
            round_s = time.monotonic() - t_round
            rounds += 1
            names = [n for n in names if n not in failed]
            per_round = {n: v for n, v in per_round.items() if n not in failed}
        try:
            syncs = count_syncs(variants, names, step, sync) if cuda else {}
        except Exception as exc:  # noqa: BLE001 - the timings stand without the count
            syncs = {"error": repr(exc)}  # type: ignore[dict-item]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    medians = {name: statistics.median(v) for name, v in per_round.items()}
    base = per_round["plain"]
    paired = {name: statistics.median(a / b for a, b in zip(v, base)) for name, v in per_round.items()}
    return {"model": model, "description": description, "device": str(device), "rounds": rounds,
            "steps_per_round": steps, "compile": args.compile, "profiler_extra": json.loads(args.profiler_extra),
            "seconds": round(time.monotonic() - start, 1),
            "median_ms": medians, "ratio": {n: medians[n] / medians["plain"] for n in names}, "paired_ratio": paired,
            "rounds_ms": per_round, "syncs_per_step": syncs, "variants_failed": failed}


def count_syncs(variants: dict[str, Callable[[], Teardown]], names: list[str], step: Callable[[], None],
                sync: Callable[[], None], steps: int = 3) -> dict[str, dict[str, float]]:
    """Per variant, host syncs per step: by the sync debug mode's warnings, and by the GPU trace's callbacks."""
    import torch

    out: dict[str, dict[str, float]] = {name: {} for name in names}

    def counted(name: str, counter: Callable[[], contextlib.AbstractContextManager[list[Any]]], key: str) -> None:
        teardown = variants[name]()
        try:
            step()
            sync()
            with counter() as seen:
                for _ in range(steps):
                    step()
            sync()
            out[name][key] = len(seen) / steps
        finally:
            teardown()

    @contextlib.contextmanager
    def debug_mode() -> Any:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield seen
            finally:
                torch.cuda.set_sync_debug_mode("default")
        seen[:] = [w for w in seen if "synchroniz" in str(w.message)]

    for name in names:
        counted(name, debug_mode, "sync_debug_mode")
    try:
        from torch.cuda import _gpu_trace

        calls: list[Any] = []
        for register in (_gpu_trace.register_callback_for_device_synchronization,
                         _gpu_trace.register_callback_for_stream_synchronization,
                         _gpu_trace.register_callback_for_event_synchronization):
            register(lambda *a: calls.append(a) if tracing else None)
        tracing = False
        torch._C._activate_gpu_trace()

        @contextlib.contextmanager
        def trace() -> Any:
            nonlocal tracing
            calls.clear()
            tracing = True
            try:
                yield calls
            finally:
                tracing = False

        for name in names:
            counted(name, trace, "gpu_trace")
    except (ImportError, AttributeError, RuntimeError) as exc:
        for name in names:
            out[name]["gpu_trace"] = float("nan")
        print(f"GPU trace callbacks unavailable: {exc!r}", file=sys.stderr)
    return out


def verdict(result: dict[str, Any]) -> dict[str, Any]:
    """Each target against the paired ratio; host syncs added per step (over plain) by both counts."""
    paired, out = result["paired_ratio"], {}
    for name, limit in TARGETS.items():
        if name in paired:
            out[name] = {"paired_ratio": round(paired[name], 4), "target": f"<= {limit}", "met": paired[name] <= limit}
    if "rdr op" in paired and "torch.profiler" in paired:
        out["rdr op below torch.profiler"] = {"met": paired["rdr op"] < paired["torch.profiler"]}
    syncs = result.get("syncs_per_step") or {}
    if syncs and "error" not in syncs:
        plain = syncs.get("plain", {})
        out["host syncs added per step"] = {name: {k: v - plain.get(k, 0.0) for k, v in counts.items()}
                                            for name, counts in syncs.items() if name != "plain"}
    return out


def print_table(results: list[dict[str, Any]], info: dict[str, Any]) -> None:
    """The table, last in the output: per model and variant, ms per step, ratios, host syncs added per step (by the
    sync debug mode, and by the GPU trace)."""
    print(f"card {info.get('card')}  driver {info.get('driver')}  CUDA {info.get('cuda')}  torch {info.get('torch')}")
    print(f"{'model':<9} {'variant':<27} {'ms/step':>9} {'ratio':>7} {'paired':>7} {'syncs+':>7} {'trace+':>7}")
    for r in results:
        if "error" in r:
            print(f"{r['model']:<9} failed: {r['error']}")
            continue
        added = r["verdict"].get("host syncs added per step", {})
        for name, ms in r["median_ms"].items():
            counts = added.get(name, {})
            shown = "".join(f" {counts[k]:>7.2f}" if k in counts else f" {'':>7}" for k in ("sync_debug_mode",
                                                                                           "gpu_trace"))
            print(f"{r['model']:<9} {name:<27} {ms:>9.2f} {r['ratio'][name]:>7.3f} {r['paired_ratio'][name]:>7.3f}"
                  + shown)
        for name, why in r.get("variants_failed", {}).items():
            print(f"{r['model']:<9} {name:<27} could not start: {why}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--quick", action="store_true", help="miniature models, a round or two: a smoke test")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--budget-s", type=float, default=420.0, help="seconds for all models together")
    parser.add_argument("--compile", action="store_true", help="torch.compile the models")
    parser.add_argument("--steps", type=int, default=0, help="timed steps per round (default: 10; quick: 1)")
    parser.add_argument("--batch", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--settle", type=int, default=2)
    parser.add_argument("--min-rounds", type=int, default=3)
    parser.add_argument("--max-rounds", type=int, default=30)
    parser.add_argument("--profiler-extra", default="{}", help="JSON merged into the spans variant's profiler section")
    parser.add_argument("--out", default="bench-gpu.json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.models = [m for m in args.models.split(",") if m]
    if args.quick:
        args.min_rounds, args.max_rounds, args.warmup, args.settle = 1, 1, 1, 1
    if args.child:
        print(json.dumps(child(args.child, args)))
        return
    info = versions()
    print(json.dumps(info))
    results = []
    for model in args.models:
        command = [sys.executable, __file__, "--child", model, *sys.argv[1:]]
        share = args.budget_s / len(args.models)
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=share * 1.5 + 120)
        except subprocess.TimeoutExpired:
            results.append({"model": model, "error": f"timed out after {share * 1.5 + 120:.0f} s"})
            continue
        if done.returncode != 0:
            results.append({"model": model, "error": f"exit {done.returncode}: {done.stderr.strip()[-1500:]}"})
            continue
        result = json.loads(done.stdout.strip().splitlines()[-1])
        result["verdict"] = verdict(result)
        results.append(result)
    print_table(results, info)
    with open(args.out, "w") as fh:
        json.dump({"benchmark": "bench_gpu", "versions": info, "targets": {k: f"<= {v}" for k, v in TARGETS.items()}
                   | {"rdr op": "<= 1.03 and below torch.profiler", "host syncs added per step": 0},
                   "results": results}, fh, indent=2, default=str)
    print(f"wrote {args.out}")
    if any("error" in r for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
