"""recorder.live and `obs top`: what each rank of a running job does now, read from rings it still writes."""

from __future__ import annotations

import json
import os
import time

from obs.cli import main
from recorder.layout import DEFAULT_CAPACITY, PHASE_CODES, Kind
from recorder.live import read_job
from recorder.ring import RingWriter

MS = 1_000_000
DESC = "all_reduce group=default dtype=float32 sizes=[[4]]"


def _rank(root, rank, *, run_id="job", world=3):
    folder = root / f"rank_{rank}" / "rdr"
    folder.mkdir(parents=True)
    writer = RingWriter(str(folder / f"ring_{1000 + rank}.obsring"), {**DEFAULT_CAPACITY, "module": 64},
                        pid=1000 + rank, rank=rank, world_size=world, meta={"run_id": "proposal", "host": "h",
                                                                             "granularity": "module"})
    (folder / "marker.json").write_text(json.dumps({"pid": 1000 + rank, "rank": rank, "run_id": run_id}))
    return writer


def _steps(writer, rank, steps, *, slow=False, clock=None):
    """``steps`` steps recorded as the recorder would: data, forward, backward, one all_reduce, optimizer."""
    step, coll = writer.appender("step"), writer.appender("collective")
    desc = writer.intern(DESC)
    t = clock or time.perf_counter_ns() - steps * 400 * MS
    for n in range(1, steps + 1):
        data = (200 if slow else 1) * MS
        step(Kind.STEP_BEGIN, 0, 0, n, 0, 0)
        step(Kind.PHASE, 0, PHASE_CODES["data"], n, t, t + data)
        step(Kind.PHASE, 0, PHASE_CODES["forward"], n, t + data, t + data + 10 * MS)
        step(Kind.PHASE, 0, PHASE_CODES["backward"], n, t + data + 10 * MS, t + data + 30 * MS)
        coll(Kind.COLLECTIVE, 0, desc, n, 0, 1)  # started, then completed
        coll(Kind.COLLECTIVE, 0, desc, n, 5 * MS, 2)
        step(Kind.PHASE, 0, PHASE_CODES["optimizer"], n, t + 240 * MS, t + 242 * MS)
        step(Kind.STEP_END, 0, 0, n, 0, 0)
        t += 400 * MS


def test_a_rank_missing_from_the_collective_the_others_wait_in_is_named(tmp_path):
    writers = [_rank(tmp_path, r) for r in range(3)]
    try:
        for r, w in enumerate(writers):
            _steps(w, r, 3)
        # ranks 0 and 1 enter step 4's all_reduce and wait; rank 2 is still loading its data
        for r, w in enumerate(writers):
            w.appender("step")(Kind.STEP_BEGIN if r < 2 else Kind.STEP_END, 0, 0, 4 if r < 2 else 3, 0, 0)
        module = writers[0].appender("module")
        scope = writers[0].intern("Default/net-Net")
        module(Kind.MODULE_ENTER, 0, scope, 4, 0, 0)
        for w in writers[:2]:
            w.appender("step")(Kind.PHASE, 0, PHASE_CODES["backward"], 4, 0, time.perf_counter_ns())
            w.appender("collective")(Kind.COLLECTIVE, 0, w.intern(DESC), 4, 0, 1)
        job = read_job(str(tmp_path))
        assert job.run_id == "job"  # the agreed one, from the markers
        assert [r.rank for r in job.ranks] == [0, 1, 2]
        assert job.waited_for == [2] and job.gone == []
        r0, _r1, r2 = job.ranks
        assert (r0.step, r0.phase.what, r0.collective.what, r0.last_seq) == (4, "after backward",
                                                                             "all_reduce default #4", {"default": 4})
        assert r0.module.what == "Default/net-Net"
        assert (r2.step, r2.phase.what, r2.collective, r2.last_seq, r2.waited_for) == (3, "data", None,
                                                                                       {"default": 3}, True)
        assert all(r.alive and r.host == "h" and r.granularity == "module" for r in job.ranks)
        assert r0.steps_per_s > 0  # from the step ends' slot times
    finally:
        for w in writers:
            w.close(remove=False)


