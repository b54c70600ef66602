"""A training job seen through Prometheus: every rank's step, throughput, phase times and memory, who is late and who
is stuck, from a handful of PromQL queries (each answers for all ranks at once; none is per rank).  For
``obs top --prometheus``: the live view of a job that spans nodes, where the rings are out of reach.

The ranks are the targets the exporters announce through file service discovery (:mod:`exporters.file_sd`): their
``run_id``, ``rank`` and ``node`` labels.  Over the last ``window`` (a PromQL duration), per rank:

- the mean step time (from its data loading to its end), the part of it spent in collectives, and the rest,
  ``busy``: in synchronous training every rank's step lasts as long as the slowest's, the others waiting for it in
  the collectives, so the time outside them tells the slow rank apart;
- a **straggler** (as the ``ObsStraggler`` rule, without its 10 minutes): busy over :data:`FACTOR` x the job's median
  rank's, and over the other ranks' median by at least the larger of :data:`recorder.arrival.MIN_LATE_S` and
  :data:`recorder.arrival.STEP_SHARE` of the median step (the ring-based view's noise floor); its **late phase**
  is the phase whose mean time exceeds the other ranks' median the most (its peers' wait for it shows in their
  phases, not in its own);
- **stuck** (as the ``ObsRankHung`` rule): no step finished for max(5 min, 20 x its median step time);
- **gone**: Prometheus cannot scrape it (``up == 0``) while its target is still announced.

Without a run id, the newest run (the latest start of its first rank) is shown.
"""

from __future__ import annotations

import re
import statistics
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from exporters.promql import Prometheus, PromQLError, Sample, finite
from recorder.arrival import MIN_LATE_S, STEP_SHARE, medians_of_others

__all__ = ["FACTOR", "HUNG_MIN_S", "HUNG_STEPS", "JobSeen", "PromQLError", "RankSeen", "read_job", "runs"]

#: a straggler's busy time per step against the job's median rank's (the ObsStraggler rule's factor)
FACTOR = 1.2
#: stuck: no step for max(HUNG_MIN_S, HUNG_STEPS x the rank's median step time) (the ObsRankHung rule's)
HUNG_MIN_S, HUNG_STEPS = 300.0, 20.0
_DURATION = re.compile(r"^([0-9]+(ms|s|m|h|d|w|y))+$")
_RUN_ID = re.compile(r"^[^\"\\\n]*$")
_PICK_AT_MOST = 256  # ranks named in a regex; more than that: the whole run's histograms are read


@dataclass
class RankSeen:
    """One rank, as Prometheus holds it (None: no sample in the window)."""

    rank: int
    host: str  #: its node
    instance: str  #: the ``host:port`` Prometheus scrapes
    alive: bool = True  #: Prometheus scraped it last time it tried
    step: int | None = None  #: the last finished step
    steps_per_s: float | None = None
    step_s: float | None = None  #: mean step time over the window
    collectives_s: float | None = None  #: of which in collectives
    busy_s: float | None = None  #: the rest
    phases_s: dict[str, float] = field(default_factory=dict)  #: mean time per step in each phase
    memory_used: dict[str, float] = field(default_factory=dict)  #: bytes per device
    memory_peak: dict[str, float] = field(default_factory=dict)
    since_step_s: float | None = None  #: seconds since the last step ended
    median_step_s: float | None = None  #: the median step time since the rank began (its histogram)
    stuck: bool = False
    behind: int = 0  #: steps behind the newest rank
    lateness_s: float | None = None  #: busy time per step over the other ranks' median
    straggler: bool = False
    late_phase: str | None = None
    phase_excess_s: dict[str, float] = field(default_factory=dict)  #: per phase, over the other ranks' median


@dataclass
class JobSeen:
    url: str
    taken_s: float
    run_id: str | None
    window: str
    runs: list[str] = field(default_factory=list)  #: every run Prometheus holds, newest first
    ranks: list[RankSeen] = field(default_factory=list)
    threshold_s: float = MIN_LATE_S  #: the least lateness of a straggler
    queries: int = 0  #: PromQL queries it took

    @property
    def waited_for(self) -> list[int]:
        """The ranks the others wait for: stragglers and stuck ranks."""
        return sorted(r.rank for r in self.ranks if r.straggler or r.stuck)

    @property
    def gone(self) -> list[int]:
        return sorted(r.rank for r in self.ranks if not r.alive)


