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

import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from obs._core import safe_files
from obs._core.json_files import is_int, read_json
from obs._core.rank_folders import folder_rank, unresolved
from recorder import collective_table
from recorder.arrival import PHASE_LABELS, STEP_WINDOW, Lineup, RankTimeline, line_up, timeline_from_events
from recorder.bundle_reader import BAD_FILE, BundleInfo, list_bundles, load_bundle
from recorder.mismatch import Mismatch, mismatches
from recorder.rank_records import CollectiveRecord, Descriptions, RankCollectives, add_arrivals, rank_collectives
from recorder.ring_files import near
from recorder.stacks import is_hidden, is_library, is_wrapper

__all__ = ["Analysis", "CollectiveRecord", "Mismatch", "RankState", "Straggler", "analyze"]

_NAN_FAULTS = ("nan_inf",)  # the FAULT kind of obs.dump's NaN/Inf check
#: dump reasons after which the rank goes on (the others end it): a hang, obs.rdr.dump(), obs rdr snapshot, a peer's
#: hang request (recorder.requests)
_SNAPSHOTS = ("hang", "manual", "snapshot", "peer_hang")
_FOREVER = 1 << 63
_MAX_RANKS = 1 << 16  # a rank or world size beyond this in a file is damage, not a job


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

    ranks, collectives, world, faults, unreadable, arrivals = [], {}, 1, [], {}, []
    descs = Descriptions()
    for rank, info in sorted(newest.items()):
        try:
            state, records, size, fault, arrival = _read_rank(rank, info, descs)
        except BAD_FILE as exc:
            problems.append(str(exc))
            unreadable[rank] = f"its newest bundle cannot be read: {exc}"
            continue
        ranks.append(state)
        collectives[rank] = records
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
    taken = {r: newest[r].created_ns if newest[r].reason in _SNAPSHOTS else _FOREVER for r in collectives}
    out.mismatches = mismatches(collectives, descs, world, taken, {s.rank: s.step for s in ranks if s.bundle})
    out.lineup = line_up(arrivals)
    out.stragglers = _stragglers(ranks, collectives, out.lineup)
    out.raised = [s.rank for s in ranks if s.exception]
    out.died = [s.rank for s in ranks if s.recovered]
    out.nan = min(faults, key=lambda f: (f["step"], f["t"])) if faults else None
    if not out.mismatches:
        out.stuck = _stuck(collectives, descs)
    _verdict(out)
    return out


def _markers(root: str) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for path in near(root, "marker.json"):
        try:
            data = read_json(path, what="a rank's marker")
        except BAD_FILE:
            continue
        if _is_rank(data.get("rank")) and not unresolved(os.path.basename(os.path.dirname(os.path.dirname(path)))):
            out.setdefault(data["rank"], data)
    return out


def _int(value: Any) -> int:
    return value if is_int(value) else 0


def _is_rank(value: Any) -> TypeGuard[int]:
    return is_int(value) and 0 <= value < _MAX_RANKS


def _rank_of_folder(path: str) -> int | None:
    for part in reversed(path.split(os.sep)):
        rank = folder_rank(part)
        if rank is not None:
            return rank
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


def _read_rank(rank: int, info: BundleInfo, descs: Descriptions) \
        -> tuple[RankState, RankCollectives, Any, list[dict[str, Any]], RankTimeline]:
    bundle = load_bundle(info.path)
    host = bundle.manifest.get("host")
    host = host if isinstance(host, str) else ""
    faults: list[dict[str, Any]] = []
    # bundles from this version on hold the few kinds read here in files of their own (the collectives in columns,
    # collectives.bin): events.jsonl is not parsed; older bundles' lines are read into the same table
    if bundle.has(collective_table.FILE):
        path = os.path.join(info.path, collective_table.FILE)
        table = collective_table.decode(safe_files.read_private(path), path)
    elif bundle.has("collectives.jsonl"):
        table = collective_table.CollectiveTable.from_events(bundle.iter_events("collectives.jsonl"))
    else:
        table = collective_table.CollectiveTable.from_events(bundle.select({"collective"}))
    if bundle.has("steps.jsonl") and bundle.has("faults.jsonl"):
        marks = bundle.newest_steps("steps.jsonl", STEP_WINDOW)
        fault_events = bundle.iter_events("faults.jsonl")
    else:
        listed = list(bundle.select({"fault", "phase", "step_begin", "step_end"}))
        marks = [e for e in listed if e["kind"] != "fault"]
        fault_events = iter([e for e in listed if e["kind"] == "fault"])
    for event in fault_events:
        if event["kind"] == "fault" and event.get("fault") in _NAN_FAULTS:
            faults.append({"rank": rank, "step": _int(event.get("step")), "t": event["t"],
                           "fault": str(event.get("fault")), "detail": str(event.get("detail", ""))})
    collectives = rank_collectives(table, descs)
    timeline = timeline_from_events(rank, host, marks)
    newest = max([s for s, _ in timeline.steps.items()] or [int(table.rows["step"].max()) if len(table.rows) else 0])
    add_arrivals(timeline, table, descs, newest - STEP_WINDOW)
    last = collectives.last
    exc = bundle.exception
    text = f"{exc.get('type')}: {exc.get('message')}" if exc else None
    in_collective = bool(exc) and last is not None and last.state == "failed"
    state = RankState(rank, info.path, info.reason, info.step, host or None, info.pid, info.recovered,
                      info.run_id, text, in_collective, last, where=_main_where(bundle.stacks))
    return state, collectives, bundle.manifest.get("world_size"), faults, timeline


def _stragglers(ranks: list[RankState], collectives: dict[int, RankCollectives], lineup: Lineup) -> list[Straggler]:
    steps = {s.rank: s.step or 0 for s in ranks if s.bundle}
    seqs = {r: int(c.groups["default"].seq[-1]) if "default" in c.groups else 0 for r, c in collectives.items()}
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


def _stuck(collectives: dict[int, RankCollectives], descs: Descriptions) -> CollectiveRecord | None:
    """A collective that every rank entered and none finished (they all wait: a hang with no rank to blame)."""
    lasts = [c.groups["default"].record(len(c.groups["default"].seq) - 1, descs) for c in collectives.values()
             if "default" in c.groups]
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
