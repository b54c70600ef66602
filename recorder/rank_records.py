"""One rank's collectives as ``obs rdr analyze`` compares them: per group, one entry per sequence number, in arrays.

From a bundle's :class:`recorder.collective_table.CollectiveTable`: the records of one collective (``started``, then
``completed``) fold into one entry (its first time; its last state, step and description).  Descriptions are
parsed once per job (:class:`Descriptions`, shared by the ranks), so comparing two ranks' collectives is comparing
integers.  :class:`CollectiveRecord` objects are made only for the few entries a verdict names.  Pure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from recorder.arrival import Arrival, RankTimeline
from recorder.collective_desc import COLLECTIVE_STATES, parse_collective_desc
from recorder.collective_table import FLIGHT_RECORDER, CollectiveTable, runs

__all__ = ["CollectiveRecord", "Descriptions", "GroupRecords", "RankCollectives", "add_arrivals", "rank_collectives"]

_SEND, _RECV = frozenset({"send", "isend"}), frozenset({"recv", "irecv"})
_OPEN, _DONE = (0, 1), (2, 3)  # COLLECTIVE_STATES codes: scheduled, started / completed, failed


@dataclass(frozen=True)
class CollectiveRecord:
    """A rank's last word on one collective: its group, sequence number, op, sizes, dtype and state."""

    group: str
    seq: int
    op: str
    sizes: list[Any]
    dtype: str | None
    state: str
    step: int
    t: int
    members: list[int] | None = None

    def signature(self) -> tuple[Any, ...]:
        op = "send/recv" if self.op in _SEND | _RECV else self.op
        return op, repr(self.sizes), self.dtype

    def describe(self) -> str:
        return f"{self.op} {self.dtype} {self.sizes}"


@dataclass
class Descriptions:
    """Every distinct collective description of a job, parsed once: its fields, its group and its signature (the
    op, sizes and dtype ranks must agree on), each as a small integer."""

    ids: dict[str, int] = field(default_factory=dict)
    fields: list[dict[str, Any]] = field(default_factory=list)
    groups: list[str] = field(default_factory=list)
    group_of: list[int] = field(default_factory=list)  #: description id -> group id
    sig_of: list[int] = field(default_factory=list)  #: description id -> signature id
    _group_ids: dict[str, int] = field(default_factory=dict)
    _sig_ids: dict[tuple[Any, ...], int] = field(default_factory=dict)

    def add(self, descs: tuple[str, ...]) -> np.ndarray:
        """The job-wide ids of a table's descriptions (in the table's order)."""
        out = np.empty(len(descs), dtype=np.int64)
        for i, desc in enumerate(descs):
            known = self.ids.get(desc)
            if known is None:
                known = self.ids[desc] = len(self.fields)
                parsed = parse_collective_desc(desc)
                group = str(parsed.get("group", "?"))
                self.fields.append(parsed)
                self.group_of.append(self._group_ids.setdefault(group, len(self._group_ids)))
                if len(self.groups) < len(self._group_ids):
                    self.groups.append(group)
                sig = CollectiveRecord(group, 0, parsed["op"], parsed.get("sizes", []), parsed.get("dtype"), "", 0,
                                       0).signature()
                self.sig_of.append(self._sig_ids.setdefault(sig, len(self._sig_ids)))
            out[i] = known
        return out


@dataclass(frozen=True)
class GroupRecords:
    """One rank's collectives of one group, one entry per sequence number (ascending)."""

    group: str
    seq: np.ndarray  #: int64, ascending, distinct
    desc: np.ndarray  #: job-wide description id (its newest record's)
    sig: np.ndarray  #: job-wide signature id
    state: np.ndarray  #: COLLECTIVE_STATES code of its newest record
    step: np.ndarray
    t: np.ndarray  #: wall ns of its first record (its entry)

    def at(self, seq: int) -> int | None:
        """The index of sequence number ``seq``, or None."""
        i = int(np.searchsorted(self.seq, seq))
        return i if i < len(self.seq) and int(self.seq[i]) == seq else None

    def record(self, i: int, descs: Descriptions) -> CollectiveRecord:
        fields = descs.fields[int(self.desc[i])]
        code = int(self.state[i])
        return CollectiveRecord(self.group, int(self.seq[i]), fields["op"], fields.get("sizes", []),
                                fields.get("dtype"), COLLECTIVE_STATES[code] if code < len(COLLECTIVE_STATES) else "?",
                                int(self.step[i]), int(self.t[i]), fields.get("ranks"))


@dataclass(frozen=True)
class RankCollectives:
    groups: dict[str, GroupRecords]
    last: CollectiveRecord | None  #: the collective of its newest record


def rank_collectives(table: CollectiveTable, descs: Descriptions) -> RankCollectives:
    """A rank's table folded into one entry per (group, sequence number)."""
    rows = table.rows
    if not len(rows):
        return RankCollectives({}, None)
    gid = descs.add(table.descs)[rows["desc"]]
    group = np.asarray(descs.group_of, dtype=np.int64)[gid]
    order, first, last = runs(group, rows["group_seq"])
    g, q = group[order], rows["group_seq"][order]
    newest, entry = order[last], order[first]
    sig = np.asarray(descs.sig_of, dtype=np.int64)
    groups: dict[str, GroupRecords] = {}
    bounds = np.flatnonzero(np.append(True, g[first][1:] != g[first][:-1]))
    for lo, hi in zip(bounds.tolist(), np.append(bounds[1:], len(first)).tolist()):
        name = descs.groups[int(g[first[lo]])]
        pick = newest[lo:hi]
        groups[name] = GroupRecords(name, q[first[lo:hi]], gid[pick], sig[gid[pick]], rows["state"][pick],
                                    rows["step"][pick], rows["t"][entry[lo:hi]])
    tail = descs.groups[int(group[-1])]
    records = groups[tail]
    at = records.at(int(rows["group_seq"][-1]))
    return RankCollectives(groups, records.record(at, descs) if at is not None else None)


def add_arrivals(out: RankTimeline, table: CollectiveTable, descs: Descriptions, since_step: int) -> None:
    """Each collective of ``table`` from step ``since_step`` on into a timeline (:mod:`recorder.arrival`): obs's
    records are one row at entry and one at the end (a row at the end alone entered ``duration_ns`` before it);
    a Flight Recorder entry is one row, entered at ``t``, left ``duration_ns`` later (no end time: still 0)."""
    rows = table.rows[table.rows["step"] >= since_step]
    gid = descs.add(table.descs)
    for t, step, seq, took, desc, state, flags in zip(rows["t"].tolist(), rows["step"].tolist(),
                                                      rows["group_seq"].tolist(), rows["duration_ns"].tolist(),
                                                      rows["desc"].tolist(), rows["state"].tolist(),
                                                      rows["flags"].tolist()):
        d = int(gid[desc])
        group, op = descs.groups[descs.group_of[d]], descs.fields[d]["op"]
        key = (group, seq)
        before = out.arrivals.get(key)
        if state in _OPEN:
            if before is None:
                out.arrivals[key] = Arrival(group, seq, op, t, None, False, step)
        elif state in _DONE:
            if before is not None:
                out.arrivals[key] = Arrival(group, seq, before.op, before.enter, t, True, before.step)
            elif flags & FLIGHT_RECORDER:
                out.arrivals[key] = Arrival(group, seq, op, t, t + took if took > 0 else None, True, step)
            else:
                out.arrivals[key] = Arrival(group, seq, op, t - max(took, 0), t, True, step)
