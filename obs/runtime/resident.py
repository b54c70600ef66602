"""The process's resident and virtual size, read at most every :data:`INTERVAL_S`.

A step end on the CPU carries the process's memory (the MEMORY event).  Reading ``/proc/self/statm`` at every step
costs a system call and its parsing (~6 µs: more than 1% of a sub-millisecond step).  :func:`latest` reads it at
most every :data:`INTERVAL_S` and hands out the newest reading in between: the same dict object until a reading
differs.  A step longer than the interval gets a fresh reading at every end, as before; a short one shares it with
its neighbours.  No thread: a reader thread's wake-ups every few ms cost the training thread two context switches
and a GIL hand-off each, more than the system call they save (measured on a pinned core: 0.44 switches per MLP
step).  A forked child reads its own file.
"""

from __future__ import annotations

import os
import time
from typing import Any

__all__ = ["INTERVAL_S", "latest", "read"]

INTERVAL_S = 0.01  #: a step end's reading is at most this old

_PAGE = os.sysconf("SC_PAGE_SIZE")


class _Reader:
    __slots__ = ("fd", "reading", "next_ns")

    def __init__(self) -> None:
        self.fd = -1
        self.reading: dict[str, Any] | None = None
        self.next_ns = 0  # perf_counter_ns() from which on the next call reads again


_state = _Reader()


def read() -> dict[str, Any]:
    """A fresh reading: ``{"device": "cpu", "rss_bytes": ..., "vms_bytes": ...}``."""
    if _state.fd < 0:
        # Kept open: opening /proc/self/statm at every reading cost ~25 µs, a pread ~2 µs.
        _state.fd = os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC)
    pages = os.pread(_state.fd, 128, 0).split()
    return {"device": "cpu", "rss_bytes": int(pages[1]) * _PAGE, "vms_bytes": int(pages[0]) * _PAGE}


def latest(clock: Any = time.perf_counter_ns) -> dict[str, Any]:
    """The newest reading, at most :data:`INTERVAL_S` old: read now when the last one is older."""
    state, now = _state, clock()
    old = state.reading
    if old is not None and now < state.next_ns:
        return old
    new = read()
    state.next_ns = now + int(INTERVAL_S * 1e9)
    if old is None or new["rss_bytes"] != old["rss_bytes"] or new["vms_bytes"] != old["vms_bytes"]:
        state.reading = old = new
    return old


def _after_fork_in_child() -> None:
    # The inherited descriptor names the parent's file, and its reading is the parent's.
    global _state
    old, _state = _state, _Reader()
    if old.fd >= 0:
        try:
            os.close(old.fd)
        except OSError:
            pass


os.register_at_fork(after_in_child=_after_fork_in_child)
