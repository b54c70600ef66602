"""The process's resident and virtual size, read off the training thread.

A step end on the CPU carries the process's memory (the MEMORY event).  Reading ``/proc/self/statm`` there costs a
system call and its parsing at every step (~6 µs: more than 1% of a sub-millisecond step).  Here a daemon thread
(``obs-resident``) reads it every :data:`INTERVAL_S` while someone asks, and :func:`latest` hands out the newest
reading: no system call on the caller's thread, the same dict object until the reading changes.  The thread ends by
itself once nobody asked for :data:`IDLE_S`, and the next call starts it again (a forked child starts its own).
"""

from __future__ import annotations

import os
import threading
from typing import Any

__all__ = ["IDLE_S", "INTERVAL_S", "latest", "read", "stop"]

INTERVAL_S = 0.01  #: how often the thread reads: a step end's reading is at most this old (plus a GIL wait)
IDLE_S = 2.0  #: the thread ends after this long without a call of :func:`latest`

_PAGE = os.sysconf("SC_PAGE_SIZE")


class _Reader:
    __slots__ = ("fd", "reading", "asks", "thread", "lock", "wake")

    def __init__(self) -> None:
        self.fd = -1
        self.reading: dict[str, Any] | None = None
        self.asks = 0  # bumped by every latest(): the thread's sign that someone still reads
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()
        self.wake = threading.Event()  # set only to stop the thread early (tests)


_state = _Reader()


def read() -> dict[str, Any]:
    """A fresh reading on the caller's thread: ``{"device": "cpu", "rss_bytes": ..., "vms_bytes": ...}``."""
    if _state.fd < 0:
        # Kept open: opening /proc/self/statm at every reading cost ~25 µs, a pread ~2 µs.
        _state.fd = os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC)
    pages = os.pread(_state.fd, 128, 0).split()
    return {"device": "cpu", "rss_bytes": int(pages[1]) * _PAGE, "vms_bytes": int(pages[0]) * _PAGE}


def latest() -> dict[str, Any]:
    """The newest reading, at most about :data:`INTERVAL_S` old; the first call reads on the caller's thread."""
    state = _state
    state.asks += 1
    reading = state.reading
    if reading is not None and state.thread is not None:
        return reading
    with state.lock:
        if state.reading is None or state.thread is None:
            state.reading = read()
            state.thread = threading.Thread(target=_run, name="obs-resident", daemon=True)
            state.thread.start()
        return state.reading


def _run() -> None:
    state, me = _state, threading.current_thread()
    seen, idle_s = state.asks, 0.0
    while not state.wake.wait(INTERVAL_S):
        if state.asks == seen:
            idle_s += INTERVAL_S
            if idle_s >= IDLE_S:
                break
        else:
            seen, idle_s = state.asks, 0.0
        try:
            new = read()
        except OSError:
            break  # the next latest() reads on its own thread again, and says why if it fails there
        old = state.reading
        if old is None or new["rss_bytes"] != old["rss_bytes"] or new["vms_bytes"] != old["vms_bytes"]:
            state.reading = new
    with state.lock:
        if state.thread is me:
            state.thread = None


def stop(timeout: float = 5.0) -> None:
    """End the thread now (tests); the next :func:`latest` starts it again."""
    thread = _state.thread
    if thread is not None:
        _state.wake.set()
        thread.join(timeout)
        _state.wake.clear()


def _after_fork_in_child() -> None:
    # The thread did not come along, and the inherited descriptor names the parent's file.
    global _state
    old, _state = _state, _Reader()
    if old.fd >= 0:
        try:
            os.close(old.fd)
        except OSError:
            pass


os.register_at_fork(after_in_child=_after_fork_in_child)
