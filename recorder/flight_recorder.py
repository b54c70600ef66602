"""PyTorch's Flight Recorder entries → a bundle's collective events, merged beside the ones obs recorded.

PyTorch records every collective its process groups issue, C++-issued ones included (DDP's gradient
buckets, its start-up broadcasts), in one in-process buffer (``torch._C._distributed_c10d._dump_fr_trace``,
read by :mod:`obs.runtime.torch._flight_recorder`).  At dump time the entries that obs's Python wrappers
did not record are added to ``events.jsonl`` and ``collectives.jsonl`` as ``collective`` events with the
same fields (``desc``, ``group_seq``, ``state``, ``step``, ``duration_ns``) and ``"source": "flight_recorder"``,
so ``obs rdr analyze`` reads them as any other.  Both sources number a group's collectives with the process
group's own sequence number (the Flight Recorder's ``collective_seq_id``): a collective is in the bundle once,
as obs's record where there is one (it knows the step, the duration and a failure), else as the entry.

Pure: dicts and lines in, lines out.
"""

from __future__ import annotations

import json
from typing import Any

from obs._core.json_files import is_int
from recorder import collective_table
from recorder.collective_desc import collective_desc, parse_collective_desc

__all__ = ["collective_error", "entry_record", "merge_entries"]

#: c10's scalar type names (the entries' ``input_dtypes``) → torch's dtype names (obs's records)
_DTYPES = {"Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16", "Long": "int64",
           "Int": "int32", "Short": "int16", "Char": "int8", "Byte": "uint8", "Bool": "bool",
           "ComplexFloat": "complex64", "ComplexDouble": "complex128", "Float8_e4m3fn": "float8_e4m3fn",
           "Float8_e5m2": "float8_e5m2"}


def entry_record(entry: dict[str, Any], *, default_name: str | None, members: dict[str, str],
                 status: dict[str, Any]) -> dict[str, Any] | None:
    """One entry as obs's collective record (``op``, ``group``, ``ranks``, ``seq``, ``sizes``, ``dtype``, ``state``,
    ``duration_ns``, ``t``); None for a point-to-point entry (obs numbers those per pair of ranks itself) or one
    without a sequence number.

    ``default_name``: the default group's name; ``members``: a subgroup's ranks by name (``0,2``); ``status``: the
    dump's ``pg_status`` (the last started collective per group)."""
    seq = entry.get("collective_seq_id")
    if entry.get("is_p2p") or not isinstance(seq, int) or seq <= 0:
        return None
    pg = entry.get("process_group") or ("?", "")
    name, desc = str(pg[0]), str(pg[1]) if len(pg) > 1 else ""
    group = "default" if desc == "default_pg" or name == default_name else name
    op = str(entry.get("profiling_name") or "?").rpartition(":")[2]
    dtypes = entry.get("input_dtypes") or entry.get("output_dtypes") or []
    sizes = entry.get("input_sizes") or entry.get("output_sizes") or []
    created = int(entry.get("time_created_ns") or 0)
    done = entry.get("time_discovered_completed_ns")
    if entry.get("retired") or entry.get("state") == "completed":
        state = "completed"  # gloo: the work finished (it marks no failure: obs's own record says that)
    elif entry.get("state") == "started" or seq <= _int((status.get(name) or {}).get("last_started_collective")):
        state = "started"
    else:
        state = "scheduled"
    record: dict[str, Any] = {"op": op, "group": group, "seq": seq,
                              "sizes": [list(s) for s in sizes[:4]],
                              "dtype": _DTYPES.get(str(dtypes[0]), str(dtypes[0]).lower()) if dtypes else None,
                              "state": state, "t": created,
                              "duration_ns": max(0, int(done) - created) if done and state == "completed" else 0}
    if group != "default" and members.get(name):
        record["ranks"] = members[name]
    return record


