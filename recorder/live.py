"""What every rank of a running job is doing now, read from the rings under a folder while the job runs.

Pure reading, for ``obs top``: each ring is mapped read-only and copied in part (its step and collective rings,
the newest slots of its module ring, its string table), and nothing is sent to the job.  A rank whose ring is
left but whose writer is gone (its lock is free) is ``gone``.  The ranks are then lined up per collective
(:mod:`recorder.arrival`) and the rank the others wait for is named: a rank missing from a collective its
peers wait in now, or one late at every collective.
"""

from __future__ import annotations

import mmap
import os
import time
from collections import defaultdict
from dataclasses import dataclass, field

from obs._core import safe_files
from obs._core.json_files import read_json
from obs._core.rank_folders import unresolved
from recorder.arrival import Lineup, RankTimeline, line_up, timeline_from_contents
from recorder.layout import Kind
from recorder.now import now
from recorder.ring_files import RING_ERRORS, RingFile, find_rings
from recorder.ring_reader import RingContents, read_ring

__all__ = ["Doing", "JobNow", "RankNow", "rank_now", "read_job"]

_MODULE_TAIL = 2048  # newest module slots read: enough to see the open nest of a forward
_RATE_STEPS = 20  # steps per second over the newest this many steps


@dataclass(frozen=True)
class Doing:
    """What a rank is in now (a phase, a module or a collective) and since when (wall ns)."""

    what: str
    since_ns: int

    def for_s(self, now_ns: int) -> float:
        return max(0.0, (now_ns - self.since_ns) / 1e9)


@dataclass
class RankNow:
    """One row of ``obs top``."""

    rank: int
    host: str
    pid: int
    ring: str
    alive: bool
    run_id: str | None = None
    granularity: str | None = None
    step: int = 0
    steps_per_s: float | None = None
    phase: Doing | None = None
    module: Doing | None = None
    collective: Doing | None = None
    open_collective: tuple[str, int] | None = None  #: (group, seq) of the collective it waits in now
    last_seq: dict[str, int] = field(default_factory=dict)  #: the newest collective sequence number per group
    waited_for: bool = False  #: ranks wait now in a collective this rank has not reached
    lateness_s: float | None = None  #: median lateness per step at the collectives lined up (recorder.arrival)
    straggler: bool = False
    late_phase: str | None = None
    error: str | None = None  #: why the ring could not be read
    resolved: bool = True  #: False while the process does not know its rank yet (``rank_unresolved-{pid}``)


@dataclass
class JobNow:
    root: str
    taken_ns: int
    run_id: str | None
    ranks: list[RankNow] = field(default_factory=list)
    lineup: Lineup = field(default_factory=Lineup)

    @property
    def waited_for(self) -> list[int]:
        """The ranks the others wait for: missing from a collective they wait in now, or late at every one."""
        return sorted({r.rank for r in self.ranks if r.waited_for or r.straggler})

    @property
    def gone(self) -> list[int]:
        return sorted(r.rank for r in self.ranks if not r.alive)


def read_job(root: str, *, now_ns: int | None = None) -> JobNow:
    """Every rank whose ring is under ``root`` (an RDR root, a rank or rdr folder), newest run first.

    Raises FileNotFoundError when ``root`` does not exist; a ring that cannot be read is a row with ``error``."""
    if not os.path.isdir(root):
        raise FileNotFoundError(f"no such folder: {root!r}")
    now_ns = time.time_ns() if now_ns is None else now_ns
    rows = [_read_one(ring) for ring in find_rings(root)]
    live_runs = sorted(((made, row.run_id) for row, _t, made in rows if row.alive and row.run_id), reverse=True)
    run_id = live_runs[0][1] if live_runs else max(((made, row.run_id) for row, _t, made in rows),
                                                   default=(0, None), key=lambda x: x[0])[1]
    best: dict[int | str, tuple[RankNow, RankTimeline | None]] = {}
    for row, timeline, _made in sorted(rows, key=lambda x: (x[0].alive, x[2])):  # a live ring wins over a dead one
        if row.error is None and row.run_id != run_id:
            continue
        best[row.rank if row.resolved and row.error is None else row.ring] = (row, timeline)
    job = JobNow(os.path.abspath(root), now_ns, run_id, [row for row, _t in sorted(best.values(), key=lambda x:
                                                                                      x[0].rank)])
    job.lineup = line_up([t for r, t in best.values() if t is not None and r.resolved])
    _mark(job)
    return job


