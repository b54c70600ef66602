"""A bundle's collectives as one table: ``collectives.bin``, what ``obs rdr analyze`` reads instead of parsing
``collectives.jsonl`` line by line (8,192 JSON lines a rank at the default ring: most of analyze's time at 512 ranks).

The same events as ``collectives.jsonl`` (obs's records and the Flight Recorder's entries merged beside them), in
columns.  The file: one JSON line (``{"format": "obs-collectives", "version": 1, "rows": N, "descs": [...]}``: the
distinct descriptions, :mod:`recorder.collective_desc`), then N rows of :data:`ROW_DTYPE` (little-endian, packed:
46 bytes each), read with one ``numpy.frombuffer``.  Pure: contents or bytes in, a table or bytes out.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from obs._core.errors import DamagedFileError
from obs._core.json_files import is_int
from recorder.collective_desc import COLLECTIVE_STATES, collective_desc
from recorder.layout import Kind

__all__ = ["ERROR", "FILE", "FLIGHT_RECORDER", "ROW_DTYPE", "CollectiveTable", "decode", "runs"]

FILE = "collectives.bin"
_FORMAT, _VERSION = "obs-collectives", 1
#: seq (the event's global order; a Flight Recorder entry: the seq of the event before it), t (wall ns: obs's
#: records when written, an entry when created), step, group_seq, duration_ns, desc (index into ``descs``), state
#: (an index into COLLECTIVE_STATES), flags (ERROR, FLIGHT_RECORDER)
ROW_DTYPE = np.dtype([("seq", "<u8"), ("t", "<i8"), ("step", "<i8"), ("group_seq", "<i8"), ("duration_ns", "<i8"),
                      ("desc", "<i4"), ("state", "u1"), ("flags", "u1")])
ERROR, FLIGHT_RECORDER = 1, 2


@dataclass(frozen=True)
class CollectiveTable:
    """Every collective event of a bundle, in time order: ``rows`` (ROW_DTYPE) and the descriptions they name."""

    rows: np.ndarray
    descs: tuple[str, ...]

    @classmethod
    def from_contents(cls, contents: Any) -> CollectiveTable:
        """The COLLECTIVE slots of a ring's contents (:class:`recorder.ring_reader.RingContents`)."""
        slots = contents.slots[contents.slots["kind"] == Kind.COLLECTIVE]
        ids, index = np.unique(slots["a"], return_inverse=True)
        rows = np.zeros(len(slots), dtype=ROW_DTYPE)
        rows["seq"] = slots["seq"]
        rows["t"] = slots["t"] + np.int64(contents.header.wall_ns - contents.header.mono_ns)
        rows["step"] = contents.steps(slots["seq"])
        rows["group_seq"], rows["duration_ns"] = slots["b"], slots["c"]
        rows["desc"] = index.reshape(-1)
        rows["state"] = np.where((slots["d"] >= 0) & (slots["d"] < len(COLLECTIVE_STATES)), slots["d"], 255)
        rows["flags"] = (slots["flags"] & 1).astype(np.uint8)  # bit 0: the collective raised
        return cls(rows, tuple(contents.string(int(i)) for i in ids.tolist()))

    @classmethod
    def from_events(cls, events: Iterable[Mapping[str, Any]]) -> CollectiveTable:
        """The ``collective`` events of a bundle's JSON lines (bundles written before ``collectives.bin``); an event
        without an integer ``group_seq`` is left out."""
        descs: dict[str, int] = {}
        rows = []
        for e in events:
            seq = e.get("group_seq")
            if e.get("kind") != "collective" or _int(seq) != seq:
                continue
            desc = str(e.get("desc", ""))
            state = e.get("state")
            flags = (ERROR if e.get("error") else 0) | (FLIGHT_RECORDER if e.get("source") == "flight_recorder" else 0)
            rows.append((max(0, _int(e.get("seq"))), _int(e.get("t")), _int(e.get("step")), seq,
                         _int(e.get("duration_ns")), descs.setdefault(desc, len(descs)),
                         COLLECTIVE_STATES.index(state) if state in COLLECTIVE_STATES else 255, flags))
        return cls(np.array(rows, dtype=ROW_DTYPE), tuple(descs))

    def plus(self, records: Sequence[dict[str, Any]], where: Sequence[tuple[int, int]]) -> CollectiveTable:
        """This table with Flight Recorder ``records`` (:func:`recorder.flight_recorder.entry_record`) added, each
        with the ``(seq, step)`` of the event it follows (``where``); rows stay in time order."""
        descs = list(self.descs)
        known = {d: i for i, d in enumerate(descs)}
        added = np.zeros(len(records), dtype=ROW_DTYPE)
        for row, record, (seq, step) in zip(added, records, where):
            desc = collective_desc(record)
            if desc not in known:
                known[desc] = len(descs)
                descs.append(desc)
            state = record.get("state")
            row["seq"], row["t"], row["step"] = seq, record["t"], step
            row["group_seq"], row["duration_ns"], row["desc"] = record["seq"], record["duration_ns"], known[desc]
            row["state"] = COLLECTIVE_STATES.index(state) if state in COLLECTIVE_STATES else 255
            row["flags"] = FLIGHT_RECORDER | (ERROR if record.get("error") else 0)
        rows = np.concatenate([self.rows, added])
        return CollectiveTable(rows[np.argsort(rows["t"], kind="stable")], tuple(descs))

    def encode(self) -> bytes:
        head = {"format": _FORMAT, "version": _VERSION, "rows": len(self.rows), "descs": list(self.descs)}
        line = json.dumps(head, separators=(",", ":")).encode("utf-8", "surrogateescape") + b"\n"
        return line + np.ascontiguousarray(self.rows, dtype=ROW_DTYPE).tobytes()


