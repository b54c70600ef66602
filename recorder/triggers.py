"""What makes a recorder dump: uncaught exceptions, signals, fatal signals, hangs, the end of the run.

Each trigger chains to what was installed before it (the previous excepthook or signal
handler still runs, and a process killed by a signal still dies of it, with the same status
as without obs).  ``uninstall()`` puts every previous handler back.
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import signal
import sys
import threading
import time
from typing import Any

from obs._core.internal import report_internal_error
from recorder.recorder import Recorder

__all__ = ["Triggers", "progress"]

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def progress(recorder: Recorder) -> int:
    """How many events the ring has recorded so far (read without touching the hot path)."""
    return int(repr(recorder.ring.seq)[6:-1])  # itertools.count repr is "count(N)"


class Triggers:
    """Installs the dump triggers of one recorder."""

    def __init__(self, recorder: Recorder, *, mode: int, op_timeout: int, hang_action: str) -> None:
        self.recorder = recorder
        self.mode, self.op_timeout, self.hang_action = mode, op_timeout, hang_action
        self.abnormal = False  #: an exception or signal ended (or is ending) the run
        self._sigint_dumped = False
        self._prev_sys: Any = None
        self._prev_thread: Any = None
        self._prev_signals: dict[int, Any] = {}
        self._fatal: Any = None
        self._faulthandler_was: bool = False
        self._stop = threading.Event()
        self._watchdog: threading.Thread | None = None

    # -- install / uninstall ------------------------------------------------------------------
    def install(self) -> Triggers:
        self._prev_sys, sys.excepthook = sys.excepthook, self._sys_hook
        self._prev_thread, threading.excepthook = threading.excepthook, self._thread_hook
        if threading.current_thread() is threading.main_thread():
            for sig in _SIGNALS:
                self._prev_signals[sig] = signal.getsignal(sig)
                signal.signal(sig, self._on_signal)
        fd = os.open(self.recorder.fatal_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        self._fatal = os.fdopen(fd, "w")
        self._faulthandler_was = faulthandler.is_enabled()
        faulthandler.enable(self._fatal, all_threads=True)
        self.start_watchdog()
        atexit.register(self._at_exit)
        return self

    def uninstall(self) -> None:
        atexit.unregister(self._at_exit)
        self.stop_watchdog()
        self._restore(close_fatal_file=True)

    def detach(self) -> None:
        """In a forked child: put every handler back without dumping or closing anything."""
        atexit.unregister(self._at_exit)
        self._watchdog = None  # threads do not survive fork
        self._restore(close_fatal_file=False)  # the parent's file: the child only drops its copy

    def _restore(self, *, close_fatal_file: bool) -> None:
        if sys.excepthook == self._sys_hook:
            sys.excepthook = self._prev_sys
        if threading.excepthook == self._thread_hook:
            threading.excepthook = self._prev_thread
        for sig, prev in self._prev_signals.items():
            if signal.getsignal(sig) == self._on_signal:
                signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
        self._prev_signals = {}
        if self._fatal is not None:
            faulthandler.disable()
            if self._faulthandler_was:
                faulthandler.enable()
            if close_fatal_file:
                self._fatal.close()
            self._fatal = None

    def start_watchdog(self) -> None:
        if self.op_timeout > 0 and self.recorder.config.granularity != "off" and self._watchdog is None:
            self._stop.clear()
            self._watchdog = threading.Thread(target=self._watch, name="obs-rdr-watchdog", daemon=True)
            self._watchdog.start()

    def stop_watchdog(self) -> None:
        if self._watchdog is not None:
            self._stop.set()
            self._watchdog.join()
            self._watchdog = None

    # -- triggers -----------------------------------------------------------------------------
    def _dump(self, reason: str, **kwargs: Any) -> None:
        try:
            self.recorder.dump(reason, **kwargs)
        except Exception as exc:  # a failed dump must not change how the process ends
            report_internal_error(f"rdr dump ({reason})", exc)

    def _sys_hook(self, etype: type[BaseException], value: BaseException, tb: Any) -> None:
        self.abnormal = True
        if not (isinstance(value, KeyboardInterrupt) and self._sigint_dumped):
            self._dump("exception", error=value, fault={"kind": "exception", "where": "main thread"})
        self._prev_sys(etype, value, tb)

    def _thread_hook(self, args: Any) -> None:
        if args.exc_type is not SystemExit:
            name = args.thread.name if args.thread is not None else "?"
            self._dump("thread_exception", error=args.exc_value, fault={"kind": "thread_exception", "where": name})
        self._prev_thread(args)

    def _on_signal(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        self.abnormal = True
        self.recorder.marker("signal", signal=name)
        self._dump(name, fault={"kind": "signal", "where": name})
        if signum == signal.SIGINT:
            self._sigint_dumped = True
        prev = self._prev_signals.get(signum)
        if callable(prev):
            prev(signum, frame)  # e.g. Python's default SIGINT handler raises KeyboardInterrupt
        elif prev != signal.SIG_IGN:
            # Die of the signal as without us: default action, re-raised.
            self.recorder.close(clean_exit=True, state=f"killed by {name}")
            self.uninstall()
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def _watch(self) -> None:
        interval = min(1.0, self.op_timeout / 4)
        last, since, fired = -1, time.monotonic(), False
        while not self._stop.wait(interval):
            now, count = time.monotonic(), progress(self.recorder)
            if count != last:
                last, since, fired = count, now, False
                continue
            if fired or self.recorder.step < 1 or now - since < self.op_timeout:
                continue
            fired = True
            idle = round(now - since, 3)
            self.recorder.marker("hang", idle_s=idle)
            self._dump("hang", fault={"kind": "hang", "where": f"no progress for {idle} s (op_timeout "
                                                            f"{self.op_timeout} s) in step {self.recorder.step}"})
            if self.hang_action == "abort":
                os.abort()
            last = progress(self.recorder)  # our own marker is not progress

    def _at_exit(self) -> None:
        if self.mode == 2 and not self.abnormal:
            self._dump("normal_end")
        self.uninstall()
        self.recorder.close(clean_exit=True)
