"""Line up the ranks of one job from their newest RDR bundles and name the rank that broke it.

Pure: a folder of ``rank_{r}/rdr`` trees in, an :class:`Analysis` out (the CLI renders it).

* Each rank's newest bundle of the job (the run id of the newest bundle under the root); a rank
  with none is reported with what its marker says (a ring left for ``obs rdr recover``, a dump that
  failed, no marker at all).
* Collectives are matched by group and sequence number, as PyTorch's Flight Recorder analyzer
  does: the first sequence number where the member ranks disagree (one never reached it, or
  ran a different op, size or dtype) is a :class:`Mismatch`, with the ranks on each side (the
  smaller side is the culprit; a tie names both).  A rank whose bundle is a snapshot it went on
  after (a hang or manual dump) is not counted missing from collectives begun after it.
* Stragglers: ranks behind the furthest rank in step or in the world group's sequence, and ranks the others
  wait for at every collective, lined up by arrival (:mod:`recorder.arrival`), with the phase their time went to.
* Ranks that died without dumping (their rings recovered by ``obs rdr recover``: SIGKILL, the OOM killer): the
  first cause when the records agree, as when the launcher stopped the others before they waited on the dead one.
* Ranks that raised, and whether in their own code (a first cause) or inside a collective that
  failed because a peer was gone (a consequence); the first NaN/Inf fault, where the NaN check
  recorded one.
"""

from __future__ import annotations

import itertools
import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from obs._core import safe_files
from recorder.arrival import PHASE_LABELS, STEP_WINDOW, Lineup, RankTimeline, line_up, timeline_from_events
from recorder.bundle_reader import BAD_FILE, BundleInfo, list_bundles, load_bundle, parse_json
from recorder.collective_desc import parse_collective_desc
from recorder.recover import near
from recorder.stacks import is_hidden, is_library, is_wrapper

__all__ = ["Analysis", "CollectiveRecord", "Mismatch", "RankState", "Straggler", "analyze"]

_NAN_FAULTS = ("nan_inf",)  # the FAULT kind of obs.dump's NaN/Inf check
#: dump reasons after which the rank goes on (the others end it): a hang, obs.rdr.dump(), obs rdr snapshot, a peer's
#: hang request (recorder.requests)
_SNAPSHOTS = ("hang", "manual", "snapshot", "peer_hang")
_FOREVER = 1 << 63
_MAX_RANKS = 1 << 16  # a rank or world size beyond this in a file is damage, not a job
_SEND, _RECV = frozenset({"send", "isend"}), frozenset({"recv", "irecv"})


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


@dataclass(frozen=True)
class RankState:
    """One rank: its bundle (or why there is none), its last collective, what it raised."""

    rank: int
    bundle: str | None
    reason: str | None = None
    step: int | None = None
    host: str | None = None
    pid: int | None = None
    recovered: bool = False
    run_id: str | None = None
    exception: str | None = None
    #: True when the exception came out of a collective that failed (a peer was gone): a consequence
    raised_in_collective: bool = False
    last_collective: CollectiveRecord | None = None
    note: str | None = None  #: why there is no bundle (from the marker), or what else there is to know
    #: the innermost frame of the user's code on its main thread when it dumped (``file:line in function``)
    where: str | None = None


@dataclass(frozen=True)
class Mismatch:
    """The first collective of a group where its ranks disagree."""

    group: str
    seq: int
    kind: str  #: missing | op | size | dtype
    expected: str  #: what the majority ran
    sides: dict[str, list[int]]  #: what each side ran ("never reached it" for missing ranks) → its ranks
    culprits: list[int]
    step: int
    t: int
    detail: str


@dataclass(frozen=True)
class Straggler:
    """A rank behind the furthest one in step or world-group collectives when the bundles were taken, or one the
    others waited for at every step (``lateness_s``: its median lateness per step at the collectives lined up;
    ``phase``: where its extra time went, ``phase_excess_s`` per step against the other ranks; recorder.arrival)."""

    rank: int
    behind_steps: int
    behind_collectives: int
    lateness_s: float | None = None
    phase: str | None = None
    phase_excess_s: float | None = None