def runs(prometheus: Prometheus) -> list[str]:
    """The run ids of every job Prometheus holds now, newest first (by the start of its first rank)."""
    found = prometheus.query('min by (run_id) (obs_start_time_seconds{run_id!=""})')
    return [s.labels["run_id"] for s in sorted(found, key=lambda s: -s.value)]


def read_job(prometheus: Prometheus, run_id: str | None = None, *, window: str = "1m",
             now_s: float | None = None) -> JobSeen:
    """Every rank of run ``run_id`` (default: the newest).  ValueError for a bad window or run id; PromQLError when a
    query fails; a run Prometheus does not hold gives a job without ranks."""
    if not _DURATION.match(window):
        raise ValueError(f"--window must be a PromQL duration such as 30s, 1m or 5m (got {window!r})")
    if run_id is not None and not _RUN_ID.match(run_id):
        raise ValueError(f"--run must be a run id without quotes, backslashes or newlines (got {run_id!r})")
    at = time.time() if now_s is None else now_s
    known = runs(prometheus)
    job = JobSeen(prometheus.url, at, run_id if run_id is not None else (known[0] if known else None), window,
                  known, queries=1)
    if job.run_id is None or job.run_id not in known:
        return job
    sel = f'run_id="{job.run_id}"'
    w = window
    # Only the step and up queries carry node and instance: the others answer per rank, half the labels to send and
    # parse.  The time since each rank's last step first: the median step time (18 buckets a rank, the costliest
    # query) is asked, with the others, only of the ranks that may be stuck: those without a step for HUNG_MIN_S,
    # where the stuck threshold max(HUNG_MIN_S, 20 x median) starts.
    since = prometheus.query(f"{at:.3f} - max by (rank) (obs_step_end_time_seconds{{{sel}}})", at=at)
    late = sorted({s.labels.get("rank", "") for s in since if s.value > HUNG_MIN_S and
                   s.labels.get("rank", "").isdigit()})
    queries = {
        "step": f"max by (rank, node, instance) (obs_step{{{sel}}})",
        "up": f"min by (rank, node, instance) (up{{{sel}}})",
        "rate": f"max by (rank) (obs_steps_per_second{{{sel}}})",
        "step_s": f"sum by (rank) (rate(obs_step_duration_seconds_sum{{{sel}}}[{w}])) / sum by (rank) "
                  f"(rate(obs_step_duration_seconds_count{{{sel}}}[{w}]))",
        "collectives_s": f"sum by (rank) (rate(obs_step_collectives_duration_seconds_sum{{{sel}}}[{w}])) / sum by "
                         f"(rank) (rate(obs_step_collectives_duration_seconds_count{{{sel}}}[{w}]))",
        "phases": f"sum by (rank, phase) (rate(obs_step_phase_duration_seconds_sum{{{sel}}}[{w}])) / sum by (rank, "
                  f"phase) (rate(obs_step_phase_duration_seconds_count{{{sel}}}[{w}]))",
        "memory": f'max by (rank, device, __name__) ({{__name__=~"obs_memory_(used|peak)_bytes", {sel}}})',
    }
    if late:
        ranks = f',rank=~"{"|".join(late)}"' if len(late) <= _PICK_AT_MOST else ""
        queries["median"] = (f"histogram_quantile(0.5, sum by (rank, le) "
                             f"(obs_step_duration_seconds_bucket{{{sel}{ranks}}}))")
    answers = {"since": since, **_ask(prometheus, queries, at)}
    job.queries += 1 + len(queries)
    job.ranks = _ranks(answers)
    _judge(job)
    return job


def _ask(prometheus: Prometheus, queries: Mapping[str, str], at: float) -> dict[str, list[Sample]]:
    """The queries at once (Prometheus evaluates them in parallel)."""
    with ThreadPoolExecutor(len(queries)) as pool:
        futures = {name: pool.submit(prometheus.query, expr, at=at) for name, expr in queries.items()}
        return {name: future.result() for name, future in futures.items()}


