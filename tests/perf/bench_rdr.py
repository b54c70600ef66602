"""Cost of the Running Data Recorder on training steps, per op, and of a dump of full rings.

Run: python tests/perf/bench_rdr.py [--rounds 20] [--out bench-rdr.json]
Targets (issue "Running Data Recorder"): module granularity <= 3% over plain PyTorch on the MLP
and <= 1% on the CNN; op granularity within 1 us per op of a do-nothing interception of the
same kind (an OP subscriber that does nothing, i.e. the same dispatch mode); a dump of full
default rings <= 250 ms.  "Python handlers" variants run without the C hot path
(recorder/_hotpath.c, OBS_RDR_PURE_PYTHON=1) to show what it buys.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import obs  # noqa: E402
from _harness import Workload, cnn, measure, mlp, report  # noqa: E402

TMP = tempfile.mkdtemp(prefix="obs-bench-rdr-")


def plain():
    return lambda: None


def rdr(granularity: str, pure_python: bool = False):
    """RDR at ``granularity``; ``pure_python`` uses the Python handlers instead of recorder/_hotpath.c."""
    def setup():
        path = os.path.join(TMP, f"{granularity}.json")
        with open(path, "w") as fh:
            json.dump({"rdr": {"enable": True, "path": TMP, "granularity": granularity}}, fh)
        os.environ["OBS_RDR_PURE_PYTHON"] = "1" if pure_python else "0"
        obs.set_context(env_config_path=path)
        live = obs.rdr.recorder()
        assert live is not None and (granularity in ("off", "step") or bool(live._writers) is not pure_python)

        def teardown():
            obs.reset_context()
            del os.environ["OBS_RDR_PURE_PYTHON"]
        return teardown
    return setup


def reference():
    """The same hooks with a deque-append subscriber: what the wrapper and step tracking cost alone."""
    ring: collections.deque = collections.deque(maxlen=4096)
    clock = time.perf_counter_ns
    subs = [obs.subscribe(obs.Event.MODULE_ENTER, lambda scope, module: ring.append((0, scope, clock()))),
            obs.subscribe(obs.Event.MODULE_EXIT, lambda scope, module, error: ring.append((1, scope, clock()))),
            obs.subscribe(obs.Event.STEP_BEGIN, lambda step: None),
            obs.subscribe(obs.Event.STEP_END, lambda step, duration_ns: None),
            obs.subscribe(obs.Event.MEMORY, lambda step, stats: None)]
    return lambda: [sub.remove() for sub in subs]


def op_noop():
    sub = obs.subscribe(obs.Event.OP, lambda name, args, kwargs, duration_ns, error: None)
    return sub.remove


def ops_per_step(workload: Workload) -> int:
    count = [0]
    with obs.subscribe(obs.Event.OP, lambda *a: count.__setitem__(0, count[0] + 1)):
        workload.step()
    return count[0]


def dump_full_rings(rounds: int) -> dict[str, float]:
    from recorder.layout import Kind

    rdr("module")()
    live = obs.rdr.recorder()
    ring = live.ring
    scopes = [ring.intern(f"Default/net-Net/layer{i}-Linear") for i in range(64)]
    name, sig = ring.intern("addmm"), ring.intern("float32[64, 784]@cpu float32[784, 256]@cpu")
    for region in ring.rings.values():
        append = ring.appender(region.name)
        kind = {"step": Kind.STEP_END, "module": Kind.MODULE_ENTER, "op": Kind.OP, "memory": Kind.MEMORY,
                "collective": Kind.COLLECTIVE}[region.name]
        for i in range(region.capacity):
            append(kind, 0, scopes[i % 64] if kind != Kind.OP else name, i, 1000, sig if kind == Kind.OP else 0)
    for i in range(ring.blobs.capacity):
        ring.blob(Kind.PRINT, {"values": ["loss", f"Float32[] {i}"], "step": i, "source": "train.py:1"})
    events = sum(r.capacity for r in ring.rings.values()) + ring.blobs.capacity
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        live.dump("bench")
        times.append((time.perf_counter() - t0) * 1e3)
    obs.reset_context()
    return {"events": events, "median_ms": round(statistics.median(times), 1), "max_ms": round(max(times), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--out", default="bench-rdr.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    step_variants = {"plain": plain, "rdr step": rdr("step"), "rdr module": rdr("module"),
                     "rdr module, Python handlers": rdr("module", pure_python=True),
                     "reference: deque subscriber": reference}
    results = {w.name: measure(w, step_variants, args.rounds) for w in (mlp(), cnn())}
    small = mlp()
    op_variants = {"plain": plain, "OP no-op subscriber": op_noop, "rdr module": rdr("module"), "rdr op": rdr("op"),
                   "rdr op, Python handlers": rdr("op", pure_python=True)}
    op_results = measure(small, op_variants, max(4, args.rounds // 2))
    n_ops = ops_per_step(small)
    per_op_us = (op_results["rdr op"] - op_results["OP no-op subscriber"]) * 1e3 / n_ops
    # The op ring's own share: what op granularity adds over module granularity, beyond the interception.
    op_ring_us = ((op_results["rdr op"] - op_results["rdr module"])
                  - (op_results["OP no-op subscriber"] - op_results["plain"])) * 1e3 / n_ops
    results["mlp (op granularity)"] = op_results
    dump = dump_full_rings(5)
    print(f"op granularity: {n_ops} ops/step; rdr op - no-op interception = {per_op_us:+.3f} us per op (target <= 1);"
          f" of which op recording itself {op_ring_us:+.3f} us (the rest is module/step recording)")
    print(f"dump of full default rings ({dump['events']} events): median {dump['median_ms']} ms, max "
          f"{dump['max_ms']} ms (target <= 250)")
    report("bench_rdr", results, "plain", args.out, {
        "op_granularity": {"ops_per_step": n_ops, "us_per_op_over_noop_interception": round(per_op_us, 3),
                           "us_per_op_op_recording_only": round(op_ring_us, 3)},
        "dump_full_rings": dump,
        "targets": {"rdr module": {"mlp": "<= 1.03", "cnn": "<= 1.01"}, "us_per_op": "<= 1", "dump_ms": "<= 250"}})


if __name__ == "__main__":
    main()