def test_a_rank_late_at_every_collective_is_a_straggler_and_top_says_so(tmp_path, capsys):
    writers = [_rank(tmp_path, r) for r in range(3)]
    try:
        # rank 2's data loading takes 200 ms: it enters each all_reduce 199 ms after the others
        step_t = time.perf_counter_ns() - 30 * 400 * MS
        for n in range(1, 21):
            for r, w in enumerate(writers):
                enter = step_t + (230 if r == 2 else 31) * MS
                leave = step_t + 231 * MS
                begin = w.appender("step")
                begin(Kind.STEP_BEGIN, 0, 0, n, 0, 0)
                data = (200 if r == 2 else 1) * MS
                begin(Kind.PHASE, 0, PHASE_CODES["data"], n, step_t, step_t + data)
                begin(Kind.PHASE, 0, PHASE_CODES["forward"], n, step_t + data, step_t + data + 30 * MS)
                coll = w.appender("collective")
                desc = w.intern(DESC)
                # only a completed slot (written now, as all these): the entry is its time less its duration
                coll(Kind.COLLECTIVE, 0, desc, n, leave - enter, 2)
            step_t += 400 * MS
        job = read_job(str(tmp_path))
    finally:
        for w in writers:
            w.close(remove=False)
    # rank 2 waited 1 ms in each all_reduce, the others 200 ms
    assert job.lineup.collectives == 20
    assert [x.rank for x in job.lineup.stragglers] == [2]
    assert job.ranks[2].straggler and job.ranks[2].late_phase == "data"
    assert job.waited_for == [2]
    # every writer closed without removing its ring: the ranks are gone
    assert main(["top", str(tmp_path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["gone"] == [0, 1, 2] and [r["alive"] for r in doc["ranks"]] == [False] * 3
    assert doc["ranks"][2]["straggler"] is True and doc["ranks"][2]["late_phase"] == "data"
    assert main(["top", str(tmp_path), "--once"]) == 0
    out = capsys.readouterr().out
    assert "gone (ring left)" in out and "straggler in data" in out and "the others wait for rank 2" in out


def test_a_newer_live_ring_wins_and_damaged_rings_are_rows(tmp_path, capsys):
    old = _rank(tmp_path, 0, run_id="old")
    old.close(remove=False)
    folder = tmp_path / "rank_0" / "rdr"
    os.rename(folder / "marker.json", folder / "old_marker.json")
    live = RingWriter(str(folder / "ring_2000.obsring"), {**DEFAULT_CAPACITY, "module": 64}, pid=2000, rank=0,
                      world_size=1, meta={"run_id": "new", "host": "h"})
    try:
        (tmp_path / "rank_1" / "rdr").mkdir(parents=True)
        (tmp_path / "rank_1" / "rdr" / "ring_9.obsring").write_bytes(b"OBSRING\x01" + b"\0" * 100)
        job = read_job(str(tmp_path))
        rows = {(r.rank, r.pid): r for r in job.ranks}
        assert job.run_id == "new"
        assert rows[(0, 2000)].alive and rows[(0, 2000)].error is None
        assert any(r.error and "truncated" in r.error for r in job.ranks)
        assert main(["top", str(tmp_path), "--once"]) == 0
        assert "unreadable" in capsys.readouterr().out
    finally:
        live.close(remove=False)


def test_top_without_rings_is_bad_input(tmp_path, capsys):
    assert main(["top", str(tmp_path)]) == 2
    assert "no RDR ring under" in capsys.readouterr().err
    assert main(["top", str(tmp_path / "missing"), "--once"]) == 2
    assert "no such folder" in capsys.readouterr().err
    assert main(["top", str(tmp_path), "--interval", "0"]) == 2


def test_processes_that_do_not_know_their_rank_yet_are_rows_of_their_own(tmp_path, capsys):
    """mp.spawn: before init_process_group each process writes under rank_unresolved-{pid}, all as rank 0."""
    writers = []
    for pid in (31, 32):
        folder = tmp_path / f"rank_unresolved-{pid}" / "rdr"
        folder.mkdir(parents=True)
        writers.append(RingWriter(str(folder / f"ring_{pid}.obsring"), {**DEFAULT_CAPACITY, "module": 64}, pid=pid,
                                  rank=0, world_size=1, meta={"run_id": "r", "host": "h"}))
    try:
        job = read_job(str(tmp_path))
        assert sorted(r.pid for r in job.ranks) == [31, 32] and not any(r.resolved for r in job.ranks)
        assert main(["top", str(tmp_path), "--once"]) == 0
        assert capsys.readouterr().out.count("rank not known yet") == 2
    finally:
        for w in writers:
            w.close(remove=False)