def _ranks(answers: Mapping[str, list[Sample]]) -> list[RankSeen]:
    ranks: dict[int, RankSeen] = {}

    def row(sample: Sample) -> RankSeen | None:
        labels = sample.labels
        try:
            rank = int(labels.get("rank", ""))
        except ValueError:
            return None  # not announced by an obs exporter
        if rank not in ranks:
            ranks[rank] = RankSeen(rank, "", "")
        seen = ranks[rank]
        seen.host = seen.host or labels.get("node", "")
        seen.instance = seen.instance or labels.get("instance", "")
        return seen

    for name, samples in answers.items():
        for sample in samples:
            r = row(sample)
            if r is None:
                continue
            value = finite(sample.value)
            if name == "up":
                r.alive = sample.value == 1
            elif name == "step" and value is not None:
                r.step = int(value)
            elif name == "since":
                r.since_step_s = value
            elif name == "rate":
                r.steps_per_s = value
            elif name == "step_s":
                r.step_s = value
            elif name == "collectives_s":
                r.collectives_s = value
            elif name == "median":
                r.median_step_s = value
            elif name == "phases" and value is not None:
                r.phases_s[sample.labels.get("phase", "?")] = value
            elif name == "memory" and value is not None:
                kind = r.memory_used if sample.labels.get("__name__") == "obs_memory_used_bytes" else r.memory_peak
                kind[sample.labels.get("device", "?")] = value
    for r in ranks.values():
        if r.step_s is not None:
            r.busy_s = max(0.0, r.step_s - (r.collectives_s or 0.0))
    return [ranks[k] for k in sorted(ranks)]


def _judge(job: JobSeen) -> None:
    """Stuck ranks, steps behind, stragglers and their late phase."""
    ranks = job.ranks
    stepped = [r for r in ranks if r.step is not None]
    lead = max(stepped, key=lambda r: r.step or 0, default=None)
    for r in ranks:
        if r.since_step_s is not None:
            r.stuck = r.since_step_s > max(HUNG_MIN_S, HUNG_STEPS * (r.median_step_s or 0.0))
        if lead is not None and lead.step is not None and r.step is not None:
            r.behind = lead.step - r.step - _scrape_skew_steps(r, lead)
    timed = {r.rank: r.busy_s for r in ranks if r.busy_s is not None}
    if len(timed) < 2:
        return
    median_busy = statistics.median(timed.values())
    median_step = statistics.median(r.step_s for r in ranks if r.step_s is not None)
    job.threshold_s = max(MIN_LATE_S, STEP_SHARE * median_step)
    others = medians_of_others(timed)
    excess = _phase_excess(ranks)
    for r in ranks:
        if r.busy_s is None:
            continue
        r.lateness_s = r.busy_s - others[r.rank]
        r.phase_excess_s = excess.get(r.rank, {})
        r.straggler = r.busy_s > FACTOR * median_busy and r.lateness_s >= job.threshold_s
        if r.straggler and r.phase_excess_s:
            phase = max(r.phase_excess_s, key=r.phase_excess_s.__getitem__)
            r.late_phase = phase if r.phase_excess_s[phase] > 0 else None


def _scrape_skew_steps(r: RankSeen, lead: RankSeen) -> int:
    """The steps that ``r`` reads behind ``lead`` only because Prometheus scraped it earlier (ranks are scraped at
    different instants: at 60 steps/s, half a second apart is 30 steps): ``lead``'s rate over how much longer ago
    ``r``'s last step ended.  0 for a stuck rank, whose steps behind are real."""
    if r.stuck or r.since_step_s is None or lead.since_step_s is None or not lead.steps_per_s:
        return 0
    skew = int(lead.steps_per_s * max(0.0, r.since_step_s - lead.since_step_s) + 0.5)
    return min(skew, (lead.step or 0) - (r.step or 0))


def _phase_excess(ranks: Iterable[RankSeen]) -> dict[int, dict[str, float]]:
    """Per rank and phase: its mean time less the other ranks' median."""
    by_phase: dict[str, dict[int, float]] = defaultdict(dict)
    for r in ranks:
        for phase, took in r.phases_s.items():
            by_phase[phase][r.rank] = took
    out: dict[int, dict[str, float]] = defaultdict(dict)
    for phase, values in by_phase.items():
        if len(values) < 2:
            continue
        for rank, median in medians_of_others(values).items():
            out[rank][phase] = values[rank] - median
    return out
