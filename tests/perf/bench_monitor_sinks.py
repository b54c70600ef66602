"""Cost of the monitor's outputs besides CSV, on its worker thread (``obs-monitor``): CPU per step of each sink.

Run: python tests/perf/bench_monitor_sinks.py [--params 148] [--steps 400] [--out bench-monitor-sinks.json]
One judged step of a model of ``--params`` parameters (148: GPT-2 124M's count) as the sinks get it: a
:class:`StepValues` of each parameter's gradient norm, update norm and update ratio and the global gradient norm.
Each sink is called on it ``--steps`` times, the median of the process CPU time per call reported (the worker holds
the GIL meanwhile: on one core it is the training thread's time).  Sinks: the metrics sink with the profiler's
metrics off (the default) and on (writing into a stand-in for the profiler's ring), the TensorBoard sink (an event
file in a temporary folder) with tensorboardX's pure-Python CRC and, where the ``crc32c`` package is installed, with
its native one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from obs.features.monitor.metrics import MetricsSink
from obs.features.monitor.writer import StepValues
from obs.features.profiling import scalars


def step_values(params: int, step: int) -> StepValues:
    values: list[tuple[str, str, int | None, str, float]] = []
    for prefix, stat, scale in (("grad_reduced", "norm", 1.0), ("param_update", "norm", 0.01),
                                ("update_ratio", "ratio", 0.001)):
        values += [(prefix, f"h.{i // 12}.mlp.c_fc.weight{i}", None, stat, scale * (1 + (i + step) % 7 / 100))
                   for i in range(params)]
    values.append(("scalars", "grad_norm", None, "value", 1.5))
    return StepValues(step, values, [])


def median_us(sink: Any, params: int, steps: int) -> float:
    packets = [step_values(params, s) for s in range(steps)]
    times = []
    for packet in packets:
        start = time.process_time()
        sink(packet)
        times.append(time.process_time() - start)
    return statistics.median(times[steps // 10:]) * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=148)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--out", default="bench-monitor-sinks.json")
    args = parser.parse_args()
    results: dict[str, float | None] = {}
    results["metrics, profiler's metrics off"] = median_us(MetricsSink(), args.params, args.steps)
    ring = SimpleNamespace(write=lambda name, value: None)  # the ring write itself: bench_scalar.py's figures
    scalars.attach(ring)  # type: ignore[arg-type]
    try:
        results["metrics, profiler's metrics on"] = median_us(MetricsSink(), args.params, args.steps)
    finally:
        scalars.detach(ring)  # type: ignore[arg-type]
    try:
        import tensorboardX.record_writer as record_writer
        from tensorboardX import crc32c as tbx_crc

        from obs.features.monitor.tensorboard import TensorBoardSink
    except ImportError:
        print("tensorboardX not installed: the TensorBoard sink is not measured")
    else:
        native = tbx_crc._crc32c_native
        for label, crc in (("pure-Python CRC", tbx_crc._crc32c), ("native crc32c", native)):
            if crc is None:
                results[f"tensorboard, {label}"] = None
                continue
            saved, record_writer.crc32c = record_writer.crc32c, crc  # the CRC the record writer frames with
            folder = tempfile.mkdtemp(prefix="obs-bench-tb-")
            try:
                sink = TensorBoardSink(folder, rank=0, world_size=1)
                results[f"tensorboard, {label}"] = median_us(sink, args.params, args.steps)
                sink.close()
            finally:
                record_writer.crc32c = saved
                shutil.rmtree(folder, ignore_errors=True)
    values = 3 * args.params + 1
    print(f"monitor sinks on the worker thread: CPU per step, {args.params} parameters ({values} values)")
    for name, us in results.items():
        print(f"  {name:<36} " + ("not installed" if us is None else f"{us:9.1f} us  ({us / values:.2f} us/value)"))
    with open(args.out, "w") as fh:
        json.dump({"benchmark": "monitor sinks", "params": args.params, "values": values, "us_per_step": results},
                  fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
