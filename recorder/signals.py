"""SIGTERM and SIGINT, handled without needing the main thread (docs/reliability.md, "Signals").

A Python signal handler runs only when the main thread returns to the interpreter; a rank blocked
in a collective (or any C call) never does.  So:

* a C handler (``recorder/_hotpath.c``) writes the signal number to a pipe and chains to the
  handler it replaced (CPython's, which still runs the Python-level handler when the main thread
  can, and still writes asyncio's wakeup fd: we never take ``signal.set_wakeup_fd``);
* a watcher thread reads the pipe, has the recorder dump (bounded by :data:`DUMP_BUDGET_S`;
  what does not fit stays in the ring for ``obs rdr recover``), then ends the process as the
  signal would have: the default action, re-raised (exit status 143 / 130);
* the Python-level handler, on the main thread, waits for that dump and then calls the handler
  installed before obs (``KeyboardInterrupt`` for SIGINT, or the user's own).

Exactly one dump per fault: the first signal dumps (or, when a dump is already under way, lets it
finish), later ones never dump again; a later signal after :data:`GRACE_S` ends the process at
once.  Nothing here ever waits on a lock the waiting thread holds.

Handlers are installed and restored only on the main thread, once per process
(:func:`install_relay` / :func:`uninstall_relay`); recorders come and go (hot reloads) by
changing :attr:`SignalRelay.target`, never by touching signals.

Without the C extension (it is built with ``optional=True``) the Python-level handler writes the
pipe itself: signals are then seen only when the main thread runs Python, so a rank blocked in C
is not dumped until its call returns, and the process ends with ``os._exit(128 + signum)`` when
it cannot re-raise from the main thread.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any, Protocol

from obs._core import native
from obs._core.internal import report_internal_error
from recorder.hotpath import HOTPATH

__all__ = ["DUMP_BUDGET_S", "GRACE_S", "SIGNALS", "SignalRelay", "SignalTarget", "install_relay", "relay",
           "uninstall_relay"]

logger = logging.getLogger("obs")

SIGNALS = (signal.SIGTERM, signal.SIGINT)
#: the longest a dump on a signal may take before the process is ended anyway
DUMP_BUDGET_S = 3.0
#: a second signal this long after the first ends the process at once; within it, the main thread's
#: Python handler has this long to take over before a default SIGINT ends the process
GRACE_S = 1.0


class SignalTarget(Protocol):
    """What the relay asks of the recorder's triggers."""

    def signal_dump(self, name: str, budget_s: float) -> bool:
        """Marker + one bundle (or let a dump under way finish); True when it finished within ``budget_s``."""

    def dumping_here(self) -> bool:
        """Whether the calling thread is in the middle of a dump."""

    def ending(self, name: str, complete: bool) -> None:
        """The process is about to die of ``name``: final marker, ring kept unless ``complete``."""

    def stop_dumps(self, budget_s: float) -> bool:
        """The process ends next: let a dump under way finish and start no other; False when ``budget_s`` ran out."""


def _native() -> Any:
    hot = HOTPATH.load()
    if hot is None:
        if native.switched_off(HOTPATH.part):
            return None
        logger.warning("obs: the recorder's C extension (recorder._hotpath) is not built: SIGTERM/SIGINT are "
                       "handled only when the main thread runs Python, so a rank blocked in a collective or "
                       "another C call is not dumped on a signal (its ring is left for obs rdr recover); "
                       "reinstall obs with a C compiler to get it")
        return None
    # An extension built before the signal functions existed (a stale build) counts as missing.
    return hot if hasattr(hot, "hook_signal") and hasattr(hot, "die") else None


