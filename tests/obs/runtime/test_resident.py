"""The resident-size reader: step ends get the newest reading of a thread, with no system call of their own."""

from __future__ import annotations

import os
import time

import numpy as np

from obs.runtime import resident


def _wait_for(predicate, deadline_s: float = 10.0) -> bool:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(resident.INTERVAL_S)
    return predicate()


def test_latest_is_the_threads_newest_reading_and_the_same_object_until_it_changes():
    try:
        first = resident.latest()
        assert first["device"] == "cpu" and first["rss_bytes"] > 0 and first["vms_bytes"] >= first["rss_bytes"]
        assert resident._state.thread is not None and resident._state.thread.name == "obs-resident"
        grown = np.ones(64 << 20, dtype=np.uint8)  # 64 MiB, touched: resident
        assert _wait_for(lambda: resident.latest()["rss_bytes"] >= first["rss_bytes"] + (32 << 20))
        now = resident.latest()
        assert resident.latest() is now or resident.latest()["rss_bytes"] != now["rss_bytes"]
        del grown
    finally:
        resident.stop()
    assert resident._state.thread is None


def test_the_thread_ends_when_nobody_asks_and_the_next_call_starts_it(monkeypatch):
    monkeypatch.setattr(resident, "IDLE_S", 0.05)
    try:
        resident.latest()
        thread = resident._state.thread
        assert thread is not None
        thread.join(10)
        assert not thread.is_alive() and resident._state.thread is None
        assert resident.latest()["rss_bytes"] > 0 and resident._state.thread is not None
    finally:
        resident.stop()


def test_a_forked_child_reads_its_own_memory():
    try:
        resident.latest()
        read_r, write_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: its own descriptor and thread
            try:
                ok = resident._state.thread is None and resident.latest()["rss_bytes"] > 0
                ok = ok and resident._state.thread is not None
                resident.stop()
                os.write(write_w, b"1" if ok else b"0")
            finally:
                os._exit(0)
        os.close(write_w)
        assert os.read(read_r, 1) == b"1"
        os.close(read_r)
        os.waitpid(pid, 0)
    finally:
        resident.stop()