@dataclass
class Analysis:
    """What ``obs rdr analyze`` found; ``culprits`` empty and ``consistent`` True for a clean job."""

    root: str
    run_id: str | None
    world_size: int
    ranks: list[RankState] = field(default_factory=list)
    no_bundle: list[int] = field(default_factory=list)
    mismatches: list[Mismatch] = field(default_factory=list)
    stragglers: list[Straggler] = field(default_factory=list)
    raised: list[int] = field(default_factory=list)
    died: list[int] = field(default_factory=list)  #: ranks whose bundle was recovered: they died without dumping
    nan: dict[str, Any] | None = None
    stuck: CollectiveRecord | None = None  #: every rank waits in this collective (no rank to blame)
    culprits: list[int] = field(default_factory=list)
    verdict: str = ""
    other_runs: list[str] = field(default_factory=list)
    lineup: Lineup = field(default_factory=Lineup)  #: every rank lined up per collective (recorder.arrival)
    problems: list[str] = field(default_factory=list)  #: bundles or markers that could not be read

    @property
    def consistent(self) -> bool:
        return not (self.culprits or self.mismatches or self.stuck or self.no_bundle or self.raised
                    or self.died or self.nan or self.problems)


def analyze(root: str) -> Analysis:
    """Analyze the job whose RDR files are under ``root`` (raises FileNotFoundError / NotOurFileError)."""
    listing = list_bundles(root)
    markers = _markers(root)
    problems = [str(e) for e in listing.damaged]
    if not listing.bundles and not markers:
        from obs._core.errors import NotOurFileError

        raise NotOurFileError(f"no RDR bundle or marker under {root!r}", path=root)
    run_id = listing.bundles[0].run_id if listing.bundles else None
    newest: dict[int, BundleInfo] = {}
    for info in listing.bundles:  # newest first
        if info.run_id == run_id and info.rank not in newest and _is_rank(info.rank):
            newest[info.rank] = info
    other_runs = sorted({b.run_id for b in listing.bundles if b.run_id != run_id})
    rings = defaultdict(list)
    for ring in listing.rings:
        rings[_rank_of_folder(ring.path)].append(os.path.basename(ring.path))

    ranks, timelines, world, faults, unreadable, arrivals = [], {}, 1, [], {}, []
    for rank, info in sorted(newest.items()):
        try:
            state, timeline, size, fault, arrival = _read_rank(rank, info)
        except BAD_FILE as exc:
            problems.append(str(exc))
            unreadable[rank] = f"its newest bundle cannot be read: {exc}"
            continue
        ranks.append(state)
        timelines[rank] = timeline
        arrivals.append(arrival)
        world = max(world, size if _is_rank(size) else 1)
        faults += fault
    for marker in markers.values():
        size = marker.get("world_size")
        world = max(world, size if _is_rank(size) else 1)
    world = min(_MAX_RANKS, max([world] + [r + 1 for r in newest] + [r + 1 for r in markers]))
    have = {s.rank for s in ranks}
    no_bundle = [r for r in range(world) if r not in have]
    for r in no_bundle:
        ranks.append(RankState(r, None, note=unreadable.get(r) or _why_no_bundle(markers.get(r), rings.get(r),
                                                                                  run_id)))
    ranks.sort(key=lambda s: s.rank)

    out = Analysis(os.path.abspath(root), run_id, world, ranks, no_bundle, other_runs=other_runs, problems=problems)
    # a snapshot (a rank that went on after dumping) cannot tell about collectives begun after it was taken
    taken = {r: newest[r].created_ns if newest[r].reason in _SNAPSHOTS else _FOREVER for r in timelines}
    out.mismatches = _mismatches(timelines, world, taken, {s.rank: s.step for s in ranks if s.bundle})
    out.lineup = line_up(arrivals)
    out.stragglers = _stragglers(ranks, timelines, out.lineup)
    out.raised = [s.rank for s in ranks if s.exception]
    out.died = [s.rank for s in ranks if s.recovered]
    out.nan = min(faults, key=lambda f: (f["step"], f["t"])) if faults else None
    if not out.mismatches:
        out.stuck = _stuck(timelines)
    _verdict(out)
    return out


