"""Never break the user's training loop because of our own bug; never hide it in tests.

Every call from a hook into obs code (subscribers, sinks, exporters) goes through
:func:`report_internal_error` when it fails: the error is counted, logged once per site and
swallowed.  The test suite (or ``OBS_RAISE_INTERNAL_ERRORS=1``) turns it into a raise.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter

from obs._core import env

__all__ = [
    "internal_error_counts",
    "leave_traceback",
    "report_internal_error",
    "set_raise_internal_errors",
    "suppressed",
    "SUPPRESSION",
]

logger = logging.getLogger("obs")

_counts: Counter[str] = Counter()
_lock = threading.Lock()
_raise = env.flag(env.OBS_RAISE_INTERNAL_ERRORS)


def leave_traceback(error: BaseException, frame: object) -> None:
    """Take a wrapper's own ``frame`` out of the head of ``error``'s traceback, so that an error passing through obs
    shows the user's frames only (a bare ``raise`` after this adds none)."""
    tb = error.__traceback__
    if tb is not None and tb.tb_frame is frame:
        error.__traceback__ = tb.tb_next


def set_raise_internal_errors(flag: bool) -> bool:
    """Make internal errors propagate (tests) or be swallowed (production); returns the old flag."""
    global _raise
    old, _raise = _raise, bool(flag)
    return old


def report_internal_error(site: str, exc: BaseException) -> None:
    """Count and log (once per site) an error raised inside obs; re-raise in raise mode."""
    with _lock:
        _counts[site] += 1
        first = _counts[site] == 1
    if first:
        logger.error("obs internal error in %s (further ones here are counted, not logged): %r", site, exc,
                     exc_info=exc)
    if _raise:
        raise exc


def internal_error_counts() -> dict[str, int]:
    """How many internal errors each site swallowed so far."""
    with _lock:
        return dict(_counts)


class ThreadState(threading.local):
    """Per-thread state read on the hot path: suppression depth and the module scope stack."""

    def __init__(self) -> None:
        self.depth = 0
        self.stack: list[str] = []


#: Hot-path hooks read ``SUPPRESSION.depth`` / ``SUPPRESSION.stack`` directly (no getattr defaults).
SUPPRESSION = ThreadState()


class _Suppressed:
    # A class, not @contextmanager: a generator-based one costs ~1 µs per use, this ~0.2 µs.
    __slots__ = ()

    def __enter__(self) -> None:
        SUPPRESSION.depth += 1

    def __exit__(self, *exc: object) -> None:
        SUPPRESSION.depth -= 1


_SUPPRESSED = _Suppressed()


def suppressed() -> _Suppressed:
    """Run a block with every obs hook on this thread ignoring what it does: ``with suppressed(): ...``."""
    return _SUPPRESSED
