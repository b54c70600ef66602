"""A bundle's monitor part read back as a monitor run, pure: what ``obs monitor explain|show BUNDLE`` and ``obs rdr
show`` read.

An RDR bundle written while the monitor ran holds ``monitor.json`` (:mod:`recorder.monitor_part`): the last
``ring_steps`` steps of every series and the anomalies the worker flagged while the run went on, each judged against
the run's whole history.  :func:`read_bundle_run` turns it into a :class:`~obs.features.monitor.reader.MonitorRun`
whose ``recorded`` holds those anomalies, so that ``explain`` orders them (it does not judge the few steps kept again,
which would lack the history).  The causal order's module and parameter order is the order the worker wrote the
series in (forward calls, then the optimizer's parameters).
"""

from __future__ import annotations

import os
from typing import Any

from obs._core.errors import NotOurFileError
from obs.features.monitor.layout import kind_stage
from obs.features.monitor.reader import MonitorRun, Series
from recorder.monitor_part import FILE, MonitorPart

__all__ = ["is_bundle", "read_bundle_run", "run_of_part"]


def is_bundle(path: str) -> bool:
    """Whether ``path`` is an RDR bundle's folder or its ``monitor.json`` (or an rdr folder's ``latest``)."""
    if os.path.basename(path.rstrip("/")) == "latest" and not os.path.exists(path):
        return os.path.isdir(os.path.dirname(path.rstrip("/")))
    if os.path.basename(path) == FILE and os.path.isfile(path):
        return os.path.isfile(os.path.join(os.path.dirname(path) or ".", "manifest.json"))
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "manifest.json"))


def _order(part: MonitorPart) -> dict[str, list[str]]:
    params: dict[str, None] = {}
    modules: dict[str, None] = {}
    for s in part.series:
        if s.prefix == "actv":
            base, _, side = s.name.rpartition(".")
            modules.setdefault(base if side.split("_")[0] in ("input", "output") else s.name, None)
        elif s.prefix != "scalars":
            params.setdefault(s.name, None)
    for name in params:
        modules.setdefault(name.rpartition(".")[0], None)
    return {"params": list(params), "modules": list(modules)}


def run_of_part(part: MonitorPart, folder: str, rank: int | None, settings: dict[str, Any] | None = None) -> MonitorRun:
    """``part`` as a run: one series per kept series (its steps with a value), ``recorded`` its anomalies."""
    series = []
    for s in part.series:
        kept = [(st, v) for st, v in zip(part.steps, s.values) if v is not None]
        kind, stage = kind_stage(s.prefix, s.name)
        series.append(Series(s.prefix, s.name, s.micro, s.stat, kind, stage, tuple(st for st, _ in kept),
                             tuple(v for _, v in kept)))
    problems = []
    if part.dropped_anomalies:
        problems.append(f"{folder}: the ring held the newest {len(part.anomalies)} anomalies; "
                        f"{part.dropped_anomalies} older ones were overwritten")
    meta: dict[str, Any] = {**_order(part), "settings": settings or {}, "rank": rank}
    return MonitorRun(folder, rank, meta, series, problems, recorded=part.anomalies)


def read_bundle_run(path: str) -> MonitorRun:
    """The monitor run a bundle holds (``path``: the bundle's folder or its ``monitor.json``)."""
    from recorder.bundle_reader import load_bundle

    folder = os.path.dirname(path) if os.path.basename(path) == FILE else path
    bundle = load_bundle(folder)
    if bundle.monitor is None:
        raise NotOurFileError(f"{folder}: this RDR bundle holds no monitor data (the monitor was off, or the "
                              "recorder ran without its region)", path=folder)
    env_config = (bundle.manifest.get("settings") or {}).get("env_config")
    section = env_config.get("monitor") if isinstance(env_config, dict) else None
    settings = {k: section[k] for k in ("window", "warmup", "threshold", "alert") if k in section} \
        if isinstance(section, dict) else {}
    return run_of_part(bundle.monitor, bundle.info.path, bundle.info.rank, settings)
