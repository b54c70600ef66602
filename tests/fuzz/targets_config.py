"""Fuzz targets: env config files, through ``load_file`` and through ``obs config check``."""

from __future__ import annotations

import json

from obs._core.errors import ObsConfigError
from tests.fuzz import Target, cli_exit

_SEEDS = [
    {"rdr": {"enable": True, "mode": 2, "path": "/abs/rdr", "granularity": "op", "hang_action": "abort",
             "capacity": {"op": 4096, "module": 1024}}, "sys": {"mem_reuse": False}},
    {"rdr": {"enable": False}},
    {"sys": {"mem_Reuse": True}},
    {},
]


def _seeds(scratch: str) -> list[bytes]:
    out = [json.dumps(seed, indent=2).encode() for seed in _SEEDS]
    out.append(b'{"rdr": {"enable": true, "enable": false}}')
    out.append(b"[" * 5000 + b"]" * 5000)
    return out


def _load(path: str) -> None:
    from obs.settings.env_config_file import load_file

    load_file(path)


def _cli(path: str) -> None:
    try:
        cli_exit("config", "check", path)
    finally:
        cli_exit("config", "check", path, "--json")


TARGETS = [
    Target("config_load_file", _seeds, _load, allowed=(ObsConfigError,)),
    Target("config_cli_check", _seeds, _cli),
]
