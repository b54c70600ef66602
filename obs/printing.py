"""``obs.Print``: values to the print file (``print_file_path``) or the screen, and the PRINT event.

The applier of ``print_file_path`` follows MindSpore's rules: a path naming a directory is an
IsADirectoryError; an existing file is kept and output goes to ``name.<int(time.time())>``; when
that exists too, ValueError.  Checking has no side effects; the file is created (0600, never
through a symlink) when the setting is applied, fsynced and closed on reset, on a new path, at
exit and on a fault.  Spawned child processes (DataLoader workers) append to the same file
through ``$OBS_PRINT_FILE``; forked ones share the open descriptor.
"""

from __future__ import annotations

import atexit
import itertools
import os
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

from obs._core.events import Event, Subscription, bus
from obs._core.internal import report_internal_error
from obs.runtime.steps import tracker
from obs.settings.parallel import rank
from printsink.encoder import CallMeta, encode_record
from printsink.screen import format_items
from printsink.values import Item, normalize
from printsink.writer import PrintWriter

__all__ = ["ENV_PRINT_FILE", "Print", "PrintFeature", "feature", "publish"]

ENV_PRINT_FILE = "OBS_PRINT_FILE"

_seq = itertools.count(1)
_screen_lock = threading.Lock()


def resolve_print_path(path: str) -> str:
    """Where output for ``print_file_path=path`` goes; raises as MindSpore's set_context does."""
    real = os.path.realpath(path)
    if os.path.isdir(real):
        raise IsADirectoryError(f"print_file_path must be a file path, but {path!r} is a directory")
    if not os.path.lexists(real):
        return real
    renamed = f"{real}.{int(time.time())}"
    if os.path.lexists(renamed):
        raise ValueError(f"print_file_path {path!r} exists, and so does {renamed!r} that output would go to "
                         "instead; choose another path")
    return renamed


class PrintFeature:
    """Holds the open print file, if any.  ``writer`` is None when Print goes to the screen."""

    keys = frozenset({"print_file_path"})

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.writer: PrintWriter | None = None
        self._inherited = False  # opened from $OBS_PRINT_FILE in a child process
        self._fault_sub: Subscription | None = None

    def prepare(self, values: Mapping[str, Any], changes: Mapping[str, Any]) -> str | None:
        path = values.get("print_file_path", "")
        return resolve_print_path(path) if path else None

    def commit(self, target: str | None, values: Mapping[str, Any], changes: Mapping[str, Any]) -> None:
        writer = None
        if target is not None:
            parent = os.path.dirname(target)
            os.makedirs(parent, mode=0o700, exist_ok=True)
            writer = PrintWriter(target, exclusive=True)
        self.close()
        with self._lock:
            self.writer = writer
        if writer is not None:
            os.environ[ENV_PRINT_FILE] = writer.path
            self._fault_sub = bus.subscribe(Event.FAULT, self._on_fault)

    def close(self) -> None:
        """fsync and close the file; Print goes back to the screen."""
        with self._lock:
            writer, self.writer = self.writer, None
            inherited, self._inherited = self._inherited, False
        if self._fault_sub is not None:
            self._fault_sub.remove()
            self._fault_sub = None
        if writer is not None:
            if not inherited and os.environ.get(ENV_PRINT_FILE) == writer.path:
                del os.environ[ENV_PRINT_FILE]
            writer.close()

    def current(self) -> PrintWriter | None:
        """The open writer; in a child process started with $OBS_PRINT_FILE, opened on first use."""
        writer = self.writer
        if writer is None and ENV_PRINT_FILE in os.environ:
            with self._lock:
                if self.writer is None:
                    self.writer = PrintWriter(os.environ[ENV_PRINT_FILE], exclusive=False)
                    self._inherited = True
                writer = self.writer
        return writer

    def fsync(self) -> None:
        writer = self.writer
        if writer is not None:
            writer.fsync()

    def _on_fault(self, kind: str, detail: Any, error: Any) -> None:
        self.fsync()

    def _after_fork(self) -> None:
        writer = self.writer
        if writer is not None:
            writer._lock = threading.Lock()


feature = PrintFeature()
atexit.register(feature.fsync)
os.register_at_fork(after_in_child=feature._after_fork)


def publish(values: tuple[Any, ...], source: str) -> list[Item]:
    """Write one Print call (file or screen) and emit PRINT; bad values raise before anything is written."""
    items = normalize(values)
    meta = CallMeta(next(_seq), time.time_ns(), tracker.step, rank(), os.getpid(), source, len(items))
    writer = feature.current()
    try:
        if writer is not None:
            writer.write(encode_record(items, meta))
        else:
            text = format_items(items)
            with _screen_lock:
                sys.stdout.write(text)
                sys.stdout.flush()
    except OSError as exc:
        report_internal_error(f"Print to {writer.path if writer else 'stdout'}", exc)
    if bus.has_subscribers(Event.PRINT):
        bus.emit(Event.PRINT, items, meta)
    return items


def Print(*values: Any) -> None:  # noqa: N802 - MindSpore's name
    """Print strings, tensors (any device), numpy arrays, Python scalars and tuples/lists of them.

    With ``print_file_path`` set, appends one ``mindspore.prntpb.Print`` record per call (read it
    with :func:`obs.parse_print` or ``obs print FILE``); else prints in MindSpore's screen style.
    Inside ``torch.compile`` it becomes a side-effecting custom op, so it causes no graph break.
    """
    _print(values, 2)


def _print(values: tuple[Any, ...], depth: int) -> None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.compiler.is_compiling():
        from obs.runtime.torch._print_op import print_in_graph

        print_in_graph(values)
        return
    frame = sys._getframe(depth)
    publish(values, f"{frame.f_code.co_filename}:{frame.f_lineno}")