def _read_one(ring: RingFile) -> tuple[RankNow, RankTimeline | None, int]:
    path = ring.path
    if ring.error is not None:
        return _unreadable(path, str(ring.error))
    try:
        fd = safe_files.open_private(path)
    except RING_ERRORS as exc:  # removed since it was found
        return _unreadable(path, str(exc))
    failed: str | None = None
    try:
        mm = mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_SHARED, mmap.PROT_READ)
        try:
            contents = read_ring(mm, path=path, rings=("step", "collective", "module"),
                                 tails={"module": _MODULE_TAIL}, blobs=False)
        except RING_ERRORS as exc:
            failed = str(exc)  # kept as text: the error's frames hold views of the map, which must go before it
        if failed is None:
            mm.close()
    except RING_ERRORS as exc:  # ValueError: an empty file cannot be mapped
        failed = str(exc)
    finally:
        os.close(fd)
    if failed is not None:
        return _unreadable(path, failed)
    row = rank_now(contents, path, ring.alive)
    row.run_id = _agreed_run_id(os.path.dirname(path), row.pid) or row.run_id
    row.resolved = not unresolved(os.path.basename(os.path.dirname(os.path.dirname(path))))
    return row, timeline_from_contents(contents), contents.header.wall_ns


def _unreadable(path: str, why: str) -> tuple[RankNow, None, int]:
    return RankNow(-1, "", -1, path, False, error=why), None, 0


def _agreed_run_id(folder: str, pid: int) -> str | None:
    """The run id the ranks agreed on once torch.distributed was up, from the rank's marker (the ring's header
    keeps the process's first proposal; the agreed one is a blob, which a live view does not read)."""
    try:
        marker = read_json(os.path.join(folder, "marker.json"), what="a rank's marker")
    except RING_ERRORS:
        return None
    if marker.get("pid") == pid and isinstance(marker.get("run_id"), str):
        return str(marker["run_id"])
    return None


def rank_now(contents: RingContents, path: str, alive: bool) -> RankNow:
    """One rank's row from its ring's contents."""
    header = contents.header
    meta = header.meta
    text = {k: meta.get(k) if isinstance(meta.get(k), str) else None for k in ("host", "run_id", "granularity")}
    row = RankNow(header.rank, text["host"] or "", header.pid, path, alive, text["run_id"], text["granularity"])
    doing = now(contents)
    row.step, row.last_seq = doing["step"], doing["last_seq"]
    if doing["phase"] is not None:
        row.phase = Doing(doing["phase"]["name"], doing["phase"]["since_ns"])
    if doing["module"] is not None:
        row.module = Doing(doing["module"], doing["module_since_ns"])
    collective = doing["collective"]
    if collective is not None:
        row.collective = Doing(f"{collective['op']} {collective['group']} #{collective['seq']}", collective["since_ns"])
        row.open_collective = (collective["group"], collective["seq"])
    slots = contents.slots
    ends = slots[slots["kind"] == Kind.STEP_END][-_RATE_STEPS:]
    if len(ends) >= 2 and ends["t"][-1] > ends["t"][0]:
        row.steps_per_s = (len(ends) - 1) / ((int(ends["t"][-1]) - int(ends["t"][0])) / 1e9)
    return row


def _mark(job: JobNow) -> None:
    """Who the others wait for: members of a group that have not reached the collective its other members wait
    in now (the default group's members are every rank; a subgroup's, the ranks it names)."""
    alive = [r for r in job.ranks if r.alive and r.error is None]
    waits: dict[tuple[str, int], list[int]] = defaultdict(list)
    for r in alive:
        if r.open_collective is not None:
            waits[r.open_collective].append(r.rank)
    for (group, seq), waiting in waits.items():
        members = [r for r in alive if group == "default" or group in r.last_seq]
        for r in members:
            if r.rank not in waiting and r.last_seq.get(group, 0) < seq:
                r.waited_for = True
    for late in job.lineup.ranks:
        row = next((r for r in job.ranks if r.rank == late.rank), None)
        if row is not None:
            row.lateness_s, row.straggler, row.late_phase = late.score_s, late.straggler, late.phase
