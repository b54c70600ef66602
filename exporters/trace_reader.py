"""Readers of the profiler's files: ``traces.otlp.jsonl``, ``trace.json`` and an output folder → spans.

Pure: files in, :class:`TraceFile` dataclasses out.  A damaged file ends in :class:`DamagedFileError`
naming the file and the byte offset; a file that is not one of ours in :class:`NotOurFileError`.
``trace.json`` may lack its closing ``]`` (the exporter was killed): that is accepted, as the viewers do.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from exporters.local_files import ORIGIN_EVENT
from exporters.spans import Span
from obs._core import safe_files
from obs._core.errors import DamagedFileError, NotOurFileError
from obs._core.json_files import read_json
from obs._core.rank_folders import folder_rank, unresolved

__all__ = ["TraceFile", "TraceFolder", "iter_otlp_requests", "read_chrome_trace", "read_folder", "read_otlp_jsonl",
           "folder_files", "read_path", "read_status", "request_spans"]

_KINDS = {"step", "phase", "module", "op"}
_MAX_FILE = 1 << 31
_MAX_US = 1 << 53  # a time beyond this (285 years) is damage


@dataclass
class TraceFile:
    path: str
    format: str  #: "otlp-jsonl" or "chrome"
    spans: list[Span]
    dropped: int = 0  #: the drop counter's last value (chrome), or the sum of the steps' ``obs.dropped`` (otlp)
    resource: dict[str, Any] = field(default_factory=dict)


@dataclass
class TraceFolder:
    path: str
    files: list[TraceFile]
    statuses: list[dict[str, Any]]  #: the exporters' status files (drops, endpoint, counts)


def _read(path: str) -> bytes:
    data = safe_files.read_private(path, limit=_MAX_FILE)
    if not data.strip():
        raise NotOurFileError(f"{path}: empty file, not a trace file", path=path)
    return data


def _value(v: dict[str, Any]) -> Any:
    """An OTLP JSON AnyValue → Python."""
    if not isinstance(v, dict) or len(v) != 1:
        raise ValueError(f"not an OTLP attribute value: {v!r}"[:120])
    (key, inner), = v.items()
    if key == "intValue":
        return int(inner)
    if key == "doubleValue":
        return float(inner)
    if key in ("stringValue", "boolValue"):
        return inner
    if key == "arrayValue":
        return [_value(x) for x in inner.get("values", [])]
    raise ValueError(f"unsupported OTLP attribute value {key!r}")


def _id(text: Any, bits: int) -> int:
    if not isinstance(text, str):
        raise ValueError(f"span id {text!r} is not a string")
    if re.fullmatch(r"[0-9a-fA-F]*", text) and len(text) == bits // 4:
        return int(text, 16)
    import base64
    import binascii

    try:
        raw = base64.b64decode(text, validate=True)
    except binascii.Error:
        raise ValueError(f"id {text!r} is neither hex nor base64") from None
    if len(raw) != bits // 8:
        raise ValueError(f"id {text!r} is not {bits} bits")
    return int.from_bytes(raw, "big")


def _kind(name: str, attrs: dict[str, Any]) -> str:
    if name == "step" and "ml.step" in attrs:
        return "step"
    if "ml.phase" in attrs:
        return "phase"
    if "ml.op.name" in attrs:
        return "op"
    return "module" if "ml.module.scope" in attrs else "other"


def iter_otlp_requests(path: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(byte offset, request) for each line of an OTLP JSON lines file."""
    data = _read(path)
    at = 0
    for line in data.splitlines(keepends=True):
        if line.strip():
            try:
                request = json.loads(line)
            except (ValueError, RecursionError) as exc:
                if at == 0:
                    raise NotOurFileError(f"{path}: not an OTLP JSON lines file (line 1 is not JSON)", path=path) \
                        from None
                raise DamagedFileError(f"{path}: damaged OTLP JSON line at byte {at}: {str(exc)[:80]}", path=path,
                                       offset=at) from None
            if not isinstance(request, dict) or "resourceSpans" not in request:
                if at == 0:
                    raise NotOurFileError(f"{path}: not an OTLP JSON lines file (no resourceSpans on line 1)",
                                          path=path)
                raise DamagedFileError(f"{path}: line at byte {at} is not an OTLP export request", path=path,
                                       offset=at)
            yield at, request
        at += len(line)


