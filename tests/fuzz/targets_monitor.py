"""Fuzz targets: the training-health monitor's run folders (CSV files, monitor.json) through the reader, explain and
show, and msprobe's monitor config file through its loader."""

from __future__ import annotations

import json
import os

from obs._core.errors import ObsConfigError
from tests.fuzz import Target, _write

_HEADER = "vpp_stage,name,step,norm,max,shape,dtype\n"


def _csv_seeds(scratch: str) -> list[bytes]:
    rows = "".join(f"0,h.{s % 3}.mlp.c_fc.weight,{s},{1.0 + 0.01 * (s % 5)},{0.5 if s != 30 else 9.0},\"[4, 4]\","
                   f"torch.float32\n" for s in range(40))
    actv = "vpp_stage,name,step,micro_step,norm,shape,dtype\n" + "".join(
        f"0,fc.input,{s},0,{2.0 + s % 2},\"[2, 4]\",torch.bfloat16\n" for s in range(30))
    return [(_HEADER + rows).encode(), actv.encode(), b"vpp_stage,name,step,value\n0,loss,0,nan\n0,loss,1,inf\n"]


def _place_csv(folder: str, data: bytes) -> str:
    run = os.path.join(folder, "Nov29_10-00-00-rank0-0a1b2c3d")
    os.makedirs(run, exist_ok=True)
    name = "actv_0-99.csv" if b"micro_step" in data[:60] else "grad_reduced_0-99.csv"
    _write(os.path.join(run, name), data)
    _write(os.path.join(run, "monitor.json"), json.dumps({"schema_version": 1, "format": "obs-monitor", "rank": 0,
                                                          "modules": ["h.0.mlp.c_fc"], "params": []}).encode())
    return folder


def _meta_seeds(scratch: str) -> list[bytes]:
    return [json.dumps({"schema_version": 1, "format": "obs-monitor", "rank": 0, "settings": {
        "window": 10, "warmup": 2, "threshold": 5.0, "alert": {"rules": [{"rule_name": "AnomalyTurbulence",
                                                                          "args": {"threshold": 0.5}}]}},
        "modules": ["fc"], "params": ["fc.weight"]}).encode()]


def _place_meta(folder: str, data: bytes) -> str:
    run = os.path.join(folder, "Nov29_10-00-00-rank0-0a1b2c3d")
    os.makedirs(run, exist_ok=True)
    _write(os.path.join(run, "grad_reduced_0-9.csv"), (_HEADER + "".join(
        f"0,fc.weight,{s},{1 + s % 2},1,[],x\n" for s in range(10))).encode())
    _write(os.path.join(run, "monitor.json"), data)
    return folder


def _explain(path: str) -> None:
    from obs.features.monitor.explain import explain, movers
    from obs.features.monitor.reader import find_run, read_run

    run = read_run(find_run(path)[0])
    explain(run)
    movers(run)


def _job(path: str) -> None:
    """The root's job (obs.features.monitor.job): which runs, their step times, the merged explanation."""
    from obs.features.monitor.job import explain_job, find_job, read_job

    job = find_job(path)
    explain_job(job, read_job(job)).as_dict()


def _explain_job(path: str) -> None:
    _explain(path)
    _job(path)


def _times_seeds(scratch: str) -> list[bytes]:
    return [("step,time_ns\n" + "".join(f"{s},{1_800_000_000_000_000_000 + s * 7_000_000}\n" for s in range(10)))
            .encode()]


def _place_times(folder: str, data: bytes) -> str:
    """Two ranks' runs on two hosts; rank 1's step_times.csv is the input."""
    for rank in (0, 1):
        run = os.path.join(folder, f"Nov29_10-00-00-rank{rank}-0a1b2c3{rank}")
        os.makedirs(run, exist_ok=True)
        _write(os.path.join(run, "grad_reduced_0-9.csv"), (_HEADER + "".join(
            f"0,fc.weight,{s},{1 + s % 2 + 50 * (s == 5)},1,[],x\n" for s in range(6))).encode())  # one spike
        _write(os.path.join(run, "monitor.json"), json.dumps({
            "schema_version": 1, "format": "obs-monitor", "rank": rank, "world_size": 2, "host": f"h{rank}",
            "started": 1.8e9, "settings": {"window": 10, "warmup": 2}}).encode())
        times = "step,time_ns\n" + "".join(f"{s},{1_800_000_000_000_000_000 + s * 7_000_000}\n" for s in range(10))
        _write(os.path.join(run, "step_times.csv"), data if rank else times.encode())
    return folder


def _msprobe_seeds(scratch: str) -> list[bytes]:
    from tests.obs.settings.test_monitor_options import MSPROBE_EXAMPLE

    return [json.dumps(MSPROBE_EXAMPLE, indent=2).encode(), b'{"ops": ["norm"], "targets": {"": {}}}']


def _msprobe(path: str) -> None:
    from obs.settings.monitor_options import load_msprobe_config

    load_msprobe_config(path)


TARGETS = [
    Target("monitor_csv", _csv_seeds, _explain, place=_place_csv),
    Target("monitor_meta", _meta_seeds, _explain_job, place=_place_meta),
    Target("monitor_step_times", _times_seeds, _job, place=_place_times),
    Target("monitor_msprobe_config", _msprobe_seeds, _msprobe, allowed=(ObsConfigError,)),
]
