"""Device time with fake CUDA events: the pool's reuse and bound, the records of steps, phases and spans in order,
nothing resolved on the training thread, no event lost, nothing recorded in a graph capture."""

from __future__ import annotations

import threading
import time

import pytest

from obs.runtime.device_time import DeviceTimer, EventPool
from recorder.layout import DeviceTarget as T


class FakeStream:
    """A CUDA stream as the events see it: an event recorded at ``now`` (device ns) completes once ``done`` reaches
    its record number; which threads asked is kept."""

    def __init__(self) -> None:
        self.now = 0
        self.recorded = 0
        self.done = 0
        self.asked: set[int] = set()
        self.ran = threading.Condition()

    def run(self) -> None:
        """The device catches up with everything recorded."""
        with self.ran:
            self.done = self.recorded
            self.ran.notify_all()


class FakeEvent:
    def __init__(self, stream: FakeStream) -> None:
        self.stream, self.number, self.at = stream, 0, 0

    def record(self) -> None:
        self.stream.recorded += 1
        self.number, self.at = self.stream.recorded, self.stream.now

    def query(self) -> bool:
        self.stream.asked.add(threading.get_ident())
        return 0 < self.number <= self.stream.done

    def synchronize(self) -> None:
        self.stream.asked.add(threading.get_ident())
        with self.stream.ran:
            self.stream.ran.wait_for(lambda: 0 < self.number <= self.stream.done)

    def elapsed_time(self, other: FakeEvent) -> float:
        self.stream.asked.add(threading.get_ident())
        if not (self.query() and other.query()):
            raise RuntimeError("Both events must be completed before calculating elapsed time.")
        return (other.at - self.at) / 1e6


def timer(stream: FakeStream, records: list, **kwargs) -> DeviceTimer:
    kwargs.setdefault("start", False)
    return DeviceTimer(lambda *r: records.append(r), lambda: FakeEvent(stream), **kwargs)


def test_the_pool_reuses_its_events_and_never_makes_more_than_its_bound():
    made = []
    pool = EventPool(lambda: made.append(object()) or made[-1], 2)
    first, second = pool.take(), pool.take()
    assert pool.take() is None and pool.created == 2
    pool.give(first)
    assert pool.take() is first and len(made) == 2
    pool.give(second)
    assert pool.free == 1


def test_a_step_its_phases_and_a_module_are_written_relative_to_the_step_reference_in_order():
    stream, records = FakeStream(), []
    t = timer(stream, records)
    t.step_begins(1)  # ref at device time 0
    stream.now = 1_000
    start = t.begin()
    stream.now = 5_000
    t.end(start, T.MODULE, 7, 101)  # a module: 1 µs after the ref, 4 µs long
    stream.now = 6_000
    t.mark(1, 102)  # forward: ref .. 6 µs
    stream.now = 9_000
    t.mark(2, 103)  # backward: 6 .. 9 µs
    stream.now = 9_500
    t.step_ends(1)
    t.step_begins(2)  # queues step 1's record; ref of step 2 at 9.5 µs
    assert t.resolve() == 0 and not records  # the device ran nothing yet: nothing written
    stream.run()
    t.resolve()
    assert records == [(T.MODULE, 7, 101, 1_000, 4_000), (T.PHASE, 1, 102, 0, 6_000), (T.PHASE, 2, 103, 6_000, 3_000),
                       (T.STEP, 0, 1, -1, 9_500)]
    stream.now = 12_000
    t.step_ends(2)
    t.close(0)
    t2 = [r for r in records if r[0] == T.STEP]
    assert t2 == [(T.STEP, 0, 1, -1, 9_500)]  # step 2 never completed before close: dropped, not waited for


def test_the_chain_from_one_step_reference_to_the_next_and_every_event_back_in_the_pool():
    stream, records = FakeStream(), []
    t = DeviceTimer(lambda *r: records.append(r), lambda: FakeEvent(stream))
    try:
        for step in (1, 2, 3):
            t.step_begins(step)
            stream.now += 1_000
            t.mark(1, 10 * step)
            stream.now += 2_000
            t.step_ends(step)
            stream.now += 500  # the host's gap between steps, as the device saw it
        stream.run()
    finally:
        t.close(2.0)  # the poller writes what is done, gives back what the timer held, then ends
    steps = [r for r in records if r[0] == T.STEP]
    assert steps == [(T.STEP, 0, 1, -1, 3_000), (T.STEP, 0, 2, 3_500, 3_000), (T.STEP, 0, 3, 3_500, 3_000)]
    assert t.pool.free == t.pool.created  # every event back
    assert len({id(e) for e in t.pool._free}) == t.pool.free  # none given back twice


