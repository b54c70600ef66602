"""Stragglers by arrival: line the ranks up per collective and say which rank the others wait for, and where its
time went.  Pure: per-rank timelines in, a :class:`Lineup` out (used by ``obs rdr analyze`` and ``obs top``).

A collective completes when its last member arrives, and every member leaves it then.  So:

* **clock offsets** between hosts are the median difference of the ranks' leave times over the collectives
  they share (ranks on one host share its clock);
* a rank's **lateness** at one collective is its entry time (offset removed) less the earliest member's: a rank
  that is slow at every step stands out even when it never falls behind (DDP: its peers absorb the delay while
  they wait in the all_reduce);
* **where the time went**: per step and phase (data, forward, backward, optimizer, and ``other`` for the rest of
  the step since the previous one ended), the time the rank was busy, that is the phase's length less the time it
  waited in collectives, against the median of the other ranks; the phase with the largest excess is the
  straggler's.
"""

from __future__ import annotations

import bisect
import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from obs._core.json_files import is_int
from recorder.collective_desc import COLLECTIVE_STATES, parse_collective_desc
from recorder.layout import PHASE_NAMES, Kind

__all__ = ["PHASE_LABELS", "STEP_WINDOW", "Arrival", "Lateness", "Lineup", "Phase", "RankTimeline", "line_up",
           "medians_of_others", "timeline_from_contents", "timeline_from_events"]

#: the newest steps lined up
STEP_WINDOW = 50
#: a rank is a straggler when, over at least MIN_STEPS steps, its median lateness per step is at least all of:
#: MIN_LATE_S, FACTOR x the other ranks' median, and STEP_SHARE of the median step time (a few ms late on a 10 s
#: step is noise)
MIN_LATE_S, FACTOR, STEP_SHARE, MIN_STEPS = 0.010, 3.0, 0.05, 5
#: a step's time outside every recorded phase: the user's code between them, and the time since the previous step
#: ended (data loading, where the loop does not use obs.steps, which records it as the data phase)
OTHER = "other"
#: how a phase is named in a sentence
PHASE_LABELS = {"data": "data loading", OTHER: "the rest of the step (outside the recorded phases: data loading "
                                               "without obs.steps, the loop's own code)"}
_OPEN = ("scheduled", "started")
_DONE = ("completed", "failed")


@dataclass(frozen=True)
class Arrival:
    """One rank's record of one collective: when it entered and left (wall ns), and whether it is over (``leave``
    is None while the rank waits, and for a collective PyTorch's Flight Recorder saw end without a time)."""

    group: str
    seq: int
    op: str
    enter: int
    leave: int | None
    done: bool = False
    step: int = 0  #: the training step it belongs to (0: before the first step: start-up, not lined up)


@dataclass(frozen=True)
class Phase:
    step: int
    name: str
    begin: int
    end: int