def request_spans(request: dict[str, Any]) -> tuple[list[Span], dict[str, Any]]:
    """The spans of one OTLP JSON export request and its (last) resource's attributes; ValueError, KeyError,
    TypeError or AttributeError when it is malformed."""
    spans: list[Span] = []
    resource: dict[str, Any] = {}
    for rs in request["resourceSpans"]:
        resource = {a["key"]: _value(a["value"]) for a in rs.get("resource", {}).get("attributes", [])}
        for ss in rs.get("scopeSpans", []):
            for s in ss.get("spans", []):
                attrs = {a["key"]: _value(a["value"]) for a in s.get("attributes", [])}
                spans.append(Span(str(s["name"]), _kind(str(s["name"]), attrs), _id(s["traceId"], 128),
                                  _id(s["spanId"], 64), _id(s["parentSpanId"], 64) if s.get("parentSpanId") else 0,
                                  int(s["startTimeUnixNano"]), int(s["endTimeUnixNano"]), attrs,
                                  (s.get("status") or {}).get("code") in (2, "STATUS_CODE_ERROR")))
    return spans, resource


def read_otlp_jsonl(path: str) -> TraceFile:
    spans: list[Span] = []
    resource: dict[str, Any] = {}
    for at, request in iter_otlp_requests(path):
        try:
            part, resource = request_spans(request)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise DamagedFileError(f"{path}: damaged OTLP export request at byte {at}: {type(exc).__name__}: "
                                   f"{str(exc)[:80]}", path=path, offset=at) from None
        spans.extend(part)
    dropped = sum(int(s.attributes.get("obs.dropped", 0) or 0) for s in spans if s.kind == "step")
    return TraceFile(path, "otlp-jsonl", spans, dropped, resource)


def _ns(us: Any) -> int:
    """A ``ts`` / ``dur`` in µs (read as a Decimal: exact) → ns."""
    if isinstance(us, bool) or not isinstance(us, (int, Decimal)):
        raise TypeError(f"a time is not a number: {us!r}"[:80])
    if not -_MAX_US < us < _MAX_US:  # so that no int of a million digits is ever built
        raise ValueError(f"a time out of range: {us!r}"[:80])
    return us * 1000 if isinstance(us, int) else int((us * 1000).to_integral_value())


def _whole(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"not an integer: {value!r}"[:80])
    return value


def _float(value: Any) -> Any:
    return float(value) if isinstance(value, Decimal) else value


def _attributes(args: Any) -> dict[str, Any]:
    """An event's ``args`` as the writer had them (scalars, arrays of scalars): the Decimals read back to floats."""
    return {k: [_float(x) for x in v] if isinstance(v, list) else _float(v) for k, v in dict(args or {}).items()}


