"""Cost of one ``obs.scalar(name, value)`` call on the training thread, with the profiler's metrics on and off.

Run: python tests/perf/bench_scalar.py [--rounds 15] [--calls 100000] [--out bench-scalar.json]
Target (issue "Weeks, not minutes"): "costs little per call": well under a microsecond for a number, about a
``.item()`` more for a CPU tensor, and a function call when metrics are off.

One process pinned to one core (its exporter process on the other), a session with metrics on (Prometheus on
a free port: nothing is scraped) started once, as in a real job.  Each round times ``--calls`` calls per
variant in a loop (the loop's own cost, timed as the empty loop, is subtracted), variants rotating from round
to round; the figure is the median over rounds, in ns per call.  References: ``loss.item()`` alone (what
reading a CPU tensor costs anyway) and the same record as a JSON blob in the ring (the route not taken),
and the MLP step of the other benchmarks, to put a call in proportion.  CUDA tensors (a non-blocking copy
into pinned memory and an event per call) are not measured here: no GPU on these machines.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=100_000)
    parser.add_argument("--out", default="bench-scalar.json")
    args = parser.parse_args()

    import torch

    import obs
    from obs.features.profiling.profile_session import ProfileSession
    from obs.runtime import job
    from obs.settings.profiler_options import ProfileRequest
    from recorder.layout import Kind
    from tests.recorder._jobs import free_port

    from _harness import mlp, pin_to_one_core

    pin_to_one_core()
    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="obs-bench-scalar-")
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    request = ProfileRequest(levels=("training_trace",), output=tmp, endpoint="", protocol="", steps="",
                             span_budget=50, module_depth=3, max_file_mb=100, metrics=("prometheus",),
                             prometheus=("127.0.0.1", free_port()))
    session = ProfileSession(request, rank=0, world_size=1, run_id="bench", versions=job.versions())
    session.pause()
    time.sleep(3)  # the exporter process has started

    model = torch.nn.Linear(4, 1)
    loss = model(torch.randn(8, 4)).pow(2).mean()  # a 0-d CPU tensor with a grad_fn, as a loss is
    scalar, ring, calls = obs.scalar, session.ring, range(args.calls)

    def empty() -> None:
        for _ in calls:
            pass

    def number() -> None:
        for _ in calls:
            scalar("loss", 0.25)

    def integer() -> None:
        for _ in calls:
            scalar("tokens", 4096)

    def tensor() -> None:
        for _ in calls:
            scalar("loss", loss)

    def item() -> None:
        for _ in calls:
            loss.item()

    def blob() -> None:
        for _ in calls:
            ring.blob(Kind.MARKER, {"scalar": "loss", "value": 0.25, "step": 7})

    variants = {  # name: (loop, metrics on)
        "metrics off: obs.scalar(name, float)": (number, False),
        "obs.scalar(name, float)": (number, True),
        "obs.scalar(name, int)": (integer, True),
        "obs.scalar(name, CPU tensor)": (tensor, True),
        "reference: loss.item() alone": (item, False),
        "reference: the same record as a JSON blob": (blob, False),
    }
    names = list(variants)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            loop, on = variants[name]
            if on:
                session.resume()
            t0 = time.perf_counter_ns()
            empty()
            t1 = time.perf_counter_ns()
            loop()
            t2 = time.perf_counter_ns()
            if on:
                session.pause()
            samples[name].append(((t2 - t1) - (t1 - t0)) / args.calls)
    workload = mlp()
    for _ in range(20):
        workload.step()
    steps = []
    for _ in range(200):
        t0 = time.perf_counter_ns()
        workload.step()
        steps.append(time.perf_counter_ns() - t0)
    session.close()
    step_ns = statistics.median(steps)
    medians = {name: statistics.median(values) for name, values in samples.items()}
    print(f"obs.scalar per call (median of {args.rounds} rounds x {args.calls} calls; MLP step {step_ns / 1e3:.0f} µs)")
    print(f"{'variant':<44} {'ns/call':>9} {'of an MLP step':>15}")
    for name, ns in medians.items():
        print(f"{name:<44} {ns:>9.0f} {ns / step_ns:>14.3%}")
    data = {"benchmark": "obs.scalar per call", "torch": torch.__version__, "python": platform.python_version(),
            "machine": platform.machine(), "rounds": args.rounds, "calls": args.calls, "mlp_step_ns": step_ns,
            "results": {name: {"ns_per_call": round(ns, 1), "ns_per_call_rounds": [round(v, 1) for v in samples[name]],
                               "share_of_mlp_step": round(ns / step_ns, 6)} for name, ns in medians.items()}}
    with open(args.out, "w") as fh:
        json.dump(data, fh, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
