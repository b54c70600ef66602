"""A job's ranks merged: ``obs monitor explain`` and ``show`` over the root holding the run folders of several ranks
(pure; the CLI renders).

**Which runs form the job** (:func:`find_job`).  Every run folder under the root is a candidate, with its
``monitor.json`` (rank, world size, pid, start time, host, the launcher's job id).  The anchor is the run that
started last.  When it names a job id, the job is the runs of that id; else the runs of its world size whose time
(from their start to their last step, :mod:`~obs.features.monitor.clock`'s ``step_times.csv``) overlaps the anchor's,
give or take :data:`SLACK_S`: the ranks of one job run at the same time, an earlier job's ran before.  Of each rank,
the run that started last is read (a hot reload starts a new run; the earlier ones are listed, not read).

**Clocks** are lined up as ``obs rdr analyze`` does: ranks on one host share its clock; each other host's offset is
the median difference of the end of the same optimizer step (:func:`~obs.features.monitor.clock.host_offsets`).
Every anomaly gets its step's end on the lowest rank's clock (``time``).

**Order** (:func:`explain_job`): each run's anomalies by its own rules, then all of them by step; within a step by
stage (forward, backward, the collectives, optimizer); within a stage by pipeline stage where ``monitor.json`` knows
it (``pp_stage``: forward from the first stage on, the others from the last, as msprobe orders them); then by place
(forward in module order, backward in reverse, the optimizer in its parameter order); then by rank.

**Where it began** (``scope``): the ranks holding anomalies of the first anomaly's file (``actv``, ``grad_reduced``,
...) in its step (``scope_ranks``): ``one rank`` (a bad data shard, a faulty device), ``some ranks``, or ``all
ranks`` of the job (``None`` with one rank read).  ``spread``: at that step, each file's anomalies and the ranks they
were on, in causal order, by stage, kind and file (on a bad shard: activations on one rank, then the gradients after
DDP's all-reduce on all).
"""

from __future__ import annotations

import itertools
import os
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from obs.features.monitor.clock import host_offsets, read_times
from obs.features.monitor.explain import Finding, Mover, Movers, findings, loss_after, movers_window, rules_of, scores
from obs.features.monitor.layout import RUN_FOLDER
from obs.features.monitor.reader import MonitorRun, list_runs, newest_write, read_meta, read_run

__all__ = ["SLACK_S", "Job", "JobExplanation", "RankRun", "Spread", "explain_job", "find_job", "job_movers",
           "read_job"]

#: how far apart (s) two runs' times may be and still overlap: the clocks of two hosts, a rank slow to start
SLACK_S = 120.0
_STAGES = {"forward": 0, "backward": 1, "communication": 2, "optimizer": 3}


@dataclass(frozen=True)
class _Candidate:
    folder: str
    rank: int | None
    meta: dict[str, Any]
    start: float
    end: float


@dataclass(frozen=True)
class Job:
    """The runs read (one per rank, ascending rank), the rule that chose them, and the runs left out."""

    root: str
    folders: list[str]
    rule: str
    left_out: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class RankRun:
    """One rank's run in the job: its folder, host, pipeline stage, clock offset and steps."""

    rank: int | None
    folder: str
    host: str | None
    pid: int | None
    pp_stage: int | None
    offset_s: float  #: its host's clock less the lowest rank's host's
    steps: int
    first_step: int | None
    last_step: int | None
    timed: bool  #: its step_times.csv was there (else its anomalies carry no time)


@dataclass(frozen=True)
class Spread:
    """At the first anomaly's step: one file's anomalies (``series``: actv, grad_reduced, ...) and their ranks."""

    step: int
    stage: str
    kind: str
    series: str
    ranks: list[int | None]
    count: int


