"""The serverless default: ``traces.otlp.jsonl`` (one OTLP JSON export request per line) and ``trace.json``
(Chrome trace event format: ui.perfetto.dev and chrome://tracing open it), both rotated by size.

Files are created through :mod:`obs._core.safe_files` (0600, never through a symlink).  A file that
reaches ``max_bytes`` is closed and renamed ``trace.1.json``, ``trace.2.json``, ... (higher is newer;
the ``keep`` newest are kept); a file left by an earlier run is rotated away the same way.
``trace.json`` is a JSON array written as it goes: it lacks only its closing ``]`` until the
exporter ends, which both viewers accept (a killed exporter leaves a readable file).  A full disk cuts
a file back to its last whole record and counts the spans it could not write.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from typing import Any

from exporters.spans import Span
from obs._core import safe_files

__all__ = ["ChromeTraceWriter", "OtlpJsonWriter", "RotatingFile", "chrome_events"]


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


def _us(ns: int) -> float:
    return round(ns / 1000, 3)


def chrome_events(spans: Sequence[Span], pid: int) -> list[dict[str, Any]]:
    """Complete ("X") events of ``spans`` on one track per rank, ids and attributes in ``args``."""
    out = []
    for s in spans:
        args = {k: v for k, v in s.attributes.items()}
        args.update(trace_id=f"{s.trace_id:032x}", span_id=f"{s.span_id:016x}")
        if s.parent_id:
            args["parent_span_id"] = f"{s.parent_id:016x}"
        if s.error:
            args["error"] = True
        out.append({"name": s.name, "cat": s.kind, "ph": "X", "ts": _us(s.start_ns), "dur": _us(s.duration_ns),
                    "pid": pid, "tid": 1, "args": args})
    return out


class ChromeTraceWriter:
    """``trace.json`` in the Chrome trace event format (JSON array form)."""

    def __init__(self, folder: str, max_bytes: int, *, rank: int, pid: int) -> None:
        self.rank = rank
        meta = [{"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
                 "args": {"name": f"obs rank {rank} (pid {pid})"}},
                {"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}},
                {"ph": "M", "name": "thread_name", "pid": rank, "tid": 1, "args": {"name": "training steps"}}]
        head = b"[\n" + b",\n".join(json.dumps(m, separators=(",", ":")).encode() for m in meta)
        self.file = RotatingFile(os.path.join(folder, "trace.json"), max_bytes, head=head, tail=b"\n]\n")

    def write(self, spans: Sequence[Span]) -> None:
        events = chrome_events(spans, self.rank)
        if events:
            self.file.append(b"".join(b",\n" + json.dumps(e, separators=(",", ":")).encode() for e in events))

    def counter(self, name: str, t_ns: int, value: int) -> None:
        """A counter track (dropped spans over time)."""
        event = {"ph": "C", "name": name, "pid": self.rank, "tid": 1, "ts": _us(t_ns), "args": {"dropped": value}}
        self.file.append(b",\n" + json.dumps(event, separators=(",", ":")).encode())

    def close(self) -> None:
        self.file.close()
