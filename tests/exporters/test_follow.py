"""Following a ring as it fills: settled slots only, in order, each once; an overrun is counted, not hidden; a slot
read mid-write or still being written is neither returned nor skipped past."""

from __future__ import annotations

import os
import struct

from exporters.follow import _HOLE_POLLS, RingFollower, StepAssembler
from recorder.layout import SLOT, Kind
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


def _slot_at(w, idx):
    region = w.rings["step"]
    return region.offset + (idx - 1) % region.capacity * SLOT.size


def _idx(polls):
    """The idx of the slots returned by ``polls``, in the order returned."""
    return [int(i) for slots in polls for i in slots["idx"]]


def test_a_slot_read_mid_write_with_its_new_idx_and_an_old_seq_is_not_taken_for_settled(tmp_path):
    """The writer packs a slot field by field and a copy of the region need not read its bytes in order: the newest
    slot can read as its new idx with the seq of the slot it replaces.  Returning it would skip every slot between
    the last one returned and it (they are not settled yet), for good and uncounted."""
    w = ring(str(tmp_path))
    append = w.appender("step")
    f = RingFollower(w.path)
    for n in (1, 2, 3):
        step(append, n)
    got = [f.poll(), f.poll()]
    step(append, 4)
    step(append, 5)  # idx 10..15
    at = _slot_at(w, 15)
    whole = bytes(w._mm[at:at + SLOT.size])
    w._mm[at:at + 8] = struct.pack("<Q", 1)  # the seq not written yet: an old one
    got.append(f.poll())
    w._mm[at:at + SLOT.size] = whole  # the write ends
    got += [f.poll(), f.poll(final=True)]
    assert _idx(got) == list(range(1, 16))
    assert f.lost["step"] == 0
    w.close(remove=True)
    f.close()


def test_a_slot_another_thread_still_writes_is_waited_for_and_one_never_written_is_counted(tmp_path):
    w = ring(str(tmp_path))
    append = w.appender("step")
    f = RingFollower(w.path)
    step(append, 1)  # idx 1..3
    late = next(w._counters["step"])  # idx 4: a thread drew it, then lost the core before writing
    step(append, 2)  # idx 5..7
    f.poll()
    got = [f.poll()]
    assert _idx(got) == [1, 2, 3]  # not 5..7: that would skip 4 for good
    SLOT.pack_into(w._mm, _slot_at(w, late + 1), next(w.seq), late + 1, 0, Kind.PHASE, 0, 2, 1, 0, 1)
    got += [f.poll(), f.poll()]
    assert _idx(got) == [1, 2, 3, 5, 6, 7, 4] and f.lost["step"] == 0  # in seq order: 4 was written last

    next(w._counters["step"])  # idx 8: never written (its thread died)
    step(append, 3)  # idx 9..11
    waited = [f.poll() for _ in range(_HOLE_POLLS + 1)]
    assert _idx(waited) == [9, 10, 11] and f.lost["step"] == 1
    w.close(remove=True)
    f.close()