class SignalRelay:
    """The process-wide signal handling of the recorder (see the module docstring)."""

    def __init__(self) -> None:
        self.target: SignalTarget | None = None
        self.native = _native()
        self._prev: dict[int, Any] = {}
        self._read_fd = self._write_fd = -1
        self._thread: threading.Thread | None = None
        self._first: tuple[int, float] | None = None
        self._dumped = threading.Event()  #: the first signal's dump is over (or was skipped)
        self._python_took_over = threading.Event()  #: the main thread called the previous handler
        self._deferred = False  #: the main thread was dumping when its Python handler ran
        self._main_answered = threading.Event()  #: the main thread's Python handler took over or deferred
        self._complete = False
        self._never = threading.Event()  # waited on, never set

    # -- install / uninstall (main thread only) -----------------------------------------------
    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("signal handlers can only be installed on the main thread")
        self._read_fd, self._write_fd = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        os.set_blocking(self._read_fd, True)
        for sig in SIGNALS:
            prev = signal.getsignal(sig)
            if prev == signal.SIG_IGN:
                continue  # ignored before obs (nohup, background jobs): stays ignored, no dump
            self._prev[sig] = prev
            signal.signal(sig, self._python_handler)
            if self.native is not None:
                self.native.hook_signal(int(sig))
        if self.native is not None:
            self.native.set_signal_pipe(self._write_fd)
        self._thread = threading.Thread(target=self._watch, name="obs-rdr-signals", daemon=True)
        self._thread.start()

    def uninstall(self) -> None:
        """Put every handler back (main thread only), stop the watcher thread, close the pipe."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("signal handlers can only be restored on the main thread")
        if self.native is not None:
            self.native.set_signal_pipe(-1)
        self._restore()
        if self._thread is not None:
            os.write(self._write_fd, b"\0")  # wakes the watcher, which stops
            self._thread.join()
            self._thread = None
        self._prev = {}  # only now: a signal being handled still reads what was there before obs
        self._close_pipe()

    def detach(self) -> None:
        """In a forked child: put the handlers back; the watcher thread did not survive the fork."""
        if self.native is not None:
            self.native.set_signal_pipe(-1)
        self._restore()
        self._thread = None
        self._prev = {}
        self._close_pipe()

    def _restore(self) -> None:
        for sig, prev in self._prev.items():
            if self.native is not None:
                self.native.unhook_signal(int(sig))
            if signal.getsignal(sig) == self._python_handler:
                signal.signal(sig, prev if prev is not None else signal.SIG_DFL)

    def _close_pipe(self) -> None:
        for fd in (self._read_fd, self._write_fd):
            if fd >= 0:
                os.close(fd)
        self._read_fd = self._write_fd = -1

    # -- the main thread's Python handler -----------------------------------------------------
    def _python_handler(self, signum: int, frame: Any) -> None:
        if self.native is None:
            try:
                os.write(self._write_fd, bytes((signum,)))
            except OSError:
                pass
        target = self.target
        if target is not None and target.dumping_here():
            # This thread is inside a dump: let it finish; the watcher ends the process after it.
            self._deferred = True
            self._main_answered.set()
            return
        self._dumped.wait(DUMP_BUDGET_S + 1.0)
        prev = self._prev.get(signum)
        if callable(prev):
            self._python_took_over.set()
            self._main_answered.set()
            prev(signum, frame)  # Python's default SIGINT handler raises KeyboardInterrupt here
        elif self.native is None:
            self._die(signum)  # no C handler: the main thread re-raises the default action itself
        else:
            # The watcher ends the process now; the training must not run on (or exit cleanly) meanwhile.
            self._never.wait(GRACE_S + DUMP_BUDGET_S)

    # -- the watcher thread -------------------------------------------------------------------
    def _watch(self) -> None:
        fd = self._read_fd
        while True:
            try:
                data = os.read(fd, 64)
            except InterruptedError:
                continue
            except OSError:
                return
            for signum in data:
                if signum == 0:
                    return
                try:
                    self._on_signal(signum)
                except Exception as exc:  # noqa: BLE001 - never lose the watcher: the next signal must still work
                    report_internal_error("rdr signal watcher", exc)

    def _on_signal(self, signum: int) -> None:
        now = time.monotonic()
        if self._first is not None:
            if now - self._first[1] >= GRACE_S:
                self._die(signum)  # a second signal after the grace period: at once
            return
        self._first = (signum, now)
        name = signal.Signals(signum).name
        target = self.target
        if target is not None:
            try:
                self._complete = target.signal_dump(name, DUMP_BUDGET_S)
            finally:
                self._dumped.set()
        else:
            self._dumped.set()
        self._end_if_default(signum)

    def _end_if_default(self, signum: int) -> None:
        """End the process where the signal's default action would have (and nobody else will)."""
        if self._deferred:
            self._end_after_dumps(signum)  # the signal arrived during a dump on the main thread
        prev = self._prev.get(signum)
        if prev in (signal.SIG_DFL, None):
            if self.native is not None:
                self._end_after_dumps(signum)
            return  # without the C handler, the main thread's Python handler re-raises
        if prev is signal.default_int_handler and not self._python_took_over.is_set():
            # KeyboardInterrupt needs the main thread; blocked in C, it never comes: end as SIGINT's
            # default action would have.  If its handler ran inside a dump the main thread started
            # meanwhile, that dump finishes first (no half bundle), then the process ends.
            self._main_answered.wait(GRACE_S)
            if self._deferred or not self._python_took_over.is_set():
                self._end_after_dumps(signum)
        # A handler of the user's own decides how the process ends; a later signal ends it at once.

    def _end_after_dumps(self, signum: int) -> None:
        """Die, once a dump the training thread may have started meanwhile is over (none starts after it), so
        the end never cuts a bundle short; skipped when the signal's own dump overran its budget."""
        target = self.target
        if target is not None and self._complete:
            target.stop_dumps(DUMP_BUDGET_S)
        self._die(signum)

    def _die(self, signum: int) -> None:
        target = self.target
        if target is not None:
            try:
                target.ending(signal.Signals(signum).name, self._complete)
            except Exception as exc:  # noqa: BLE001 - the process ends anyway
                report_internal_error("rdr signal ending", exc)
        if self.native is not None:
            self.native.die(signum)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        os._exit(128 + signum)


_relay: SignalRelay | None = None


def relay() -> SignalRelay | None:
    """The installed relay, or None."""
    return _relay


def install_relay() -> SignalRelay | None:
    """The relay, installed now if this is the main thread; None off the main thread when none is installed."""
    global _relay
    if _relay is None and threading.current_thread() is threading.main_thread():
        new = SignalRelay()
        new.install()
        _relay = new
    return _relay


def uninstall_relay() -> bool:
    """Restore the handlers (main thread only; elsewhere the relay stays, with no target).  True when done."""
    global _relay
    if _relay is None:
        return True
    _relay.target = None
    if threading.current_thread() is not threading.main_thread():
        return False
    _relay.uninstall()
    _relay = None
    return True


def after_fork_in_child() -> None:
    """A forked child (DataLoader worker) does not dump: put the handlers back without the dead thread."""
    global _relay
    if _relay is not None:
        _relay.target = None
        _relay.detach()
        _relay = None

