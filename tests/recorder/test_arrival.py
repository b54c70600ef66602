"""recorder.arrival: ranks lined up per collective, host clock offsets, lateness, where the straggler's time went."""

from __future__ import annotations

import random

import pytest

from recorder.arrival import Arrival, Phase, RankTimeline, line_up, timeline_from_events

MS = 1_000_000


def _job(ranks=3, steps=20, slow=None, slow_phase="data", host_of=lambda r: "h0", clock_of=lambda r: 0,
         leave_known=True, jitter_ms=0.0, seed=0):
    """Synthetic timelines: each step data (1 ms), forward (10 ms), backward (20 ms), then one all_reduce that
    every rank leaves when the last one arrives, then optimizer (2 ms).  ``slow`` takes 100 ms more in
    ``slow_phase``; ``clock_of(r)`` shifts a rank's clock (its host's)."""
    rng = random.Random(seed)
    out = [RankTimeline(r, host_of(r)) for r in range(ranks)]
    t0 = 10**12
    for step in range(1, steps + 1):
        lengths = {}
        for r in range(ranks):
            ph = {"data": 1 * MS, "forward": 10 * MS, "backward": 20 * MS}
            if r == slow:
                ph[slow_phase] += 100 * MS
            for name in ph:
                ph[name] += int(rng.uniform(0, jitter_ms) * MS)
            lengths[r] = ph
        arrive = {r: t0 + sum(lengths[r].values()) for r in range(ranks)}
        leave = max(arrive.values()) + MS
        for r, tl in enumerate(out):
            shift, at = clock_of(r), t0
            for name, took in lengths[r].items():
                tl.phases.append(Phase(step, name, at + shift, at + took + shift))
                at += took
            tl.arrivals[("default", step)] = Arrival("default", step, "all_reduce", arrive[r] + shift,
                                                     leave + shift if leave_known else None, True, step)
            tl.phases.append(Phase(step, "optimizer", leave + shift, leave + 2 * MS + shift))
            tl.steps[step] = (t0 + lengths[r]["data"] + shift, leave + 3 * MS + shift)
        t0 = leave + 5 * MS
    return out


@pytest.mark.parametrize("phase", ["data", "forward", "backward"])
def test_a_slow_rank_is_named_with_the_phase_its_time_went_to(phase):
    lineup = line_up(_job(slow=2, slow_phase=phase))
    assert [x.rank for x in lineup.stragglers] == [2]
    late = lineup.stragglers[0]
    assert late.phase == phase
    assert late.score_s == pytest.approx(0.1, abs=1e-6)
    assert late.last_share == 1.0 and late.steps == 20
    assert late.phases[phase] == pytest.approx(0.1, abs=1e-6)
    # the ranks that waited are not stragglers, and their waits are not counted as their busy time
    for x in lineup.ranks[:2]:
        assert not x.straggler and x.phase is None and x.score_s == 0
        assert x.phases["optimizer"] == pytest.approx(0, abs=1e-9)


def test_waits_without_an_end_time_follow_from_the_last_arrival():
    """The Flight Recorder's gloo entries have no end time: every member is taken to leave when the last arrives."""
    lineup = line_up(_job(slow=1, slow_phase="backward", leave_known=False))
    assert [(x.rank, x.phase) for x in lineup.stragglers] == [(1, "backward")]


def test_host_clock_offsets_come_from_the_leave_times():
    hosts = {0: "a", 1: "a", 2: "b", 3: "b"}
    lineup = line_up(_job(ranks=4, slow=3, host_of=hosts.get, clock_of=lambda r: 7_000 * MS if r >= 2 else 0))
    assert lineup.offsets_s == {"a": 0.0, "b": pytest.approx(7.0)}
    assert [x.rank for x in lineup.stragglers] == [3]
    assert lineup.stragglers[0].score_s == pytest.approx(0.1, abs=1e-6)


def test_jitter_alone_names_no_straggler():
    lineup = line_up(_job(ranks=8, steps=40, jitter_ms=3.0, seed=4))
    assert lineup.stragglers == []
    assert (lineup.collectives, lineup.steps) == (40, 40)


def test_start_up_collectives_and_short_runs_name_no_straggler():
    """Collectives before the first step time imports and initialisation; under 5 steps nothing is said."""
    job = _job(slow=2, steps=4)
    assert line_up(job).stragglers == [] and line_up(job).steps == 4
    for tl in _job(slow=2):
        tl.arrivals = {k: Arrival(a.group, a.seq, a.op, a.enter, a.leave, a.done, 0) for k, a in tl.arrivals.items()}
        job.append(tl)
    assert line_up(job[3:]).collectives == 0


def test_one_rank_or_nothing_lines_nothing_up():
    assert line_up(_job(ranks=1)).ranks == []
    assert line_up([]).ranks == []
    empty = line_up([RankTimeline(0), RankTimeline(1)])
    assert empty.collectives == 0 and not empty.stragglers


def test_timeline_from_bundle_events():
    events = [
        {"kind": "step_begin", "t": 100, "step": 1},
        {"kind": "phase", "t": 105, "phase": "data", "step": 1, "begin_t": 90, "end_t": 100},
        {"kind": "collective", "t": 110, "desc": "all_reduce group=default dtype=float32 sizes=[[4]]",
         "group_seq": 1, "state": "started", "step": 1},
        {"kind": "collective", "t": 150, "desc": "all_reduce group=default dtype=float32 sizes=[[4]]",
         "group_seq": 1, "state": "completed", "duration_ns": 40},
        # from the Flight Recorder: one line at entry, with or without a duration
        {"kind": "collective", "t": 160, "desc": "all_reduce group=default dtype=float32 sizes=[[8]]",
         "group_seq": 2, "state": "completed", "duration_ns": 30, "step": 1},
        {"kind": "collective", "t": 200, "desc": "broadcast group=default dtype=float32 sizes=[[1]]",
         "group_seq": 3, "state": "completed", "duration_ns": 0},
        {"kind": "collective", "t": 210, "desc": "all_reduce group=default dtype=float32 sizes=[[1]]",
         "group_seq": 4, "state": "started", "step": 1},
        {"kind": "step_end", "t": 300, "step": 1},
        {"kind": "phase", "t": "bad", "phase": "forward"},  # damaged lines are skipped
        {"kind": "collective", "t": 1, "desc": "x", "group_seq": "1", "state": "started"},
    ]
    tl = timeline_from_events(3, "h", events)
    assert tl.rank == 3 and tl.host == "h"
    assert tl.arrivals[("default", 1)] == Arrival("default", 1, "all_reduce", 110, 150, True, 1)
    assert tl.arrivals[("default", 2)] == Arrival("default", 2, "all_reduce", 160, 190, True, 1)
    assert tl.arrivals[("default", 3)] == Arrival("default", 3, "broadcast", 200, None, True, 0)
    assert tl.arrivals[("default", 4)] == Arrival("default", 4, "all_reduce", 210, None, False, 1)
    assert tl.phases == [Phase(1, "data", 90, 100)]
    assert tl.steps == {1: (100, 300)}


def test_the_median_of_the_other_ranks_is_each_ranks_own_leave_one_out_median():
    import statistics

    from recorder.arrival import medians_of_others

    rng = random.Random(3)
    for n in range(1, 10):
        values = {r: rng.choice([0.0, 1.0, rng.random()]) for r in range(n)}
        got = medians_of_others(values)
        for r in values:
            others = [v for q, v in values.items() if q != r]
            assert got[r] == pytest.approx(statistics.median(others) if others else 0.0)