def test_resolution_stops_at_the_first_pair_not_done_and_keeps_the_order():
    stream, records = FakeStream(), []
    t = timer(stream, records)
    t.step_begins(1)
    first = t.begin()
    t.end(first, T.MODULE, 1, 11)
    stream.done = stream.recorded  # the device ran the first module
    second = t.begin()
    t.end(second, T.MODULE, 2, 12)
    assert t.resolve() == 1 and [r[2] for r in records] == [11]
    stream.run()
    assert t.resolve() == 1 and [r[2] for r in records] == [11, 12]


def test_with_the_pool_empty_a_span_is_skipped_and_its_step_counts_it():
    stream, records = FakeStream(), []
    t = timer(stream, records, capacity=3)
    t.step_begins(1)  # 1 in use
    held = t.begin()  # 2
    assert t.begin() is not None  # 3: the pool is empty now
    assert t.begin() is None
    t.end(held, T.MODULE, 0, 5)  # no end event left: not timed either (its start goes back)
    t.step_ends(1)  # takes the start given back
    t.step_begins(2)  # none left for its reference: step 2 is not timed
    stream.run()
    t.resolve()
    (step,) = [r for r in records if r[0] == T.STEP]
    assert step[1] == 2 and step[4] >= 0 and t.skipped == 3
    assert not [r for r in records if r[0] == T.MODULE]


def test_a_phase_that_ends_after_its_step_is_written_before_the_step():
    """Steps detected from the optimizer hooks end before the optimizer phase."""
    stream, records = FakeStream(), []
    t = timer(stream, records)
    t.step_begins(1)
    t.mark(2, 20)
    t.step_ends(1)
    t.mark(3, 21)  # the optimizer phase, after the step ended
    stream.run()
    t.resolve()
    assert [r[0] for r in records] == [T.PHASE, T.PHASE, T.STEP]


def test_a_step_record_waiting_for_a_late_phase_goes_after_flush_s_without_one():
    stream, records = FakeStream(), []
    t = DeviceTimer(lambda *r: records.append(r), lambda: FakeEvent(stream), flush_s=0.01)
    try:
        t.step_begins(1)
        t.step_ends(1)
        stream.run()
        deadline = time.monotonic() + 5
        while not records and time.monotonic() < deadline:
            time.sleep(0.005)
        assert [r[0] for r in records] == [T.STEP]
    finally:
        t.close(0)


def test_nothing_is_resolved_on_the_training_thread():
    stream, records = FakeStream(), []
    t = DeviceTimer(lambda *r: records.append(r), lambda: FakeEvent(stream), flush_s=0.001)
    try:
        for step in range(1, 4):
            t.step_begins(step)
            start = t.begin()
            t.end(start, T.MODULE, 0, step)
            t.mark(1, 100 + step)
            t.step_ends(step)
            stream.run()
        deadline = time.monotonic() + 5
        while len([r for r in records if r[0] == T.STEP]) < 3 and time.monotonic() < deadline:
            time.sleep(0.005)
    finally:
        t.close(1.0)
    assert len([r for r in records if r[0] == T.STEP]) == 3
    assert threading.get_ident() not in stream.asked and stream.asked  # queried and measured by the poller only


def test_nothing_is_recorded_while_the_stream_is_captured_into_a_cuda_graph():
    stream, records = FakeStream(), []
    capturing = [True]
    t = timer(stream, records, capturing=lambda: capturing[0])
    t.step_begins(1)
    assert t.begin() is None and stream.recorded == 0
    t.mark(1, 5)
    assert stream.recorded == 0
    capturing[0] = False
    t.step_ends(1)
    t.step_begins(2)
    assert stream.recorded == 1  # step 2's reference
    stream.run()
    t.resolve()
    assert records == [(T.STEP, 1, 1, -1, -1)]  # step 1 had no reference: counted, untimed


@pytest.mark.parametrize("error", [RuntimeError("another device's event"), ValueError("not recorded")])
def test_a_pair_the_device_cannot_measure_is_written_as_unknown(error):
    stream, records = FakeStream(), []
    t = timer(stream, records)
    t.step_begins(1)
    start = t.begin()
    start.elapsed_time = lambda other: (_ for _ in ()).throw(error)  # type: ignore[method-assign]
    t.end(start, T.MODULE, 3, 9)
    stream.run()
    t.resolve()
    assert records == [(T.MODULE, 3, 9, 0, -1)]