def read_chrome_trace(path: str) -> TraceFile:
    """A ``trace.json``; ``ts`` counts from the file's ``obs.trace_start`` event, or, in a file written before
    there was one, from the epoch."""
    data = _read(path)
    text = data.decode("utf-8", "replace").rstrip()
    if not text.startswith(("[", "{")):
        raise NotOurFileError(f"{path}: not a Chrome trace (it must start with '[' or '{{')", path=path)
    try:
        doc = json.loads(text, parse_float=Decimal)
    except (ValueError, RecursionError):
        try:  # the array form may lack its closing bracket (a writer that was killed)
            doc = json.loads(text.rstrip(",") + "]", parse_float=Decimal) if text.startswith("[") else None
        except (ValueError, RecursionError) as exc:
            offset = getattr(exc, "pos", len(data))
            raise DamagedFileError(f"{path}: damaged Chrome trace at byte {offset}: {str(exc)[:80]}", path=path,
                                   offset=offset) from None
    events = doc.get("traceEvents") if isinstance(doc, dict) else doc
    if not isinstance(events, list):
        raise NotOurFileError(f"{path}: not a Chrome trace (no event array)", path=path)
    spans, dropped, origin = [], 0, 0  # no origin event: a file written before there was one (epoch µs)
    for i, e in enumerate(events):
        try:
            if not isinstance(e, dict):
                raise TypeError("an event is not an object")
            if e.get("ph") == "M" and e.get("name") == ORIGIN_EVENT:
                origin = _whole(e["args"]["unix_ns"])
            if e.get("ph") == "C" and e.get("name") == "obs.dropped_spans":
                dropped = max(dropped, _whole(e["args"]["dropped"]))
            if e.get("ph") != "X" or e.get("cat") not in _KINDS:
                continue
            args = _attributes(e.get("args"))
            ids = (args.pop("trace_id"), args.pop("span_id"), args.pop("parent_span_id", ""))
            error = bool(args.pop("error", False))
            start = origin + _ns(e["ts"])
            spans.append(Span(str(e["name"]), e["cat"], int(ids[0], 16), int(ids[1], 16),
                              int(ids[2], 16) if ids[2] else 0, start, start + _ns(e["dur"]), args, error))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise DamagedFileError(f"{path}: damaged trace event #{i}: {type(exc).__name__}: {str(exc)[:80]}",
                                   path=path, offset=0) from None
    return TraceFile(path, "chrome", spans, dropped)


def read_path(path: str) -> TraceFile:
    """A trace file by its content: OTLP JSON lines or a Chrome trace."""
    head = safe_files.read_private(path, limit=64).lstrip()
    if head.startswith(b"[") or (head.startswith(b"{") and b"traceEvents" in head):
        return read_chrome_trace(path)
    return read_otlp_jsonl(path)


def _ordered(folder: str, pattern: str) -> list[str]:
    found = []
    for name in os.listdir(folder):
        m = re.fullmatch(pattern, name)
        if m:
            found.append((int(m.group(1) or 1 << 30), os.path.join(folder, name)))
    return [p for _, p in sorted(found)]


def folder_files(path: str) -> tuple[list[str], list[str]]:
    """(trace files, status files) of an output folder (``obs_profile``) or one rank's folder: per rank, its OTLP
    JSON lines files (or, when there are none, its Chrome traces), rotated ones first."""
    ranks = sorted(os.path.join(path, d) for d in os.listdir(path) if (folder_rank(d) is not None or unresolved(d))
                   and os.path.isdir(os.path.join(path, d))) or [path]
    traces: list[str] = []
    statuses: list[str] = []
    for folder in ranks:
        traces += _ordered(folder, r"traces\.otlp(?:\.(\d+))?\.jsonl") or _ordered(folder, r"trace(?:\.(\d+))?\.json")
        statuses += _ordered(folder, r"status_(\d+)\.json")
    if not traces and not statuses:
        raise NotOurFileError(f"{path}: no trace files (traces.otlp.jsonl, trace.json) or exporter status here",
                              path=path)
    return traces, statuses


def read_status(path: str) -> dict[str, Any]:
    """An exporter's ``status_<pid>.json`` (counts, drops, endpoint, its summary)."""
    status: dict[str, Any] = read_json(path, what="an exporter's status file")
    return status


def read_folder(path: str) -> TraceFolder:
    """Every trace file (see :func:`folder_files`) and status file of a folder, read."""
    traces, statuses = folder_files(path)
    return TraceFolder(path, [read_path(p) for p in traces], [read_status(p) for p in statuses])
