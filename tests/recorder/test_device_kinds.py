"""The profiler's device slots in the ring format: the ``device`` ring exists only where a writer asks for it (the
recorder's rings and its ``rdr.capacity`` keys are unchanged), and its slots read back through the ring reader."""

from __future__ import annotations

import os

import pytest

from obs._core.errors import ObsConfigError
from recorder.layout import DEFAULT_CAPACITY, RINGS, DeviceTarget, Kind, check_capacity, plan
from recorder.ring import RingWriter
from recorder.ring_reader import read_ring_file


def test_the_device_ring_is_laid_out_only_where_asked():
    assert "device" in RINGS and "device" not in DEFAULT_CAPACITY
    assert [r.name for r in plan(dict(DEFAULT_CAPACITY))[2]] == list(DEFAULT_CAPACITY)[:-1]  # no "blob" ring
    with_device = plan({**DEFAULT_CAPACITY, "device": 32})
    assert [r.name for r in with_device[2]][-1] == "device"
    assert check_capacity({"device": 32}) == with_device[3] > check_capacity({})
    with pytest.raises(ObsConfigError, match="unknown ring"):
        check_capacity({"gpu": 32})


def test_device_slots_read_back_with_their_fields(tmp_path):
    path = os.path.join(tmp_path, "p.obsring")
    w = RingWriter(path, {**DEFAULT_CAPACITY, "device": 16}, pid=os.getpid(), rank=0, world_size=1, meta={})
    w.appender("step")(Kind.STEP_BEGIN, 1, 0, 1, 0, 0)
    w.appender("device")(Kind.DEVICE_TIME, DeviceTarget.MODULE, w.intern("Default/net"), 2, 1_000, 4_000)
    w.appender("memory")(Kind.MEMORY_PEAK, 0, w.intern("cuda:0"), 1, 5, 8)
    slots = read_ring_file(path).slots
    w.close(remove=True)
    assert [int(k) for k in slots["kind"]] == [Kind.STEP_BEGIN, Kind.DEVICE_TIME, Kind.MEMORY_PEAK]
    device = slots[1]
    assert (int(device["flags"]), int(device["b"]), int(device["c"]), int(device["d"])) == (3, 2, 1_000, 4_000)
