"""Cost of the Running Data Recorder on training steps, per op, and of a dump of full rings.

Run: python tests/perf/bench_rdr.py [--rounds 12] [--processes 3] [--out bench-rdr.json] [--variants "a|b"]
     python tests/perf/bench_rdr.py --instructions [--variants "a|b"]  (instructions per step: _instructions.py)
Each process is pinned to one core and times every variant in rounds alternating with plain
PyTorch, after a few untimed steps per switch (a recorder's start is paid once in a real job); the
table gives the median over processes of each variant's ratio to plain, and of its paired ratio
(the median over rounds of variant / plain in the same round).
Targets: RDR ``module`` <= 1.03 on the MLP, <= 1.01 on the CNN; RDR ``op`` (with input shapes)
below torch.profiler recording the same steps, aiming at <= 1.15 / <= 1.03; the op record itself
<= 1 us per op; a dump of full default rings <= 250 ms.  "native" op recording is the
RecordFunction observer (recorder/native_ops.py); "dispatch mode" is the Python fallback
(OBS_NATIVE_OPS=0); "Python handlers" run without the C hot path (OBS_NATIVE_RECORDER=0).
"""

from __future__ import annotations

import argparse
import atexit
import collections
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch

import obs

from _harness import (
    STEADY_MALLOC,
    Workload,
    cnn,
    in_processes,
    measure_rounds,
    median_ratios,
    mlp,
    paired_ratios,
    pin_to_one_core,
)

TMP = tempfile.mkdtemp(prefix="obs-bench-rdr-")
atexit.register(shutil.rmtree, TMP, ignore_errors=True)  # its rings are reserved on disk: ~100 MB a process


def plain():
    return lambda: None


def rdr(granularity: str, pure_python: bool = False, native: bool = True):
    """RDR at ``granularity``; ``pure_python``: Python handlers, not recorder/_hotpath.c; ``native``: op
    records from the RecordFunction observer, else the dispatch mode."""
    def setup():
        path = os.path.join(TMP, f"{granularity}.json")
        with open(path, "w") as fh:
            json.dump({"rdr": {"enable": True, "path": TMP, "granularity": granularity}}, fh)
        os.environ["OBS_NATIVE_RECORDER"] = "0" if pure_python else "1"
        os.environ["OBS_NATIVE_OPS"] = "1" if native else "0"
        obs.set_context(env_config_path=path)
        live = obs.rdr.recorder()
        assert live is not None and (granularity in ("off", "step") or bool(_c_writers(live)) is not pure_python)
        if granularity == "op":
            from recorder import native_ops

            assert (native_ops._attached is not None) is (native and not pure_python), native_ops.unavailable_reason()

        def teardown():
            obs.reset_context()
            del os.environ["OBS_NATIVE_RECORDER"], os.environ["OBS_NATIVE_OPS"]
        return teardown
    return setup


def rdr_module_without(phases: bool, memory: bool):
    """RDR ``module`` with its step phases unsubscribed (the adapter then removes the backward wrapper and the
    optimizer phase hooks) and/or memory read at most every 50 ms (as c55a737 did): what each costs."""
    on = rdr("module")

    def setup():
        from obs._core.events import Event
        from obs.runtime import steps

        teardown = on()
        if memory:
            steps.MEMORY_INTERVAL_NS = 50_000_000
        if phases:
            for sub in obs.rdr.recorder()._subs.subs:
                if sub.event is Event.PHASE:
                    sub.remove()

        def undo():
            steps.MEMORY_INTERVAL_NS = 0
            teardown()
        return undo
    return setup


def _c_writers(live) -> list:
    """The recorder's C ring writers (a tree from before the ring handlers' move, ab.py's base: ``_writers``)."""
    subs = live._subs
    return subs.writers if hasattr(subs, "writers") else live._writers


def profiler(export: bool):
    """torch.profiler recording the same steps (CPU activity, input shapes), optionally exporting its trace."""
    from torch.profiler import ProfilerActivity, profile

    def setup():
        prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
        prof.__enter__()

        def teardown():
            prof.__exit__(None, None, None)
            if export:
                prof.export_chrome_trace(os.path.join(TMP, "trace.json"))
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


VARIANTS = {"plain": plain, "plain again (the method's floor)": plain, "rdr step": rdr("step"),
            "rdr module": rdr("module"),
            "rdr module, Python handlers": rdr("module", pure_python=True),
            "rdr module, no phases": rdr_module_without(phases=True, memory=False),
            "rdr module, memory every 50 ms": rdr_module_without(phases=False, memory=True),
            "reference: deque subscriber": reference,
            "rdr op, native": rdr("op"), "rdr op, dispatch mode": rdr("op", native=False),
            "OP no-op subscriber": op_noop,
            "torch.profiler": profiler(export=False), "torch.profiler + trace export": profiler(export=True)}


