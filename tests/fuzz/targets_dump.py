"""Fuzz targets: data dump files (statistic.csv, tensor .npy, the dump config) through the readers and ``obs dump``.

Seeds come from the real writers: a statistic.csv with every statistic category and a tensor file
written by a data dump of a tiny model, dump configs as users write them.
"""

from __future__ import annotations

import json
import os
import tempfile

from obs.settings.dump_config import DumpConfigError
from tests.fuzz import Rejected, Target, cli_exit

_NPY = "Relu.Default_net-Net_Relu-op2.0.0.1795351481336782.output.0.DefaultFormat.Float32.npy"
_cache: dict[str, list[bytes]] = {}


def _real_dump() -> dict[str, list[bytes]]:
    """statistic.csv and .npy files of a real data dump of a tiny model (made once per process)."""
    if _cache:
        return _cache
    import torch

    import obs
    from obs.runtime.steps import tracker

    with tempfile.TemporaryDirectory() as scratch:
        cfg = {"dump": {"common_dump_settings": {
            "dump_mode": 0, "path": os.path.join(scratch, "d"), "net_name": "Net", "iteration": "all",
            "saved_data": "full", "input_output": 0, "kernels": [], "support_device": [0],
            "statistic_category": ["max", "min", "avg", "count", "negative zero count", "positive zero count",
                                   "nan count", "negative inf count", "positive inf count", "zero count", "l2norm",
                                   "md5"]}}}
        path = os.path.join(scratch, "cfg.json")
        with open(path, "w") as fh:
            json.dump(cfg, fh)
        net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
        obs.set_context(env_config_path=path)
        try:
            with obs.step():
                net(torch.tensor([[1.0, float("nan"), -0.0], [2, 3, float("inf")]])).sum()
                net(torch.ones(2, 3, dtype=torch.float64).float().half().float()).sum()
        finally:
            obs.reset_context()
            tracker.reset()
        folder = os.path.join(scratch, "d", "rank_0", "Net", "0", "0")
        names = sorted(os.listdir(folder))
        with open(os.path.join(folder, "statistic.csv"), "rb") as fh:
            _cache["csv"] = [fh.read()]
        _cache["npy"] = []
        for name in [n for n in names if n.endswith(".npy")][:6]:
            with open(os.path.join(folder, name), "rb") as fh:
                _cache["npy"].append(fh.read())
    return _cache


def _csv_seeds(scratch: str) -> list[bytes]:
    real = _real_dump()["csv"][0]
    return [real, real.split(b"\n", 1)[0] + b"\n", b"Op Type,Op Name\n"]


def _npy_seeds(scratch: str) -> list[bytes]:
    return _real_dump()["npy"]


def _place_csv(folder: str, data: bytes) -> str:
    step = os.path.join(folder, "rank_0", "Net", "0", "0")
    os.makedirs(step)
    with open(os.path.join(step, "statistic.csv"), "wb") as fh:
        fh.write(data)
    return folder


def _place_npy(folder: str, data: bytes) -> str:
    step = os.path.join(folder, "rank_0", "Net", "0", "0")
    os.makedirs(step)
    with open(os.path.join(step, _NPY), "wb") as fh:
        fh.write(data)
    return folder


def _read_csv(folder: str) -> None:
    from obs.features.dump import DumpReader

    list(DumpReader(folder).statistics())


def _read_npy(folder: str) -> None:
    from obs.features.dump import DumpReader

    for tensor in DumpReader(folder).tensors():
        tensor.load()


def _cli_stats(folder: str) -> None:
    try:
        cli_exit("dump", "stats", folder)
    finally:
        cli_exit("dump", "stats", folder, "--json")


def _cli_diff(folder: str) -> None:
    try:
        cli_exit("dump", "diff", folder, folder)
    except Rejected:
        raise


_CONFIG = {"common_dump_settings": {
    "op_debug_mode": 0, "dump_mode": 1, "path": "/abs/dump", "net_name": "ResNet50", "iteration": "0|5-8|100-120",
    "saved_data": "full", "input_output": 0, "kernels": ["Default/Conv-op12", "relu", "name-regex(Default/.+)"],
    "support_device": [0, 1, 2, 3], "statistic_category": ["max", "min", "l2norm"], "file_format": "npy",
    "initial_iteration": 0}, "e2e_dump_settings": {"enable": True, "trans_flag": True, "stat_calc_mode": "host",
                                                    "sample_mode": 0, "sample_num": 100, "save_kernel_args": False}}


def _config_seeds(scratch: str) -> list[bytes]:
    return [json.dumps(_CONFIG, indent=2).encode(), json.dumps({"common_dump_settings": {}}).encode()]


def _load_config(path: str) -> None:
    from obs.settings.dump_config import load_dump_config

    load_dump_config(path, environ={})


def _cli_config(path: str) -> None:
    cli_exit("config", "check", path)


TARGETS = [
    Target("dump_statistic_csv", _csv_seeds, _read_csv, place=_place_csv),
    Target("dump_npy", _npy_seeds, _read_npy, place=_place_npy),
    Target("dump_cli_stats", _csv_seeds, _cli_stats, place=_place_csv),
    Target("dump_cli_diff", _npy_seeds, _cli_diff, place=_place_npy),
    Target("dump_config", _config_seeds, _load_config, allowed=(DumpConfigError,)),
    Target("dump_config_cli", _config_seeds, _cli_config),
]
