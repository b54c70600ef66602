"""The monitor's collectives (``cc_distribution``): the time of one ``all_reduce`` of 1,024 float32 on a single-rank
gloo group (CPU, one torch thread), without the monitor, with ``cc`` (the post statistics) and with ``cc_pre_hook``
too (``ops: ["norm"]``, ``format: api``); variants alternating, the median of the rounds.

Usage: python tests/perf/bench_monitor_cc.py [--rounds N] [--calls N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

import obs

VARIANTS = {"off": None, "cc": {"enable": True}, "cc + cc_pre_hook": {"enable": True, "cc_pre_hook": True}}


def _per_call_us(tensor: torch.Tensor, calls: int) -> float:
    for _ in range(200):
        dist.all_reduce(tensor)
    start = time.perf_counter_ns()
    for _ in range(calls):
        dist.all_reduce(tensor)
    return (time.perf_counter_ns() - start) / calls / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp()
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
    tensor = torch.randn(1024)
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for n in range(args.rounds):
        for name, cc in VARIANTS.items():
            obs.reset_context()
            if cc is not None:
                path = os.path.join(tmp, f"obs_{n}_{len(times[name])}_{name.replace(' ', '')}.json")
                with open(path, "w") as fh:
                    json.dump({"monitor": {"enable": True, "format": "api", "cc_distribution": cc}}, fh)
                obs.set_context(env_config_path=path)
            times[name].append(_per_call_us(tensor, args.calls))
    obs.reset_context()
    dist.destroy_process_group()
    print(json.dumps({name: round(statistics.median(v), 1) for name, v in times.items()}))


if __name__ == "__main__":
    main()