@dataclass(frozen=True)
class JobExplanation:
    """The anomalies of a job's ranks in causal order (see the module's docstring for the order, ``scope`` and
    ``spread``); ``times[i]`` is ``anomalies[i]``'s step end on the lowest rank's clock (s since the epoch; None
    when its run has no step times)."""

    root: str
    rule: str
    window: tuple[int, int] | None
    first: Finding | None
    anomalies: list[Finding]
    times: list[float | None]
    loss_step: int | None
    lead_steps: int | None
    rules: list[str]
    ranks: list[RankRun]
    scope: str | None
    scope_ranks: list[int | None]
    spread: list[Spread]
    left_out: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        first = None
        if self.first is not None:
            first = {**self.first.as_dict(), "time": self.times[0]}
        return {"root": self.root, "rule": self.rule, "window": list(self.window) if self.window else None,
                "first": first,
                "anomalies": [{**a.as_dict(), "time": t} for a, t in zip(self.anomalies, self.times)],
                "loss_step": self.loss_step, "lead_steps": self.lead_steps, "rules": self.rules,
                "scope": self.scope, "scope_ranks": self.scope_ranks,
                "spread": [asdict(s) for s in self.spread],
                "ranks": [asdict(r) for r in self.ranks], "left_out": self.left_out, "problems": self.problems}


# -- which runs -------------------------------------------------------------------------------------------------
def _candidate(folder: str) -> _Candidate:
    meta = read_meta(folder, checked=False)  # read_run checks it, for the runs the job takes
    rank = meta.get("rank")
    if not isinstance(rank, int) or isinstance(rank, bool):
        match = RUN_FOLDER.fullmatch(os.path.basename(os.path.normpath(folder)))
        rank = int(match.group(2)) if match else None
    written = newest_write(folder)
    started = meta.get("started")
    start = written
    if isinstance(started, (int, float)) and not isinstance(started, bool) and abs(started) < 1e12:  # s since 1970
        start = float(started)
    times = read_times(folder)
    end = max(max(times.values()) / 1e9 if times else written, start)  # a copied folder's files are new
    return _Candidate(folder, rank, meta, start, end)


def find_job(root: str) -> Job:
    """The runs of the job under ``root`` that started last (see the module's docstring for the rule)."""
    candidates = [_candidate(f) for f in list_runs(root)]
    anchor = max(candidates, key=lambda c: (c.start, c.end, c.folder))
    job_id = anchor.meta.get("job")
    if isinstance(job_id, str) and job_id:
        members = [c for c in candidates if c.meta.get("job") == job_id]
        rule = f"the runs of job {job_id} (the launcher's id), the newest of each rank"
    else:
        world = anchor.meta.get("world_size")
        members = [c for c in candidates
                   if (c.meta.get("world_size") in (None, world) or world is None)
                   and c.start <= anchor.end + SLACK_S and c.end >= anchor.start - SLACK_S]
        rule = ("the runs that ran at the same time as the newest one (same world size), the newest of each rank")
    newest: dict[int | None, _Candidate] = {}
    for c in sorted(members, key=lambda c: (c.start, c.folder)):
        newest[c.rank] = c
    chosen = sorted(newest.values(), key=lambda c: (-1 if c.rank is None else c.rank, c.folder))
    kept = {c.folder for c in chosen}
    return Job(os.path.abspath(root), [c.folder for c in chosen], rule,
               sorted(c.folder for c in candidates if c.folder not in kept))


def read_job(job: Job) -> list[MonitorRun]:
    return [read_run(folder) for folder in job.folders]


# -- explain ------------------------------------------------------------------------------------------------------
def _pp(run: MonitorRun) -> int | None:
    value = run.meta.get("pp_stage")
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _host(run: MonitorRun) -> str:
    value = run.meta.get("host")
    return value if isinstance(value, str) else ""


def _rank_key(rank: int | None) -> int:
    return -1 if rank is None else rank


