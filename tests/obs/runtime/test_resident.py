"""The resident-size reading of CPU step ends: a system call at most every 10 ms, the newest reading in between."""

from __future__ import annotations

import os
import time

import numpy as np

from obs.runtime import resident

MS = 1_000_000


def test_a_reading_is_kept_for_the_interval_and_taken_again_after_it():
    now = [time.perf_counter_ns() + 10**10]  # past any reading an earlier test of this process left

    def clock() -> int:
        return now[0]

    first = resident.latest(clock)
    assert first["device"] == "cpu" and first["rss_bytes"] > 0 and first["vms_bytes"] >= first["rss_bytes"]
    grown = np.ones(64 << 20, dtype=np.uint8)  # 64 MiB, touched: resident
    now[0] += 5 * MS
    assert resident.latest(clock) is first  # within 10 ms: the same reading, no system call
    now[0] += 6 * MS
    after = resident.latest(clock)
    assert after["rss_bytes"] >= first["rss_bytes"] + (32 << 20)
    now[0] += 11 * MS
    again = resident.latest(clock)
    assert again is after or again["rss_bytes"] != after["rss_bytes"]  # unchanged memory: the same dict
    del grown


def test_a_forked_child_reads_its_own_memory():
    resident.latest()
    read_r, write_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its own descriptor, no reading of its parent's
        try:
            ok = resident._state.fd < 0 and resident._state.reading is None and resident.latest()["rss_bytes"] > 0
            os.write(write_w, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(write_w)
    assert os.read(read_r, 1) == b"1"
    os.close(read_r)
    os.waitpid(pid, 0)
