"""The serverless default: ``traces.otlp.jsonl`` (one OTLP JSON export request per line) and ``trace.json``
(Chrome trace event format: ui.perfetto.dev and chrome://tracing open it), both rotated by size.

Files are created through :mod:`obs._core.safe_files` (0600, never through a symlink).  A file that
reaches ``max_bytes`` is closed and renamed ``trace.1.json``, ``trace.2.json``, ... (higher is newer;
the ``keep`` newest are kept); a file left by an earlier run is rotated away the same way.
``trace.json`` is a JSON array written as it goes: it lacks only its closing ``]`` until the
exporter ends, which both viewers accept (a killed exporter leaves a readable file).  Its ``ts`` values
are µs since the file's ``obs.trace_start`` event (wall-clock ns), written exactly: epoch µs as floats
are only good to 0.25 µs, enough for a child to end after its parent.  A full disk cuts a file back to
its last whole record and counts the spans it could not write.

Tracks, per rank (``pid``): the host's spans on ``tid`` 1; what the device ran on ``tid`` 2, "GPU (CUDA
events)": the device time of each span that has one (its ``obs.device.*`` attributes, ``cat`` gpu) and the
collective spans; the kernel spans of op_trace windows on ``tid`` 3, "GPU kernels (CUPTI)".  A track's name is
written with its first event in each file.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

from exporters.spans import Span
from obs._core import safe_files

__all__ = ["GPU_TID", "KERNEL_TID", "ORIGIN_EVENT", "ChromeTraceWriter", "OtlpJsonWriter", "RotatingFile",
           "chrome_events"]


class RotatingFile:
    """Appends whole records to ``path``; rotates at ``max_bytes``; ``head``/``tail`` open and close a file."""

    def __init__(self, path: str, max_bytes: int, *, keep: int = 5, head: bytes = b"", tail: bytes = b"") -> None:
        self.path, self.max_bytes, self.keep, self.head, self.tail = path, max_bytes, keep, head, tail
        stem, ext = os.path.splitext(os.path.basename(path))
        self._pattern = re.compile(re.escape(stem) + r"\.(\d+)" + re.escape(ext) + "$")
        self._stem, self._ext = stem, ext
        self.written: list[str] = []  #: files made (the live one first, rotated ones as they appear)
        self.records = 0  #: records in the live file
        if os.path.lexists(path):
            self._rotate_name()
        self._open()

    def _open(self) -> None:
        self._fd: int | None = safe_files.create_file(self.path, append=True)
        self.size = 0
        self.records = 0
        if self.path not in self.written:
            self.written.append(self.path)
        if self.head:
            self._write(self.head)

    def _numbers(self) -> list[int]:
        folder = os.path.dirname(self.path)
        return sorted(int(m.group(1)) for name in os.listdir(folder) if (m := self._pattern.match(name)))

    def _rotate_name(self) -> None:
        numbers = self._numbers()
        target = os.path.join(os.path.dirname(self.path), f"{self._stem}.{(numbers[-1] if numbers else 0) + 1}"
                                                          f"{self._ext}")
        os.rename(self.path, target)
        self.written.append(target)
        for old in self._numbers()[:-self.keep]:
            try:
                os.unlink(os.path.join(os.path.dirname(self.path), f"{self._stem}.{old}{self._ext}"))
            except FileNotFoundError:
                pass

    def _write(self, data: bytes) -> None:
        assert self._fd is not None
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._fd, view):]
        except OSError:
            os.ftruncate(self._fd, self.size)  # back to the last whole record
            raise
        self.size += len(data)

    def append(self, record: bytes) -> None:
        """Write one whole record (raises OSError, with the file cut back, when the disk refuses it)."""
        self._write(record)
        self.records += 1
        if self.size >= self.max_bytes:
            self.close()
            self._rotate_name()
            self._open()

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if self.tail:
                self._fd = fd
                try:
                    self._write(self.tail)
                except OSError:
                    pass
                self._fd = None
            os.fsync(fd)
        finally:
            os.close(fd)


class OtlpJsonWriter:
    """``traces.otlp.jsonl``: each batch one ExportTraceServiceRequest in OTLP JSON, one line."""

    def __init__(self, folder: str, max_bytes: int) -> None:
        self.file = RotatingFile(os.path.join(folder, "traces.otlp.jsonl"), max_bytes)

    def write(self, request: dict[str, Any]) -> None:
        self.file.append(json.dumps(request, separators=(",", ":")).encode() + b"\n")

    def close(self) -> None:
        self.file.close()


#: the metadata event that starts every ``trace.json``: ``args.unix_ns`` is the time its ``ts`` values count from
ORIGIN_EVENT = "obs.trace_start"


def _us(ns: int) -> str:
    """``ns`` as a JSON number of µs, exact: at most three decimals, never through a float."""
    whole, part = divmod(abs(ns), 1000)
    return ("-" if ns < 0 else "") + str(whole) + (f".{part:03d}".rstrip("0") if part else "")


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def _event(head: dict[str, Any], ts_ns: int, dur_ns: int | None, tail: dict[str, Any]) -> str:
    times = f'"ts":{_us(ts_ns)}' + ("" if dur_ns is None else f',"dur":{_us(dur_ns)}')
    return f"{_dumps(head)[:-1]},{times},{_dumps(tail)[1:]}"


#: the tracks of what the device ran: CUDA events (spans' device time, collectives), CUPTI's kernels
GPU_TID, KERNEL_TID = 2, 3
_TRACKS = {GPU_TID: "GPU (CUDA events)", KERNEL_TID: "GPU kernels (CUPTI)"}
_ON_DEVICE = {"collective": GPU_TID, "kernel": KERNEL_TID}  # span kinds timed on the device only


def _tids(spans: Sequence[Span]) -> set[int]:
    """The device tracks ``spans`` put events on."""
    return {_ON_DEVICE.get(s.kind, GPU_TID) for s in spans
            if s.kind in _ON_DEVICE or "obs.device.start_ns" in s.attributes}


def chrome_events(spans: Sequence[Span], pid: int, *, origin_ns: int) -> list[str]:
    """Complete ("X") events of ``spans``, ids and attributes in ``args``, as JSON text: the host's spans on ``tid``
    1, each with its device time (if any) again on the GPU track; collective and kernel spans on theirs.

    ``ts`` is the span's start in µs since ``origin_ns`` and ``dur`` its duration, both exact to the ns, so
    ``ts + dur`` is the end as recorded: a child that ends with its parent ends with it in the file too."""
    out = []
    for s in spans:
        args = {k: v for k, v in s.attributes.items()}
        args.update(trace_id=f"{s.trace_id:032x}", span_id=f"{s.span_id:016x}")
        if s.parent_id:
            args["parent_span_id"] = f"{s.parent_id:016x}"
        if s.error:
            args["error"] = True
        tid = _ON_DEVICE.get(s.kind, 1)
        out.append(_event({"name": s.name, "cat": s.kind, "ph": "X"}, s.start_ns - origin_ns, s.duration_ns,
                          {"pid": pid, "tid": tid, "args": args}))
        device_start = s.attributes.get("obs.device.start_ns")
        if tid == 1 and device_start is not None:
            duration = int(s.attributes.get("obs.device.time_ns", 0))
            out.append(_event({"name": s.name, "cat": "gpu", "ph": "X"}, int(device_start) - origin_ns, duration,
                              {"pid": pid, "tid": GPU_TID, "args": {"kind": s.kind, "span_id": args["span_id"]}}))
    return out


class ChromeTraceWriter:
    """``trace.json`` in the Chrome trace event format (JSON array form).

    Times are relative, so that a float of µs (what viewers parse) keeps the ns: the first record of each file
    (rotated ones too) is an ``obs.trace_start`` metadata event holding the wall-clock ns its ``ts`` values count
    from (the start of the first event written to it)."""

    def __init__(self, folder: str, max_bytes: int, *, rank: int, pid: int) -> None:
        self.rank = rank
        self.origin_ns: int | None = None  #: what the live file's ``ts`` values count from, once it has one
        self._named: set[int] = set()  # device tracks named in the live file
        meta = [{"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
                 "args": {"name": f"obs rank {rank} (pid {pid})"}},
                {"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}},
                {"ph": "M", "name": "thread_name", "pid": rank, "tid": 1, "args": {"name": "training steps"}}]
        head = b"[\n" + b",\n".join(_dumps(m).encode() for m in meta)
        self.file = RotatingFile(os.path.join(folder, "trace.json"), max_bytes, head=head, tail=b"\n]\n")

    def _append(self, first_ns: int, encode: Callable[[int], list[str]]) -> None:
        """Append ``encode(origin)`` as one record; a file's first record sets its origin to ``first_ns``."""
        origin, events = self.origin_ns, []
        if origin is None:
            origin = first_ns
            self._named = set()
            events.append(_dumps({"ph": "M", "name": ORIGIN_EVENT, "pid": self.rank, "tid": 0,
                                  "args": {"unix_ns": origin}}))
        events += encode(origin)
        self.file.append("".join(",\n" + e for e in events).encode())
        self.origin_ns = origin if self.file.records else None  # None: it rotated, the next file gets its own

    def write(self, spans: Sequence[Span]) -> None:
        if not spans:
            return
        tracks = _tids(spans)
        named: list[int] = []

        def encode(origin: int) -> list[str]:
            named[:] = sorted(tracks - self._named)  # after _append reset them for a new file
            return [_dumps({"ph": "M", "name": "thread_name", "pid": self.rank, "tid": tid,
                            "args": {"name": _TRACKS[tid]}}) for tid in named] + \
                chrome_events(spans, self.rank, origin_ns=origin)

        self._append(min(s.start_ns for s in spans), encode)
        if self.origin_ns is not None:  # written, and the file did not rotate
            self._named.update(named)

    def counter(self, name: str, t_ns: int, value: int) -> None:
        """A counter track (dropped spans over time)."""
        self._append(t_ns, lambda origin: [_event({"ph": "C", "name": name, "pid": self.rank, "tid": 1},
                                                  t_ns - origin, None, {"args": {"dropped": value}})])

    def close(self) -> None:
        self.file.close()
