"""Watch one file for edits, atomic saves (write-then-rename) and re-creation; debounce; call back.

The parent folder is watched (editors replace files by renaming over them, which a watch on the
file itself would miss).  Bursts of events collapse into one callback after ``debounce_s`` of
quiet.  ``stop()`` stops and joins both threads.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from obs._core.internal import report_internal_error

__all__ = ["FileWatcher"]


class _QuietStopRace(logging.Filter):
    """watchdog logs an ERROR when an inotify event races the observer's stop (benign: we are stopping)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "called when the thread is inactive" not in record.getMessage()


_quiet = _QuietStopRace()


class FileWatcher:
    """Calls ``on_change()`` on a worker thread after the file at ``path`` changed."""

    def __init__(self, path: str, on_change: Callable[[], None], *, debounce_s: float = 0.2) -> None:
        from watchdog.events import FileSystemEventHandler
        from watchdog.observers import Observer

        inotify_log = logging.getLogger("watchdog.observers.inotify")
        if _quiet not in inotify_log.filters:
            inotify_log.addFilter(_quiet)

        self.path = os.path.realpath(path)
        self._folder = os.path.dirname(self.path)
        self._on_change = on_change
        self._debounce_s = debounce_s
        self._cond = threading.Condition()
        self._deadline: float | None = None
        self._stopping = False
        self.callbacks = 0  #: how many times on_change ran (tests wait on it)

        watcher = self

        class _Handler(FileSystemEventHandler):
            def on_any_event(self, event: object) -> None:
                paths = (getattr(event, "src_path", ""), getattr(event, "dest_path", ""))
                if any(p and os.path.realpath(os.fsdecode(p)) == watcher.path for p in paths):
                    watcher.poke()

        self._observer = Observer()
        self._observer.schedule(_Handler(), self._folder, recursive=False)
        self._worker = threading.Thread(target=self._run, name="obs-config-watch", daemon=True)

    def start(self) -> FileWatcher:
        self._observer.start()
        self._worker.start()
        return self

    def poke(self) -> None:
        """Note a change now; the callback runs once things have been quiet for ``debounce_s``."""
        with self._cond:
            self._deadline = time.monotonic() + self._debounce_s
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and self._deadline is None:
                    self._cond.wait()
                if self._stopping:
                    return
                remaining = self._deadline - time.monotonic() if self._deadline is not None else 0.0
                if remaining > 0:
                    self._cond.wait(remaining)
                    continue
                self._deadline = None
            try:
                self._on_change()
            except Exception as exc:  # noqa: BLE001 - reported; the watcher thread lives on
                report_internal_error("config watcher callback", exc)
            with self._cond:
                self.callbacks += 1
                self._cond.notify_all()

    def wait_callbacks(self, count: int, timeout: float) -> bool:
        """Block until ``on_change`` ran ``count`` times in all; False on timeout."""
        end = time.monotonic() + timeout
        with self._cond:
            while self.callbacks < count:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def stop(self) -> None:
        """Stop watching and join both threads; idempotent."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._observer.is_alive():
            self._observer.stop()
            self._observer.join()
        if self._worker.is_alive() and self._worker is not threading.current_thread():
            self._worker.join()