def decode(data: bytes, path: str) -> CollectiveTable:
    """The table in a ``collectives.bin`` file's bytes; a :class:`DamagedFileError` naming ``path`` and what is wrong
    when they are not one (a torn file, a foreign header, an array of another dtype, a description index out of
    range)."""
    line_end = data.find(b"\n")
    if line_end < 0:
        raise DamagedFileError(f"{path}: no header line (expected a JSON line, then the rows)", path=path, offset=0)
    try:
        head = json.loads(data[:line_end].decode("utf-8", "surrogateescape"))
    except (ValueError, RecursionError) as exc:
        raise DamagedFileError(f"{path}: its header line is not JSON ({type(exc).__name__})", path=path,
                               offset=0) from None
    if not isinstance(head, dict) or head.get("format") != _FORMAT or not isinstance(head.get("descs"), list) \
            or not all(isinstance(d, str) for d in head["descs"]):
        raise DamagedFileError(f"{path}: its header is not an {_FORMAT} header with a list of descriptions",
                               path=path, offset=0)
    if head.get("version") != _VERSION:
        raise DamagedFileError(f"{path}: {_FORMAT} version {head.get('version')!r}; this obs reads version "
                               f"{_VERSION}", path=path, offset=0)
    at, rows_said = line_end + 1, head.get("rows")
    if not is_int(rows_said) or rows_said < 0 or rows_said * ROW_DTYPE.itemsize != len(data) - at:
        raise DamagedFileError(f"{path}: its header says {rows_said!r} rows of {ROW_DTYPE.itemsize} bytes, "
                               f"{len(data) - at} bytes follow (torn?)", path=path, offset=at)
    rows = np.frombuffer(data, dtype=ROW_DTYPE, count=rows_said, offset=at)
    if len(rows) and (int(rows["desc"].min()) < 0 or int(rows["desc"].max()) >= len(head["descs"])):
        raise DamagedFileError(f"{path}: a row names description {int(rows['desc'].max())} of "
                               f"{len(head['descs'])}", path=path, offset=line_end + 1)
    return CollectiveTable(rows, tuple(head["descs"]))


def runs(group: np.ndarray, seq: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Records sorted by (group, sequence number), then in their own order: ``order`` (indices into the records),
    and each collective's ``first`` and ``last`` positions in that order (a collective's records are one run)."""
    order = np.lexsort((np.arange(len(seq)), seq, group))
    g, q = group[order], seq[order]
    new = np.ones(len(order), dtype=bool)
    new[1:] = (g[1:] != g[:-1]) | (q[1:] != q[:-1])
    first = np.flatnonzero(new)
    return order, first, np.append(first[1:], len(order)) - 1




def _int(value: Any) -> int:
    return value if is_int(value) and -(1 << 63) <= value < (1 << 63) else 0