SETTLE = {"mlp": 12, "cnn": 2}  # untimed steps after each switch (≈ 15-25 ms), for every variant


def native_ops_per_step(workload: Workload) -> int:
    """Ops the native observer records in one step (nested ones included)."""
    from recorder import native_ops

    rdr("op")()
    observer = native_ops._attached
    before = observer.recorded()
    workload.step()
    count = observer.recorded() - before
    obs.reset_context()
    return count


def call_cost(call, names: tuple[str, ...], rounds: int, calls: int = 20000) -> dict[str, float]:
    """Microseconds per ``call()`` under each variant (median of rounds alternating the variants)."""
    samples: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(rounds):
        for name in names:
            teardown = VARIANTS[name]()
            try:
                for _ in range(calls // 10):
                    call()
                t0 = time.perf_counter_ns()
                for _ in range(calls):
                    call()
                samples[name].append((time.perf_counter_ns() - t0) / calls / 1e3)
            finally:
                teardown()
    return {name: statistics.median(values) for name, values in samples.items()}


def op_record_cost(rounds: int) -> dict[str, float]:
    """One ``torch.add`` of two 8-element tensors outside any module: the cost of an op record alone."""
    x, y = torch.randn(8), torch.randn(8)
    return call_cost(lambda: torch.add(x, y), ("plain", "rdr module", "rdr op, native", "rdr op, dispatch mode",
                                               "torch.profiler"), rounds)


def module_record_cost(rounds: int) -> dict[str, float]:
    """One call of an ``nn.Identity`` inside a ``Sequential`` of ten, per module call: the module wrapper and
    its enter/exit records."""
    net, x = torch.nn.Sequential(*[torch.nn.Identity() for _ in range(10)]), torch.ones(1)
    costs = call_cost(lambda: net(x), ("plain", "rdr module", "rdr module, Python handlers",
                                       "reference: deque subscriber"), rounds, calls=5000)
    return {name: us / 11 for name, us in costs.items()}


def child(rounds: int, only: list[str] | None = None, steps_only: bool = False) -> dict[str, object]:
    pin_to_one_core()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    out: dict[str, object] = {}
    for workload in (mlp(), cnn()):
        # A recorder started by set_context runs its first ~10 MLP steps slower (cold caches, first ring pages,
        # the model's scope names): paid once by a real job, but every round here starts one.
        variants = {name: VARIANTS[name] for name in (only or VARIANTS)}
        per_round = measure_rounds(workload, variants, rounds, settle=SETTLE[workload.name])
        out[workload.name] = {name: statistics.median(values) for name, values in per_round.items()}
        out[f"{workload.name} paired"] = paired_ratios(per_round, "plain")
        out[f"{workload.name} ops"] = {"dispatch": ops_per_step(workload), "native": native_ops_per_step(workload)}
    if steps_only:  # ab.py: the training steps alone
        return out
    out["op record"] = op_record_cost(max(3, rounds // 2))
    out["module record"] = module_record_cost(max(3, rounds // 2))
    out["dump"] = dump_full_rings(5)
    return out


COUNTED = ("plain", "rdr step", "rdr module", "rdr op, native", "torch.profiler")  #: --instructions' default variants
COUNTED_STEPS = {"mlp": 20, "cnn": 3}  #: a CNN step: ~10x an MLP step's instructions, ~20 s under callgrind


def count_child(workload_name: str, only: list[str]) -> None:
    """Under callgrind (``--instructions``): each variant's counted steps on one workload, after untimed ones."""
    from _instructions import count_child as count

    torch.manual_seed(0)
    workload = {"mlp": mlp, "cnn": cnn}[workload_name]()
    count(workload.step, {name: VARIANTS[name] for name in only}, SETTLE[workload_name], COUNTED_STEPS[workload_name],
          TMP)


def instructions(only: list[str], out: str) -> None:
    """Instructions per step of each variant on both workloads (every thread), and the ratio to plain."""
    from recorder import native_ops

    from _instructions import per_step, write_table

    print(f"native op observer: {_build_op_observer(native_ops)}", file=sys.stderr)
    table = per_step(os.path.abspath(__file__), ["--variants", "|".join(only)], COUNTED_STEPS)
    write_table("bench_rdr", table, COUNTED_STEPS, out)


def _build_op_observer(native_ops) -> str:
    """Build the native op observer before timing; a tree from before ``obs native`` (ab.py's base) has ``build()``."""
    return getattr(native_ops, "EXTENSION", native_ops).build()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--out", default="bench-rdr.json")
    parser.add_argument("--default-malloc", action="store_true",
                        help="leave glibc malloc's defaults (noisier: see _harness.STEADY_MALLOC)")
    parser.add_argument("--variants", default="", metavar="NAME|...",
                        help="time only these variants (plain always), e.g. 'rdr step|rdr module': a variant "
                             "whose rounds leave state behind (torch.profiler, op observers) then cannot bias them")
    parser.add_argument("--instructions", action="store_true",
                        help=f"count instructions per step under callgrind instead (needs valgrind; variants: "
                             f"--variants, else {'|'.join(COUNTED)})")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--steps-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--count-child", choices=("mlp", "cnn"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    only = ["plain"] + [v for v in args.variants.split("|") if v and v != "plain"] if args.variants else None
    if only and (unknown := [v for v in only if v not in VARIANTS]):
        parser.error(f"--variants: unknown {unknown}; expected some of {list(VARIANTS)}")
    if args.count_child:
        count_child(args.count_child, only or list(COUNTED))
    if args.instructions:
        instructions(only or list(COUNTED), args.out)
        return
    if args.child:
        print(json.dumps(child(args.rounds, only, args.steps_only)))
        return
    from recorder import native_ops

    print(f"native op observer: {_build_op_observer(native_ops)}", file=sys.stderr)  # built once, before timing
    runs = in_processes(__file__, ["--rounds", str(args.rounds), "--variants", args.variants], args.processes,
                        env=None if args.default_malloc else STEADY_MALLOC)
    steps = [{w: run[w] for w in ("mlp", "cnn")} for run in runs]
    ratios = median_ratios(steps, "plain")
    paired = {w: {v: statistics.median(run[f"{w} paired"][v] for run in runs) for v in runs[0][w]} for w in steps[0]}
    # What one op record costs: a torch.add loop with op recording over the same loop at module granularity.
    per_op = {v: statistics.median(run["op record"][v] - run["op record"]["rdr module"] for run in runs)
              for v in ("rdr op, native", "rdr op, dispatch mode", "torch.profiler")}
    add_us = statistics.median(run["op record"]["plain"] for run in runs)
    per_module = {v: statistics.median(run["module record"][v] - run["module record"]["plain"] for run in runs)
                  for v in ("rdr module", "rdr module, Python handlers", "reference: deque subscriber")}
    dump = {k: statistics.median(run["dump"][k] for run in runs) for k in ("events", "median_ms", "max_ms")}
    print(f"{'variant':<34} {'mlp':>7} {'cnn':>7} {'paired mlp':>11} {'paired cnn':>11}   (median ratio to plain "
          f"over {args.processes} processes; paired: of per-round ratios)")
    for v in ratios["mlp"]:
        print(f"{v:<34} {ratios['mlp'][v]:>7.3f} {ratios['cnn'][v]:>7.3f} {paired['mlp'][v]:>11.3f} "
              f"{paired['cnn'][v]:>11.3f}")
    print(f"one op record (torch.add of 8 floats, {add_us:.2f} us plain): native +{per_op['rdr op, native']:.3f} us "
          f"(target <= 1), dispatch mode +{per_op['rdr op, dispatch mode']:.3f} us, torch.profiler "
          f"+{per_op['torch.profiler']:.3f} us; ops per step native/dispatch: mlp {runs[0]['mlp ops']}, "
          f"cnn {runs[0]['cnn ops']}")
    print("one module call: " + ", ".join(f"{v} +{us:.3f} us" for v, us in per_module.items()))
    print(f"dump of full default rings ({dump['events']} events): median {dump['median_ms']} ms (target <= 250)")
    data = {"benchmark": "bench_rdr", "torch": torch.__version__, "python": platform.python_version(),
            "processes": args.processes, "rounds": args.rounds, "ratios": ratios, "paired_ratios": paired,
            "malloc": "glibc defaults" if args.default_malloc else STEADY_MALLOC,
            "us_per_op_record": per_op, "us_per_add_plain": add_us, "us_per_module_call": per_module,
            "ops_per_step": {w: runs[0][f"{w} ops"] for w in ("mlp", "cnn")},
            "dump_full_rings": dump, "per_process": runs,
            "targets": {"rdr module": {"mlp": "<= 1.03", "cnn": "<= 1.01"},
                        "rdr op, native": "below torch.profiler; aim <= 1.15 / <= 1.03", "us_per_op": "<= 1",
                        "dump_ms": "<= 250"}}
    with open(args.out, "w") as fh:
        json.dump(data, fh, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