@dataclass
class RankTimeline:
    """What one rank recorded: its collectives by (group, seq), its phases, and each step's (begin, end)."""

    rank: int
    host: str = ""
    arrivals: dict[tuple[str, int], Arrival] = field(default_factory=dict)
    phases: list[Phase] = field(default_factory=list)
    steps: dict[int, tuple[int, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class Lateness:
    """One rank lined up: its median lateness per step (s) over ``steps`` steps (per step, the sum over the step's
    collectives of its entry less the earliest member's), the share of those steps it was the latest in, and its
    extra busy time per step in each phase against the other ranks' median (s; negative: less)."""

    rank: int
    score_s: float
    last_share: float
    steps: int
    phases: dict[str, float]
    phase: str | None  #: a straggler's phase with the largest excess (None: not a straggler, or no phase exceeds)
    straggler: bool


@dataclass
class Lineup:
    ranks: list[Lateness] = field(default_factory=list)
    offsets_s: dict[str, float] = field(default_factory=dict)  #: each host's clock against the lowest rank's host
    collectives: int = 0  #: collectives lined up
    steps: int = 0  #: steps they belong to
    threshold_s: float = MIN_LATE_S

    @property
    def stragglers(self) -> list[Lateness]:
        return sorted((r for r in self.ranks if r.straggler), key=lambda r: -r.score_s)


# -- timelines ---------------------------------------------------------------------------------------------------
def timeline_from_events(rank: int, host: str, events: Iterable[Mapping[str, Any]], *,
                         steps: int = STEP_WINDOW) -> RankTimeline:
    """A rank's timeline over its newest ``steps`` steps (and the one before) from a bundle's events
    (``collective``, ``phase``, ``step_begin``, ``step_end``; others are skipped).  A collective read from PyTorch's
    Flight Recorder is one line: entered at ``t``, left ``duration_ns`` later; obs's own records are one line at
    entry and one at the end."""
    out = RankTimeline(rank, host)
    entered: dict[tuple[str, int], tuple[int, str, int]] = {}  # (group, seq) -> entry time, op, step
    listed = list(events)
    newest = max((e["step"] for e in listed if is_int(e.get("step"))), default=0)
    for event in listed:
        if is_int(event.get("step")) and event["step"] < newest - steps:
            continue
        kind, t = event.get("kind"), event.get("t")
        if not is_int(t):
            continue
        if kind == "collective":
            seq = event.get("group_seq")
            if not is_int(seq):
                continue
            fields = parse_collective_desc(str(event.get("desc", "")))
            key, state = (str(fields.get("group", "?")), seq), event.get("state")
            step = event.get("step")
            step = step if is_int(step) else 0
            if state in _OPEN:
                if key not in entered:
                    entered[key] = (t, fields["op"], step)
                    out.arrivals[key] = Arrival(key[0], seq, fields["op"], t, None, False, step)
            elif state in _DONE:
                took = event.get("duration_ns")
                if key in entered:
                    enter, op, step = entered[key]
                    out.arrivals[key] = Arrival(key[0], seq, op, enter, t, True, step)
                else:
                    took = took if is_int(took) and took > 0 else None
                    out.arrivals[key] = Arrival(key[0], seq, fields["op"], t, None if took is None else t + took, True,
                                                step)
        elif kind == "phase":
            begin, end, step = event.get("begin_t"), event.get("end_t"), event.get("step")
            if is_int(begin) and is_int(end) and is_int(step) and end >= begin:
                out.phases.append(Phase(step, str(event.get("phase")), begin, end))
        elif kind in ("step_begin", "step_end") and is_int(event.get("step")):
            _mark_step(out, event["step"], t, kind == "step_end")
    return out


def timeline_from_contents(contents: Any, *, steps: int = STEP_WINDOW) -> RankTimeline:
    """A rank's timeline over its newest ``steps`` steps (and the one before: its end starts the first's cycle),
    from a ring's contents (:class:`recorder.ring_reader.RingContents`: a live ring or a dead process's)."""
    header = contents.header
    shift = header.wall_ns - header.mono_ns
    host = header.meta.get("host")
    out = RankTimeline(header.rank, host if isinstance(host, str) else "")
    slots = contents.slots
    wanted = slots[(slots["kind"] == Kind.COLLECTIVE) | (slots["kind"] == Kind.PHASE)
                   | (slots["kind"] == Kind.STEP_BEGIN) | (slots["kind"] == Kind.STEP_END)]
    # the step of each slot: a step mark's own (b), else the step it happened in
    of = np.where(np.isin(wanted["kind"], (Kind.STEP_BEGIN, Kind.STEP_END, Kind.PHASE)), wanted["b"],
                  contents.steps(wanted["seq"]))
    if len(of):
        keep = of >= int(of.max()) - steps
        wanted, of = wanted[keep], of[keep]
    descs: dict[int, dict[str, Any]] = {}
    for kind, t, a, b, c, d, step in zip(wanted["kind"].tolist(), wanted["t"].tolist(), wanted["a"].tolist(),
                                         wanted["b"].tolist(), wanted["c"].tolist(), wanted["d"].tolist(),
                                         of.tolist()):
        wall = t + shift
        if kind == Kind.COLLECTIVE:
            fields = descs.get(a)
            if fields is None:
                fields = descs[a] = parse_collective_desc(contents.string(a))
            key = (str(fields.get("group", "?")), b)
            state = COLLECTIVE_STATES[d] if 0 <= d < len(COLLECTIVE_STATES) else "?"
            before = out.arrivals.get(key)
            if state in _OPEN and before is None:
                out.arrivals[key] = Arrival(key[0], b, fields["op"], wall, None, False, step)
            elif state in _DONE:
                enter = before.enter if before is not None else wall - max(c, 0)
                out.arrivals[key] = Arrival(key[0], b, fields["op"], enter, wall, True,
                                            before.step if before is not None else step)
        elif kind == Kind.PHASE:
            if d >= c:
                out.phases.append(Phase(b, PHASE_NAMES[a] if 0 <= a < len(PHASE_NAMES) else f"phase_{a}",
                                        c + shift, d + shift))
        else:
            _mark_step(out, b, wall, kind == Kind.STEP_END)
    return out


def _mark_step(out: RankTimeline, step: int, t: int, end: bool) -> None:
    begin, finish = out.steps.get(step, (t, t))
    out.steps[step] = (begin, t) if end else (t, max(finish, t))


# -- lining up ---------------------------------------------------------------------------------------------------
def line_up(timelines: Iterable[RankTimeline], *, step_window: int = STEP_WINDOW) -> Lineup:
    """Line the ranks up over the newest ``step_window`` steps: the collectives two or more of them finished there
    (start-up's, before the first step, are left out: they time imports and initialisation, not training)."""
    ranks = {t.rank: t for t in timelines}
    if len(ranks) < 2:
        return Lineup()
    offsets = _host_offsets(ranks)
    shared: dict[tuple[str, int], dict[int, int]] = defaultdict(dict)
    for r, tl in ranks.items():
        shift = offsets.get(tl.host, 0)
        for key, arrival in tl.arrivals.items():
            if arrival.step > 0:
                shared[key][r] = arrival.enter - shift
    done = {key for tl in ranks.values() for key, a in tl.arrivals.items() if a.done}
    lined = [key for key, enters in shared.items() if len(enters) > 1 and key in done]
    # Each rank waits in a collective from its entry until the last member arrives (they all leave then): the
    # model gives the wait where a record has no end time (the Flight Recorder's gloo entries).
    waits: dict[int, list[tuple[int, int | None]]] = defaultdict(list)
    step_of: dict[tuple[str, int], int] = {}
    for key in lined:
        enters = shared[key]
        final = max(enters.values())
        for r in enters:
            arrival = ranks[r].arrivals[key]
            step_of[key] = max(step_of.get(key, 0), arrival.step)
            waits[r].append((arrival.enter, max(arrival.leave or arrival.enter, final + offsets.get(ranks[r].host, 0))))
    steps = sorted(set(step_of.values()))[-step_window:]
    newest = set(steps)
    # A rank's lateness in a step: the sum, over the step's collectives, of its entry less the earliest member's.
    late: dict[int, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    counted = 0
    for key in lined:
        if step_of[key] not in newest:
            continue
        counted += 1
        enters = shared[key]
        first = min(enters.values())
        for r, t in enters.items():
            late[r][step_of[key]] += (t - first) / 1e9
    last: dict[int, int] = defaultdict(int)
    for step in steps:
        present = {r: per[step] for r, per in late.items() if step in per}
        if present and max(present.values()) > 0:
            last[max(present, key=present.__getitem__)] += 1
    busy = {r: _busy(tl, step_window, waits[r]) for r, tl in ranks.items()}
    step_s = statistics.median([(e - b) / 1e9 for tl in ranks.values() for b, e in tl.steps.values()] or [0.0])
    scores = {r: statistics.median(late[r].values()) if late[r] else 0.0 for r in ranks}
    out = Lineup(offsets_s={h: o / 1e9 for h, o in offsets.items()}, collectives=counted, steps=len(steps))
    out.threshold_s = max(MIN_LATE_S, STEP_SHARE * step_s)
    others = medians_of_others(scores)
    excesses = _excesses(busy)
    for r in sorted(ranks):
        excess = excesses.get(r, {})
        phase = max(excess, key=excess.__getitem__) if excess else None
        straggler = len(late[r]) >= MIN_STEPS and scores[r] >= out.threshold_s and scores[r] >= FACTOR * others[r]
        named = phase if straggler and phase is not None and excess[phase] > 0 else None
        out.ranks.append(Lateness(r, scores[r], last[r] / len(late[r]) if late[r] else 0.0, len(late[r]),
                                  excess, named, straggler))
    return out


def _host_offsets(ranks: Mapping[int, RankTimeline]) -> dict[str, int]:
    """Each host's clock minus the lowest rank's host's, in ns: the median difference of leave times."""
    hosts: dict[str, list[RankTimeline]] = defaultdict(list)
    for r in sorted(ranks):
        hosts[ranks[r].host].append(ranks[r])
    if len(hosts) < 2:
        return {}
    ref_host = ranks[min(ranks)].host
    ref: dict[tuple[str, int], list[int]] = defaultdict(list)
    for tl in hosts[ref_host]:
        for key, a in tl.arrivals.items():
            if a.leave is not None:
                ref[key].append(a.leave)
    ref_leave = {key: statistics.median(v) for key, v in ref.items()}
    out = {ref_host: 0}
    for host, tls in hosts.items():
        if host == ref_host:
            continue
        diffs = [a.leave - ref_leave[key] for tl in tls for key, a in tl.arrivals.items()
                 if a.leave is not None and key in ref_leave]
        out[host] = int(statistics.median(diffs)) if diffs else 0
    return out


def _busy(tl: RankTimeline, step_window: int, lined: list[tuple[int, int | None]]) -> dict[int, dict[str, float]]:
    """Per step of the newest ``step_window``: seconds busy in each phase (its length less the time spent waiting
    in collectives: ``lined``, and the rank's other records with an end), and in ``other`` (the rest of the
    step)."""
    waits = _merged(lined + [(a.enter, a.leave) for a in tl.arrivals.values() if a.leave is not None])
    starts = [w[0] for w in waits]
    cumulative = [0]
    for b, e in waits:
        cumulative.append(cumulative[-1] + e - b)

    def waited(begin: int, end: int) -> int:
        return _overlap(waits, starts, cumulative, begin, end)

    phases: dict[int, list[Phase]] = defaultdict(list)
    for p in tl.phases:
        phases[p.step].append(p)
    steps = sorted(set(phases) | set(tl.steps))[-step_window:]
    out: dict[int, dict[str, float]] = {}
    for step in steps:
        row: dict[str, float] = {}
        inside = 0
        for p in phases.get(step, ()):
            took = p.end - p.begin
            row[p.name] = row.get(p.name, 0.0) + (took - waited(p.begin, p.end)) / 1e9
            inside += took - waited(p.begin, p.end)
        if step in tl.steps:
            # the step's cycle: from the previous step's end (the time between steps is the next one's, data
            # loading where obs.steps does not mark it), else from its begin or its data phase
            begin, end = tl.steps[step]
            before = tl.steps.get(step - 1)
            begin = before[1] if before is not None and before[1] <= begin else \
                min([begin] + [p.begin for p in phases.get(step, ()) if p.name == "data"])
            if end > begin:
                row[OTHER] = max(0.0, (end - begin - waited(begin, end) - inside) / 1e9)
        out[step] = row
    return out


def medians_of_others(values: Mapping[Any, float]) -> dict[Any, float]:
    """For each key, the median of the other keys' values (one sort for all: n keys in O(n log n))."""
    order = sorted(values, key=values.__getitem__)
    ranked = [values[k] for k in order]
    m = len(ranked) - 1  # how many others each key has
    if m < 1:
        return {k: 0.0 for k in order}

    def nth(k: int, skip: int) -> float:  # the k-th smallest value once the one at ``skip`` is left out
        return ranked[k] if k < skip else ranked[k + 1]

    out = {}
    for i, key in enumerate(order):
        out[key] = nth(m // 2, i) if m % 2 else (nth(m // 2 - 1, i) + nth(m // 2, i)) / 2
    return out


def _excesses(busy: Mapping[int, dict[int, dict[str, float]]]) -> dict[int, dict[str, float]]:
    """Per rank and phase: the median over steps of the rank's busy time less the other ranks' median at that step."""
    cells: dict[tuple[int, str], dict[int, float]] = defaultdict(dict)  # (step, phase) -> rank -> busy
    for rank, rows in busy.items():
        for step, row in rows.items():
            for phase, took in row.items():
                cells[(step, phase)][rank] = took
    diffs: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for (_step, phase), by_rank in cells.items():
        if len(by_rank) < 2:
            continue
        for rank, theirs in medians_of_others(by_rank).items():
            diffs[rank][phase].append(by_rank[rank] - theirs)
    return {rank: {phase: statistics.median(d) for phase, d in per.items()} for rank, per in diffs.items()}


def _merged(intervals: list[tuple[int, int | None]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for b, e in sorted((b, e) for b, e in intervals if e is not None and e > b):
        if out and b <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((b, e))
    return out


def _overlap(waits: list[tuple[int, int]], starts: list[int], cumulative: list[int], begin: int, end: int) -> int:
    """ns of the merged ``waits`` inside [begin, end)."""
    if end <= begin or not waits:
        return 0
    lo = max(0, bisect.bisect_right(starts, begin) - 1)
    hi = bisect.bisect_left(starts, end)
    if hi <= lo:
        return 0
    total = cumulative[hi] - cumulative[lo]
    first_b, first_e = waits[lo]
    total -= max(0, min(first_e, begin) - first_b)  # the part of the first interval before begin
    last_b, last_e = waits[hi - 1]
    total -= max(0, last_e - max(last_b, end))  # the part of the last interval after end
    return max(0, total)


