"""Device values read back without a host sync (obs/runtime/device_readback.py), driven on CPU tensors: a batch keeps
its values' order across dtypes and vectors, a pinned copy holds the values as they were, and the poller runs its jobs
in order, raises a failure at drain, and drops at close what it could not begin."""

from __future__ import annotations

import threading

import pytest
import torch

from obs.runtime.device_readback import DONE, DeviceBatch, Poller, marker, pinned_copy


def test_a_batch_keeps_the_order_of_mixed_dtypes():
    batch = DeviceBatch()
    values = [torch.tensor(1.5), torch.tensor(2, dtype=torch.int64), torch.tensor(-3.0, dtype=torch.float16),
              torch.tensor(4.25, dtype=torch.float64), torch.tensor(5.0)]
    assert [batch.add(v) for v in values[:2]] == [0, 1]
    assert batch.add_all(values[2:]) == 2 and len(batch) == 5
    sent = batch.send()
    assert len(batch) == 0 and sent.done()
    sent.wait()
    assert sent.values() == [1.5, 2.0, -3.0, 4.25, 5.0]
    assert batch.send() is None


def test_a_pinned_copy_of_a_cpu_tensor_is_its_own():
    t = torch.ones(3)
    host = pinned_copy(t)
    t.add_(1)
    assert host.tolist() == [1.0, 1.0, 1.0]


def test_the_poller_runs_jobs_in_order_and_raises_a_failure_at_drain():
    poller, done = Poller("test-poller"), []
    try:
        for i in range(5):
            poller.submit([], lambda i=i: done.append(i))
        poller.submit([], lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            poller.drain()
        poller.submit([], lambda: done.append("after"))
        assert poller.drain() and done == [0, 1, 2, 3, 4, "after"] and poller.completed == 7
    finally:
        poller.close()
    assert poller._thread is None


def test_a_batch_keeps_vectors_in_their_place():
    batch = DeviceBatch()
    assert batch.add(torch.tensor(1.5)) == 0
    assert batch.add_vector(torch.tensor([2.0, 3.0, 4.0])) == 1
    assert batch.add_all([torch.tensor(5, dtype=torch.int64), torch.tensor(6.0)]) == 4
    assert batch.add_vector(torch.tensor([7.0, 8.0], dtype=torch.float64)) == 6
    assert batch.add_vector(torch.tensor([9.0])) == 8 and len(batch) == 9
    sent = batch.send()
    assert sent.done() and sent.values() == [1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0] and len(batch) == 0


def test_a_cpu_marker_is_done_already():
    assert marker(torch.device("cpu")) is DONE and DONE.query()


class Gate:
    """A marker the test opens: ``synchronize()`` waits until it is."""

    def __init__(self) -> None:
        self.opened = threading.Event()

    def query(self) -> bool:
        return self.opened.is_set()

    def synchronize(self) -> None:
        self.opened.wait()


def test_close_drops_the_jobs_it_could_not_begin_in_time():
    poller, gate, done = Poller("test-close"), Gate(), []
    poller.submit([gate], lambda: done.append("first"))  # its device never gets there while close waits
    poller.submit([], lambda: done.append("second"))
    thread = poller._thread
    poller.close(timeout=0.05)
    assert poller.pending == 1 and poller._thread is None  # the first is begun (waiting), the second dropped
    gate.opened.set()
    thread.join(5)
    assert done == ["first"] and poller.pending == 0


def test_an_abandoned_poller_forgets_its_jobs_and_starts_afresh():
    poller, gate, done = Poller("test-abandon"), Gate(), []
    poller.submit([gate], lambda: done.append("parent's"))
    old = poller._thread
    poller.abandon()  # as in a forked child: the parent's job and thread are not its own
    assert poller.pending == 0 and poller._thread is None
    poller.submit([], lambda: done.append("child's"))
    try:
        assert poller.drain(timeout=5) and done == ["child's"]
    finally:
        poller.close()
        gate.opened.set()
        old.join(5)