def explain_job(job: Job, runs: list[MonitorRun], *, step: int | None = None, span: int = 20) -> JobExplanation:
    """The anomalies of every rank's run, merged in causal order, where they began and how they spread."""
    times = {run.rank: read_times(run.folder) for run in runs}
    hosts = {run.rank: _host(run) for run in runs if run.rank is not None}
    offsets = host_offsets(hosts, {r: t for r, t in times.items() if r is not None})
    problems = [p for run in runs for p in run.problems] + _step_skew(runs, times, offsets)
    merged: list[tuple[tuple[Any, ...], Finding, float | None]] = []
    for run in runs:
        pp = _pp(run)
        shift = offsets.get(_host(run), 0)
        when = times.get(run.rank, {})
        for key, f in findings(run, step=step, span=span):
            stage = key[1]
            pipeline = 0 if pp is None else (pp if stage == 0 else -pp)
            t = when.get(f.step)
            merged.append(((*key[:2], pipeline, *key[2:6], _rank_key(run.rank), *key[6:]), f,
                           (t - shift) / 1e9 if t is not None else None))
    merged.sort(key=lambda item: item[0])
    anomalies = [f for _, f, _ in merged]
    first = anomalies[0] if anomalies else None
    loss_step, lead = loss_after(anomalies)
    all_ranks = sorted({run.rank for run in runs}, key=_rank_key)
    scope, scope_ranks, spread = None, [], []
    if first is not None:
        at_first = [f for f in anomalies if f.step == first.step]
        scope_ranks = sorted({f.rank for f in at_first if f.series == first.series}, key=_rank_key)
        if len(all_ranks) > 1:
            scope = ("all ranks" if len(scope_ranks) == len(all_ranks) else
                     "one rank" if len(scope_ranks) == 1 else "some ranks")
        groups: dict[tuple[str, str, str], list[Finding]] = {}
        for f in at_first:
            groups.setdefault((f.stage, f.kind, f.series), []).append(f)
        spread = [Spread(first.step, stage, kind, series, sorted({f.rank for f in fs}, key=_rank_key), len(fs))
                  for (stage, kind, series), fs in groups.items()]
    window = (step - span, step + span) if step is not None else None
    ranks = [_rank_run(run, times.get(run.rank, {}), offsets.get(_host(run), 0)) for run in runs]
    rules = sorted({r.name for run in runs for r in rules_of(run)}, key=lambda n: (n != "robust", n))
    return JobExplanation(job.root, job.rule, window, first, anomalies, [t for _, _, t in merged], loss_step, lead,
                          rules, ranks, scope, scope_ranks, spread, list(job.left_out), problems)


def _rank_run(run: MonitorRun, times: dict[int, int], offset: int) -> RankRun:
    steps = run.steps
    pid = run.meta.get("pid")
    return RankRun(run.rank, run.folder, _host(run) or None, pid if isinstance(pid, int) else None, _pp(run),
                   offset / 1e9, len(steps), steps[0] if steps else None, steps[-1] if steps else None, bool(times))


def _step_skew(runs: list[MonitorRun], times: dict[int | None, dict[int, int]], offsets: dict[str, int]) -> list[str]:
    """A rank whose steps end far from the lowest rank's same steps, clocks lined up: its step numbers are not the
    same steps (a run restarted, a rank that counts steps differently); anomalies are still ordered by number."""
    timed = [run for run in runs if times.get(run.rank)]
    if len(timed) < 2:
        return []
    ref = timed[0]
    ref_times = times[ref.rank]
    ends = sorted(ref_times.values())
    step_s = statistics.median([(b - a) / 1e9 for a, b in itertools.pairwise(ends)] or [0.0])
    out = []
    for run in timed[1:]:
        shift = offsets.get(_host(run), 0) - offsets.get(_host(ref), 0)
        diffs = [(t - shift - ref_times[s]) / 1e9 for s, t in times[run.rank].items() if s in ref_times]
        if not diffs:
            continue
        skew = statistics.median(diffs)
        if abs(skew) > max(1.0, 5 * step_s):
            out.append(f"rank {run.rank}'s steps end {skew:+.3g} s from rank {ref.rank}'s steps of the same number "
                       "(clocks lined up): they may not be the same steps (a run restarted?); anomalies are ordered "
                       "by step number")
    return out


# -- show ---------------------------------------------------------------------------------------------------------
def job_movers(job: Job, runs: list[MonitorRun], *, top: int = 6, step: int | None = None, rows: int = 12) -> Movers:
    """The ``top`` series of any rank that moved most (see :func:`~obs.features.monitor.explain.movers`), each with
    its rank, and their values over ``rows`` steps around ``step`` (default: the top one's peak)."""
    scored = [(score, run, series, at) for run in runs for score, series, at in scores(run)]
    scored.sort(key=lambda item: (-item[0], item[2].name, _rank_key(item[1].rank)))
    chosen = scored[:top]
    picked = [Mover(s.name, s.kind, s.stat, s.prefix, score, at, run.rank, s.micro) for score, run, s, at in chosen]
    center = step if step is not None or not chosen else chosen[0][3]
    return movers_window(job.root, picked, [s for _, _, s, _ in chosen], sorted({s for run in runs for s in run.steps}),
                         center, rows)
