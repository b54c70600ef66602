"""Assemble a bundle's manifest and files from a ring's contents (shared by live dumps and recover)."""

from __future__ import annotations

import json
import socket
import time
from typing import Any

from obs._core.safe_files import safe_name
from recorder import collective_table, device_faults, monitor_part
from recorder.bundle import SCHEMA_VERSION
from recorder.layout import Kind
from recorder.ring_reader import RingContents
from recorder.stacks import exception_record, stacks_text

__all__ = ["bundle_parts"]


def bundle_parts(contents: RingContents, reason: str, *, error: BaseException | None = None,
                 fault: dict[str, Any] | None = None, fatal_stacks: str | None = None,
                 threads: list[dict[str, Any]] | None = None, graphs: list[tuple[str, str]] | None = None,
                 settings: dict[str, Any] | None = None,
                 recovered: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """The manifest and files of a bundle from a ring's contents and what the live process adds."""
    summary = contents.summary()
    files: dict[str, Any] = {
        "events.jsonl": contents.event_lines(),
        "memory.jsonl": contents.event_lines((Kind.MEMORY, Kind.MEMORY_PEAK)),
        "collectives.jsonl": contents.event_lines((Kind.COLLECTIVE,)),
        collective_table.FILE: collective_table.CollectiveTable.from_contents(contents).encode(),  # read by analyze
        # what `obs rdr analyze` reads besides the collectives, without parsing every event
        "steps.jsonl": contents.event_lines((Kind.STEP_BEGIN, Kind.STEP_END, Kind.PHASE)),
        "faults.jsonl": contents.event_lines((Kind.FAULT,)),
    }
    if threads:
        files["stacks.json"] = _json(threads)
        files["stacks.txt"] = stacks_text(threads)
    if fatal_stacks:
        files["fatal_stacks.txt"] = fatal_stacks
    exc = exception_record(error) if error is not None else None
    if exc is not None:
        files["exception.json"] = _json(exc)
        files["exception.txt"] = exc["traceback"]
    device_fault, device_files = device_faults.bundle_part(contents, error=error, exception=exc, fault=fault,
                                                           live=not recovered)
    files.update(device_files)
    monitor = monitor_part.from_contents(contents.strings, contents.side, contents.dropped)
    if monitor is not None:  # the training-health monitor's last steps and anomalies
        files[monitor_part.FILE] = monitor_part.encode(monitor)
    for i, (name, graph_text) in enumerate(graphs or ()):
        files[f"graphs/{i:02d}_{safe_name(name)}.ir"] = graph_text
    meta = contents.header.meta

    def text(key: str) -> str | None:  # a recovered ring's header may be damaged: keep the manifest readable
        value = meta.get(key)
        return value if isinstance(value, str) else None

    versions = meta.get("versions")
    manifest = {
        "schema_version": SCHEMA_VERSION, "reason": reason, "created_ns": time.time_ns(),
        "host": text("host") or socket.gethostname(), "pid": contents.header.pid, "rank": contents.header.rank,
        "world_size": contents.header.world_size, "run_id": _agreed_run_id(contents) or text("run_id"),
        "step": summary["step"],
        "granularity": text("granularity"), "versions": versions if isinstance(versions, dict) else {},
        "settings": settings or {},
        "dropped": contents.dropped, "recorded": {"events": len(contents.slots) + len(contents.blobs)},
        "last_module": summary["last_module"], "open_modules": summary["open_modules"],
        "last_op": summary["last_op"], "fault": fault, "recovered": recovered,
        "exception": {k: exc[k] for k in ("type", "message", "where", "raised_in")} if exc else None,
        "device_fault": device_fault,
        "monitor": None if monitor is None else {
            "steps": [monitor.steps[0], monitor.steps[-1]] if monitor.steps else None,
            "series": len(monitor.series), "anomalies": len(monitor.anomalies)},
    }
    return manifest, files


def _agreed_run_id(contents: RingContents) -> str | None:
    """The job's run id the ranks agreed on after the ring was made (a ``run_id`` marker), if any."""
    for _seq, _t, kind, payload in reversed(contents.blobs):
        if kind == "marker" and payload.get("marker") == "run_id" and isinstance(payload.get("run_id"), str):
            return str(payload["run_id"])
    return None


def _json(data: Any) -> str:
    return json.dumps(data, indent=2, default=str)
