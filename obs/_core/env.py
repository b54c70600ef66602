"""Every environment variable obs reads or sets, named once, and one parser per type.

The names below are the only place a variable's name is written (docs/environment.md lists them).
Variables that belong to another project keep their owner's name: MindSpore's ``MS_*`` and
``MINDSPORE_DUMP_CONFIG``, OpenTelemetry's ``OTEL_*``, torchrun's ``RANK``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["flag", "integer", "switched_off", "text"]

# obs's own
OBS_CONFIG = "OBS_CONFIG"  #: env config file (as set_context's env_config_path), read by ``obs run``
OBS_DUMP_CONFIG = "OBS_DUMP_CONFIG"  #: the data dump's JSON, when MINDSPORE_DUMP_CONFIG is not set
OBS_PRINT_FILE = "OBS_PRINT_FILE"  #: set by obs: the print file a child process inherits
OBS_PRINT_PID = "OBS_PRINT_PID"  #: set by obs: the process that opened that print file
OBS_RUN_SCRIPT = "OBS_RUN_SCRIPT"  #: set by ``obs run``: its script; a child that runs it again runs under obs
OBS_RUN_SETTINGS = "OBS_RUN_SETTINGS"  #: set by ``obs run``: its --config and --set pairs (JSON), for that child
OBS_RAISE_INTERNAL_ERRORS = "OBS_RAISE_INTERNAL_ERRORS"  #: 1: obs's own bugs raise (tests) instead of being counted
OBS_NATIVE = "OBS_NATIVE"  #: 0: every native extension off (each part's Python path)
OBS_NATIVE_PREFIX = "OBS_NATIVE_"  #: OBS_NATIVE_<PART>=0: one part's native extension off
OBS_NATIVE_CACHE = "OBS_NATIVE_CACHE"  #: where extensions built on first use are kept
XDG_CACHE_HOME = "XDG_CACHE_HOME"
PYTHONPATH = "PYTHONPATH"  #: ``obs run`` puts the folder of its ``sitecustomize`` first (see OBS_RUN_SCRIPT)

# MindSpore's
MS_RDR_ENABLE = "MS_RDR_ENABLE"
MS_RDR_MODE = "MS_RDR_MODE"
MS_RDR_PATH = "MS_RDR_PATH"
MS_DEV_SAVE_GRAPHS = "MS_DEV_SAVE_GRAPHS"
MS_DEV_SAVE_GRAPHS_PATH = "MS_DEV_SAVE_GRAPHS_PATH"
MS_DIAGNOSTIC_DATA_PATH = "MS_DIAGNOSTIC_DATA_PATH"
MINDSPORE_DUMP_CONFIG = "MINDSPORE_DUMP_CONFIG"

# msprobe's
MONITOR_OUTPUT_DIR = "MONITOR_OUTPUT_DIR"  #: the training-health monitor's output folder (over monitor.path)

# torchrun's and torch's
RANK = "RANK"
WORLD_SIZE = "WORLD_SIZE"
TORCHELASTIC_RUN_ID = "TORCHELASTIC_RUN_ID"
LOCAL_RANK = "LOCAL_RANK"  #: torchrun's rank on this node: the profiler's Prometheus port is its base plus this

# SLURM's
SLURM_JOB_ID = "SLURM_JOB_ID"  #: the job id of the profiler's metrics resource, where present

# OpenTelemetry's (the SDK's names)
OTEL_SDK_DISABLED = "OTEL_SDK_DISABLED"
OTEL_SERVICE_NAME = "OTEL_SERVICE_NAME"
OTEL_EXPORTER_OTLP_ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
OTEL_EXPORTER_OTLP_PROTOCOL = "OTEL_EXPORTER_OTLP_PROTOCOL"
OTEL_EXPORTER_OTLP_TRACES_PROTOCOL = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
OTEL_EXPORTER_OTLP_METRICS_ENDPOINT = "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"
OTEL_EXPORTER_OTLP_METRICS_PROTOCOL = "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL"
OTEL_METRICS_EXPORTER = "OTEL_METRICS_EXPORTER"  #: otlp, prometheus, none, or a comma-separated list
OTEL_EXPORTER_PROMETHEUS_HOST = "OTEL_EXPORTER_PROMETHEUS_HOST"  #: default localhost
OTEL_EXPORTER_PROMETHEUS_PORT = "OTEL_EXPORTER_PROMETHEUS_PORT"  #: default 9464

_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")


def text(name: str, default: str = "", environ: Mapping[str, str] | None = None) -> str:
    """The variable's value, or ``default`` when it is unset or empty."""
    return (os.environ if environ is None else environ).get(name) or default


def flag(name: str, default: bool = False, environ: Mapping[str, str] | None = None) -> bool:
    """A boolean variable: ``1/true/on/yes`` or ``0/false/off/no`` (any case); unset, empty or other: ``default``."""
    raw = text(name, environ=environ).strip().lower()
    return True if raw in _TRUE else False if raw in _FALSE else default


def switched_off(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether a switch that is on by default is set to ``0/false/off/no``."""
    return not flag(name, True, environ)


def integer(name: str, default: int, environ: Mapping[str, str] | None = None) -> int:
    """An integer variable; unset or empty: ``default``; raises ValueError naming the variable otherwise."""
    raw = text(name, environ=environ).strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer (got {raw!r})") from None