def merge_entries(files: dict[str, Any], records: list[dict[str, Any]]) -> int:
    """Add ``records`` (from :func:`entry_record`) that the bundle does not hold yet (by group and sequence number)
    to ``files["events.jsonl"]`` and ``files["collectives.jsonl"]`` (lists of JSON lines ordered by time), and to
    ``files["collectives.bin"]`` (:mod:`recorder.collective_table`) where it is there; returns
    how many were added.  Entries older than the bundle's first event are left out (the ring had already let go
    of that time).

    gloo retires a failed collective as it retires a completed one: where the bundle's exception is a
    communication error (:func:`collective_error`) and the newest collective of the bundle is an entry, that one
    is ``failed`` (a bucket all_reduce that timed out in DDP's backward)."""
    events: list[str] = files.get("events.jsonl") or []
    collectives: list[str] = files.get("collectives.jsonl") or []
    if not events or not records:
        return 0
    have = set()
    for line in collectives:
        event = json.loads(line)
        have.add((parse_collective_desc(str(event.get("desc", ""))).get("group"), event.get("group_seq")))
    first = _time(events[0])
    fresh = sorted((r for r in records if (r["group"], r["seq"]) not in have and r["t"] >= first),
                   key=lambda r: r["t"])
    if not fresh:
        return 0
    if collective_error(files.get("exception.json")) and (not collectives or fresh[-1]["t"] > _time(collectives[-1])):
        fresh[-1] = {**fresh[-1], "state": "failed", "error": True}
    files["events.jsonl"], where = _insert(events, fresh)
    files["collectives.jsonl"] = _insert(collectives, fresh, where)[0] if collectives else \
        [_line(r, w) for r, w in zip(fresh, where)]
    table = files.get(collective_table.FILE)
    if isinstance(table, bytes):
        files[collective_table.FILE] = collective_table.decode(table, collective_table.FILE).plus(fresh, where).encode()
    return len(fresh)


#: what a failed collective raises (c10d's error types, gloo's and NCCL's messages)
_COMM_TYPES = ("DistBackendError", "DistNetworkError", "DistStoreError")
_COMM_TEXT = ("gloo", "NCCL", "Timed out waiting", "Connection closed by peer", "Connection reset by peer")


def collective_error(exception_json: Any) -> bool:
    """Whether a bundle's ``exception.json`` (text) is an error a collective raised."""
    if not isinstance(exception_json, str):
        return False
    try:
        exc = json.loads(exception_json)
    except ValueError:
        return False
    if not isinstance(exc, dict):
        return False
    kind, message = str(exc.get("type", "")), str(exc.get("message", ""))
    return kind.endswith(_COMM_TYPES) or any(text in message for text in _COMM_TEXT)


def _insert(lines: list[str], records: list[dict[str, Any]], where: list[tuple[int, int]] | None = None) \
        -> tuple[list[str], list[tuple[int, int]]]:
    """``lines`` with each record's line after the last line not later than it (binary search on ``t``), and where
    each went: the ``seq`` and ``step`` of the line before it (``where`` given: those instead)."""
    out: list[str] = []
    placed: list[tuple[int, int]] = []
    start = 0
    for i, record in enumerate(records):
        lo, hi = start, len(lines)
        while lo < hi:
            mid = (lo + hi) // 2
            if _time(lines[mid]) <= record["t"]:
                lo = mid + 1
            else:
                hi = mid
        out.extend(lines[start:lo])
        placed.append(where[i] if where is not None else _fields(lines, lo))
        out.append(_line(record, placed[-1]))
        start = lo
    out.extend(lines[start:])
    return out, placed


def _fields(lines: list[str], at: int) -> tuple[int, int]:
    """The ``seq`` and ``step`` of the line before ``at`` (the first line's where there is none before)."""
    event = json.loads(lines[at - 1] if at else lines[0])
    return _int(event.get("seq")), _int(event.get("step"))


def _line(record: dict[str, Any], where: tuple[int, int]) -> str:
    seq, step = where
    return json.dumps({"seq": seq, "t": record["t"], "kind": "collective", "desc": collective_desc(record),
                       "group_seq": record["seq"], "step": step, "duration_ns": record["duration_ns"],
                       "state": record["state"], "source": "flight_recorder", **({"error": True} if
                                                                               record.get("error") else {})},
                      separators=(",", ":"))


def _time(line: str) -> int:
    return _int(json.loads(line).get("t"))


def _int(value: Any) -> int:
    return value if is_int(value) else 0