def _markers(root: str) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for path in near(root, "marker.json"):
        try:
            data = parse_json(safe_files.read_private(path), path)
        except BAD_FILE:
            continue
        if isinstance(data, dict) and _is_rank(data.get("rank")) and "unresolved" not in path:
            out.setdefault(data["rank"], data)
    return out


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _is_rank(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < _MAX_RANKS


def _rank_of_folder(path: str) -> int | None:
    for part in reversed(path.split(os.sep)):
        if part.startswith("rank_") and part[5:].isdigit():
            return int(part[5:])
    return None


def _why_no_bundle(marker: dict[str, Any] | None, rings: list[str] | None, run_id: str | None) -> str:
    if rings:
        return (f"no bundle; its ring {rings[0]} is left (the process died without dumping: killed?): "
                "run `obs rdr recover` on it, then analyze again")
    if marker is None:
        return "no bundle and no marker: the rank never started the recorder, or its files are elsewhere"
    state = marker.get("state")
    if marker.get("failed"):
        return f"its dump failed: {marker['failed']}"
    if marker.get("run_id") not in (None, run_id):
        return f"its marker is of another run ({marker.get('run_id')}), state {state!r}"
    if state == "running":
        return "no bundle; its marker still says running (the process died without a word, or is still running)"
    return f"no bundle; its marker says {state!r}"


def _read_rank(rank: int, info: BundleInfo) -> tuple[RankState, dict[str, dict[int, CollectiveRecord]], Any,
                                                   list[dict[str, Any]], RankTimeline]:
    bundle = load_bundle(info.path)
    timeline: dict[str, dict[int, CollectiveRecord]] = defaultdict(dict)
    faults: list[dict[str, Any]] = []
    last: CollectiveRecord | None = None
    times: list[dict[str, Any]] = []  # what recorder.arrival lines up: collectives, phases, step marks
    # bundles from this version on hold the few kinds read here in files of their own: events.jsonl is not parsed
    split = all(bundle.has(name) for name in ("collectives.jsonl", "steps.jsonl", "faults.jsonl"))
    events = itertools.chain(bundle.iter_events("collectives.jsonl"), bundle.newest_steps("steps.jsonl", STEP_WINDOW),
                             bundle.iter_events("faults.jsonl")) if split else \
        bundle.select({"collective", "fault", "phase", "step_begin", "step_end"})
    for event in events:
        if event["kind"] != "fault":
            times.append(event)
            if event["kind"] != "collective":
                continue
        if event["kind"] == "fault":
            if event.get("fault") in _NAN_FAULTS:
                faults.append({"rank": rank, "step": _int(event.get("step")), "t": event["t"],
                               "fault": str(event.get("fault")), "detail": str(event.get("detail", ""))})
            continue
        fields = parse_collective_desc(str(event.get("desc", "")))
        group, seq = str(fields.get("group", "?")), event.get("group_seq")
        if not isinstance(seq, int):
            continue
        before = timeline[group].get(seq)
        record = CollectiveRecord(group, seq, fields["op"], fields.get("sizes", []), fields.get("dtype"),
                                  str(event.get("state")), _int(event.get("step")),
                                  before.t if before else int(event["t"]), fields.get("ranks"))
        timeline[group][seq] = record
        last = record
    exc = bundle.exception
    text = f"{exc.get('type')}: {exc.get('message')}" if exc else None
    in_collective = bool(exc) and last is not None and last.state == "failed"
    state = RankState(rank, info.path, info.reason, info.step, bundle.manifest.get("host"), info.pid, info.recovered,
                      info.run_id, text, in_collective, last, where=_main_where(bundle.stacks))
    host = bundle.manifest.get("host")
    return state, dict(timeline), bundle.manifest.get("world_size"), faults, \
        timeline_from_events(rank, host if isinstance(host, str) else "", times)


def _members(group: str, records: dict[int, CollectiveRecord], world: int) -> list[int]:
    if ":p2p:" in group:
        pair = group.rsplit(":", 1)[1]
        if "-" in pair:
            lo, hi = pair.split("-", 1)
            if lo.isdigit() and hi.isdigit():
                return sorted({int(lo), int(hi)})
        return sorted(records)
    for record in records.values():
        if record.members:
            return sorted(record.members)
    return list(range(world)) if group == "default" else sorted(records)


def _mismatches(timelines: dict[int, dict[str, dict[int, CollectiveRecord]]], world: int,
                made: dict[int, int], steps: dict[int, int | None]) -> list[Mismatch]:
    groups = sorted({g for t in timelines.values() for g in t})
    found = []
    for group in groups:
        per_rank = {r: t.get(group, {}) for r, t in timelines.items()}
        sample = {r: next(iter(recs.values())) for r, recs in per_rank.items() if recs}
        members = [r for r in _members(group, sample, world) if r in timelines]
        if len(members) < 2:
            continue
        # a ring keeps only its newest collectives: compare from where every member's record starts
        lo = max((min(per_rank[r]) if per_rank[r] else 1) for r in members)
        hi = max((max(per_rank[r]) if per_rank[r] else 0) for r in members)
        for seq in sorted({q for r in members for q in per_rank[r] if lo <= q <= hi}):
            mismatch = _compare(group, seq, {r: per_rank[r] for r in members}, made, steps)
            if mismatch is not None:
                found.append(mismatch)
                break
    found.sort(key=lambda m: m.t)
    return found


def _compare(group: str, seq: int, per_rank: dict[int, dict[int, CollectiveRecord]],
             made: dict[int, int], steps: dict[int, int | None]) -> Mismatch | None:
    here = {r: recs.get(seq) for r, recs in per_rank.items()}
    present = {r: rec for r, rec in here.items() if rec is not None}
    first = min(present.values(), key=lambda rec: rec.t)
    missing = sorted(r for r, rec in here.items() if rec is None and made.get(r, 0) > first.t
                     and not _passed(seq, first.step, per_rank[r], steps.get(r)))
    if missing:
        sides = {first.describe(): sorted(present), "never reached it": missing}
        return Mismatch(group, seq, "missing", first.describe(), sides, missing, first.step, first.t,
                        f"rank(s) {_ranks(missing)} never reached {group} collective #{seq} ({first.op}), "
                        f"which rank(s) {_ranks(sorted(present))} entered")
    if len(present) < 2:
        return None
    by_sig: dict[tuple[Any, ...], list[int]] = defaultdict(list)
    for r, rec in sorted(present.items()):
        by_sig[rec.signature()].append(r)
    if len(by_sig) == 1:
        return None
    ordered = sorted(by_sig.values(), key=lambda rs: (-len(rs), rs[0]))
    majority = ordered[0]
    expected = present[majority[0]]
    sides = {present[rs[0]].describe(): rs for rs in ordered}
    culprits = sorted(r for rs in ordered[1:] for r in rs) if len(majority) > len(ordered[1]) else \
        sorted(present)
    odd = present[ordered[1][0]]
    kind = "op" if odd.op != expected.op and not ({odd.op, expected.op} <= _SEND | _RECV) else \
        "size" if odd.sizes != expected.sizes else "dtype"
    detail = "; ".join(f"rank(s) {_ranks(rs)} ran {present[rs[0]].describe()}" for rs in ordered)
    return Mismatch(group, seq, kind, expected.describe(), sides, culprits, expected.step, first.t,
                    f"{group} collective #{seq}: {kind} differs: {detail}")


def _passed(seq: int, step: int | None, records: dict[int, CollectiveRecord], rank_step: int | None) -> bool:
    """Whether a rank without a record of collective ``seq`` (of ``step``) went past it all the same: it recorded a
    later one of the group, or reached a later step.  A ring recovered after a kill holds no collective that
    PyTorch issued from C++ (DDP's buckets: they come from the Flight Recorder when a live process dumps)."""
    return any(q > seq for q in records) or (step is not None and rank_step is not None and rank_step > step)


def _stragglers(ranks: list[RankState], timelines: dict[int, dict[str, dict[int, CollectiveRecord]]],
                lineup: Lineup) -> list[Straggler]:
    steps = {s.rank: s.step or 0 for s in ranks if s.bundle}
    seqs = {r: max(t.get("default", {0: None})) for r, t in timelines.items()}
    if len(steps) < 2:
        return []
    top_step, top_seq = max(steps.values()), max(seqs.values(), default=0)
    late = {x.rank: x for x in lineup.stragglers}
    out = []
    for r in sorted(steps):
        behind = (top_step - steps[r], top_seq - seqs.get(r, 0))
        x = late.get(r)
        if x is not None:
            out.append(Straggler(r, *behind, x.score_s, x.phase, x.phases[x.phase] if x.phase else None))
        elif behind[0] > 0 or behind[1] > 0:
            out.append(Straggler(r, *behind))
    return out


def _stuck(timelines: dict[int, dict[str, dict[int, CollectiveRecord]]]) -> CollectiveRecord | None:
    """A collective that every rank entered and none finished (they all wait: a hang with no rank to blame)."""
    lasts = [t["default"][max(t["default"])] for t in timelines.values() if t.get("default")]
    if len(lasts) < 2 or len({(r.seq, r.signature()) for r in lasts}) != 1:
        return None
    return lasts[0] if all(r.state in ("scheduled", "started") for r in lasts) else None


def _verdict(out: Analysis) -> None:
    first_cause = [s.rank for s in out.ranks if s.exception and not s.raised_in_collective]
    if first_cause:
        out.culprits = first_cause
        state = next(s for s in out.ranks if s.rank == first_cause[0])
        out.verdict = f"rank(s) {_ranks(first_cause)} raised (step {state.step}): {state.exception}"
        if out.mismatches:
            out.verdict += f"; {out.mismatches[0].detail}"
    elif out.mismatches:
        out.culprits = out.mismatches[0].culprits
        out.verdict = out.mismatches[0].detail + _culprits_where(out)
    elif out.nan is not None:
        out.culprits = [out.nan["rank"]]
        out.verdict = f"rank {out.nan['rank']} saw the first NaN/Inf at step {out.nan['step']} ({out.nan['detail']})"
    elif out.died:  # no peer waited on it yet: the launcher stopped them first (or they had finished)
        out.culprits = list(out.died)
        dead = [s for s in out.ranks if s.recovered]
        steps = sorted({s.step for s in dead if s.step is not None})
        how = "a fatal signal" if all(s.reason == "fatal_signal" for s in dead) else "SIGKILL, OOM kill?"
        out.verdict = (f"rank(s) {_ranks(out.died)} died without dumping ({how})"
                       f"{' at step ' + _ranks(steps) if steps else ''}; the collectives on record agree (no rank "
                       "waited on it yet)")
    elif out.no_bundle:
        out.culprits = list(out.no_bundle)
        out.verdict = f"rank(s) {_ranks(out.no_bundle)} left no bundle"
    elif out.stuck is not None:
        out.verdict = (f"every rank waits in {out.stuck.group} collective #{out.stuck.seq} ({out.stuck.describe()}): "
                       "a hang with no rank to blame in the records")
    elif out.raised:
        out.culprits = list(out.raised)
        out.verdict = f"rank(s) {_ranks(out.raised)} failed in a collective"
    else:
        # a straggler slows the job without breaking it: named, not a culprit (the job stays consistent)
        late = [s for s in out.stragglers if s.lateness_s is not None]
        out.verdict = f"consistent: {len(out.ranks)} rank(s) agree on every collective on record" + \
            "".join(f"; {_late_text(s)}" for s in late)


def _main_where(stacks: list[dict[str, Any]]) -> str | None:
    """The innermost frame of the user's own code (not obs's, not a library's) on the main thread of a bundle's
    stacks, as ``file:line in function``; None when the main thread has none."""
    main = next((s for s in stacks if s.get("main") is True), None)
    if main is None:
        return None
    mine = [f for f in main["frames"] if not (is_hidden(f["file"]) or is_wrapper(f["file"]) or is_library(f["file"]))]
    if not mine:
        return None
    f = mine[-1]
    return f"{f['file']}:{f.get('line')} in {f['function']}"


def _culprits_where(out: Analysis) -> str:
    """``; rank 1 is at train.py:42 in spin`` for each culprit whose bundle is a snapshot it went on after (its stacks
    show where it was while the others waited; an ending's stacks show where it ended)."""
    said = ""
    for s in out.ranks:
        if s.rank in out.culprits and s.where and s.reason in _SNAPSHOTS:
            head, _, function = s.where.rpartition(" in ")
            file, _, line = head.rpartition(":")
            said += f"; rank {s.rank} is at {os.path.basename(file)}:{line} in {function}"
    return said


def _late_text(s: Straggler) -> str:
    where = f", its extra time in {PHASE_LABELS.get(s.phase, s.phase)} (+{s.phase_excess_s * 1e3:.1f} ms per step " \
        "against the others)" \
        if s.phase and s.phase_excess_s is not None else ""
    return (f"rank {s.rank} is a straggler: the others wait for it {(s.lateness_s or 0) * 1e3:.1f} ms per step at "
            f"collectives{where}")


def _ranks(ranks: list[int]) -> str:
    return ",".join(str(r) for r in ranks)
