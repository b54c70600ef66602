"""Following a ring as it fills: settled slots only, in order, each once; an overrun is counted, not hidden."""

from __future__ import annotations

import os

from exporters.follow import RingFollower, StepAssembler
from recorder.layout import Kind
from recorder.ring import RingWriter

CAP = {"step": 32, "module": 16, "op": 16, "memory": 16, "collective": 16, "blob": 16}


def ring(tmp_path):
    return RingWriter(os.path.join(tmp_path, "p.obsring"), dict(CAP), pid=os.getpid(), rank=0, world_size=1,
                      meta={"run_id": "r"})


def step(append, n, t0=0):
    append(Kind.STEP_BEGIN, 0, 0, n, 0, 0)
    append(Kind.PHASE, 0, 1, n, t0, t0 + 10)
    append(Kind.STEP_END, 0, 0, n, 10, 0)


def test_slots_are_returned_once_settled_and_steps_once_the_next_begins(tmp_path):
    w = ring(str(tmp_path))
    append = w.appender("step")
    f = RingFollower(w.path)
    a = StepAssembler(f)
    step(append, 1)
    assert len(f.poll()) == 0  # seen, not settled yet: the writer may still be in the last one
    assert a.feed(f.poll()) == []  # settled now, but step 1 may still get its optimizer phase
    step(append, 2)
    f.poll()
    (done,) = a.feed(f.poll())
    assert done.step == 1 and [p.name for p in done.phases] == ["forward"] and done.complete
    (last,) = a.feed(f.poll(final=True)) + a.drain()
    assert last.step == 2 and last.complete
    assert f.poll(final=True).size == 0 and f.lost == {name: 0 for name in f.lost}
    w.close(remove=True)
    f.close()


def test_an_exporter_that_falls_behind_counts_what_was_overwritten(tmp_path):
    w = ring(str(tmp_path))
    append = w.appender("step")
    f = RingFollower(w.path)
    for n in range(1, 21):  # 60 slots into a ring of 32
        step(append, n)
    slots = f.poll(final=True)
    assert len(slots) == 32 and f.lost["step"] == 28
    assert list(slots["seq"]) == sorted(slots["seq"])
    records = StepAssembler(f).feed(slots)
    assert [r.step for r in records] == list(range(11, 20))  # whole steps only; the first began before the cut
    w.close(remove=True)
    f.close()


def test_a_step_the_trainer_died_in_is_incomplete(tmp_path):
    w = ring(str(tmp_path))
    append = w.appender("step")
    step(append, 1)
    append(Kind.STEP_BEGIN, 0, 0, 2, 0, 0)
    append(Kind.PHASE, 0, 1, 2, 5, 50)
    f = RingFollower(w.path)
    a = StepAssembler(f)
    records = a.feed(f.poll(final=True)) + a.drain()
    assert [(r.step, r.complete) for r in records] == [(1, True), (2, False)]
    assert records[1].end_ns >= records[1].phases[0].end_ns
    w.close(remove=True)
    f.close()


def test_the_exporter_counts_the_steps_an_overrun_cost(tmp_path):
    from exporters.sidecar import ExportConfig, Exporter

    w = ring(str(tmp_path))
    append = w.appender("step")
    exporter = Exporter(ExportConfig(ring=w.path, folder=str(tmp_path), trainer_pid=os.getpid()))
    for n in (1, 2):
        step(append, n)
    exporter.step()
    exporter.step()
    for n in range(3, 31):  # 84 slots into a ring of 32 before the exporter looks again
        step(append, n)
    exporter.step(final=True)
    exported = exporter.counts.steps
    status = exporter.status(done=True)
    assert exported + exporter.lost_steps == 30 and exporter.lost_steps >= 17
    assert status["ring_overrun"]["steps"] == exporter.lost_steps and status["ring_overrun"]["events"] > 0
    assert status["dropped"]["ring_overrun"] == exporter.lost_steps * 2  # 2 spans per exported step (step, forward)
    exporter.close()
    w.close(remove=True)
