"""``obs.Print``: values to the print file (``print_file_path``) or the screen, and the PRINT event.

The applier of ``print_file_path`` follows MindSpore's rules: a path naming a directory is an
IsADirectoryError; an existing name (a file, or a symlink: never followed) is kept and output goes
to ``name.<int(time.time())>``; when that exists too, ValueError.  An existing device, FIFO or socket
is refused (a ValueError): obs never writes to one, nor beside one.  Only the folders of the path are
resolved; its last component is opened with ``O_NOFOLLOW`` (created with ``O_EXCL``).

Checking has no side effects and applying creates nothing: the folders (0700) and the file (0600)
are made by :mod:`obs._core.safe_files` on the first Print call, so a run that never prints leaves no
file.  The file is fsynced and closed on reset, on a new path, at exit and on a fault.  Child
processes append to the same file: forked ones (DataLoader workers) share the open descriptor or
open the path on their first call, spawned ones find it in ``$OBS_PRINT_FILE``.  Each process counts
its own calls (``seq``); a call's ``parent_pid`` names the process that set ``print_file_path``.
"""

from __future__ import annotations

import atexit
import errno
import itertools
import os
import stat
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

from obs._core import env, outputs, safe_files
from obs._core.demands import demands
from obs._core.errors import ObsConfigError, UnsafePathError, shorten
from obs._core.events import Event, Subscription, bus
from obs._core.internal import report_internal_error
from obs.runtime.steps import tracker
from obs.settings.parallel import rank
from printsink.encoder import CallMeta, encode_record
from printsink.screen import format_items
from printsink.values import Item, normalize
from printsink.writer import PrintWriter

__all__ = ["ENV_PRINT_FILE", "ENV_PRINT_PID", "Print", "PrintFeature", "feature", "print_values", "publish",
           "resolve_print_path"]

ENV_PRINT_FILE, ENV_PRINT_PID = env.OBS_PRINT_FILE, env.OBS_PRINT_PID

_seq = itertools.count(1)
_screen_lock = threading.Lock()
_PATH_MAX = 4096


def _check_name(path: str) -> None:
    if "\0" in path:
        raise ObsConfigError(f"print_file_path must not contain a NUL character (got {shorten(path)})",
                             option="print_file_path", value=path)
    try:
        encoded = os.fsencode(path)
    except UnicodeEncodeError as exc:
        raise ObsConfigError(f"print_file_path cannot be encoded as a file name ({exc.reason} at character "
                             f"{exc.start}): {shorten(path)}", option="print_file_path", value=path) from None
    if len(encoded) >= _PATH_MAX:
        raise ObsConfigError(f"print_file_path is {len(encoded)} bytes long; paths must be shorter than {_PATH_MAX} "
                             f"bytes (got {shorten(path)})", option="print_file_path", value=path)


def _check_folders(folder: str, path: str) -> None:
    """What ``safe_files.ensure_dir(folder)`` will do, checked without doing it (:func:`safe_files.check_dir`), and
    that no folder name is too long and files can be created in the deepest existing one."""
    for name in [p for p in folder.split(os.sep) if p]:
        limit = _name_max(_existing_ancestor(folder))
        if len(os.fsencode(name)) > limit:
            raise ObsConfigError(f"print_file_path has a folder name of {len(os.fsencode(name))} bytes, longer than "
                                 f"this file system allows ({limit}): {shorten(name)}", option="print_file_path",
                                 value=path)
    try:
        deepest = safe_files.check_dir(folder)
    except OSError as exc:
        if isinstance(exc, (UnsafePathError, NotADirectoryError)):
            raise
        raise ObsConfigError(f"print_file_path {shorten(path)}: cannot look at its folders: {exc.strerror}",
                             option="print_file_path", value=path) from None
    if not os.access(deepest, os.W_OK | os.X_OK):
        raise PermissionError(errno.EACCES, f"print_file_path {path!r}: cannot create files in {deepest!r} "
                              "(no write permission)")


def _name_max(folder: str) -> int:
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def resolve_print_path(path: str) -> str:
    """Where output for ``print_file_path=path`` goes; raises as MindSpore's set_context does.  No side effects.

    Only the folders are resolved to an absolute path; the last component is looked at, never followed.
    """
    _check_name(path)
    full = os.path.abspath(path)
    folder, base = os.path.split(full)
    _check_folders(folder, path)
    limit = _name_max(_existing_ancestor(folder))
    if len(os.fsencode(base)) > limit:
        raise ObsConfigError(f"print_file_path's file name is {len(os.fsencode(base))} bytes, longer than this file "
                             f"system allows ({limit}): {shorten(base)}", option="print_file_path", value=path)
    try:
        info = os.lstat(full)
    except FileNotFoundError:
        return full
    if stat.S_ISDIR(info.st_mode):
        raise IsADirectoryError(f"print_file_path must be a file path, but {path!r} is a directory")
    if not (stat.S_ISREG(info.st_mode) or stat.S_ISLNK(info.st_mode)):
        kind = ("a character device" if stat.S_ISCHR(info.st_mode) else "a block device" if stat.S_ISBLK(info.st_mode)
                else "a FIFO" if stat.S_ISFIFO(info.st_mode) else "a socket")
        raise ObsConfigError(f"print_file_path {path!r} is {kind}, not a regular file: obs writes print files only "
                             "to regular files (unset print_file_path to print to the screen)",
                             option="print_file_path", value=path)
    renamed = f"{full}.{int(time.time())}"
    if len(os.fsencode(os.path.basename(renamed))) > limit:
        raise ObsConfigError(f"print_file_path {shorten(path)} exists, and the name output would go to instead "
                             f"({shorten(os.path.basename(renamed))}) is longer than this file system allows "
                             f"({limit} bytes); choose another path", option="print_file_path", value=path)
    if os.path.lexists(renamed):
        raise ValueError(f"print_file_path {path!r} exists, and so does {renamed!r} that output would go to "
                         "instead; choose another path")
    return renamed


def _existing_ancestor(folder: str) -> str:
    while not os.path.isdir(folder):
        folder = os.path.dirname(folder)
    return folder


def _open_print_file(path: str) -> PrintWriter:
    """Create (or, when another process of this job made it first, join) the print file; never through a
    symlink, only a regular file of this user.  Folders made here are removed again when opening fails."""
    folder = os.path.dirname(path)
    missing = []
    probe = folder
    while not os.path.lexists(probe):
        missing.append(probe)
        probe = os.path.dirname(probe)
    try:
        try:
            fd = safe_files.create_file(path, append=True)
        except FileExistsError:
            fd = safe_files.open_append(path, what="print file")
    except BaseException:
        for created in missing:  # deepest first; only the empty ones we made
            try:
                os.rmdir(created)
            except OSError:
                break
        raise
    return PrintWriter(path, fd=fd)



class PrintFeature:
    """Holds the print file, if any.  ``writer`` is None when Print goes to the screen or has not printed yet."""

    keys = frozenset({"print_file_path"})

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.writer: PrintWriter | None = None
        self.target: str | None = None  # where the file goes (set by set_context, or $OBS_PRINT_FILE in a child)
        self.parent_pid = 0  # the process that set print_file_path
        self._inherited = False  # target from $OBS_PRINT_FILE in a child process
        self._fault_sub: Subscription | None = None
        self._steps: Any = None  # the step-detection demand held while a print file is set

    @property
    def path(self) -> str | None:
        """The print file's path (whether or not it exists yet), or None when Print goes to the screen."""
        writer = self.writer
        return writer.path if writer is not None else self.target

    def prepare(self, values: Mapping[str, Any], changes: Mapping[str, Any]) -> str | None:
        path = values.get("print_file_path", "")
        return resolve_print_path(path) if path else None

    def commit(self, target: str | None, values: Mapping[str, Any], changes: Mapping[str, Any]) -> None:
        global _seq
        self.close()
        if target is None:
            return
        _seq = itertools.count(1)  # a new file numbers its calls from 1
        with self._lock:
            self.target, self.parent_pid = target, os.getpid()
        os.environ[ENV_PRINT_FILE] = target
        os.environ[ENV_PRINT_PID] = str(self.parent_pid)
        self._fault_sub = bus.subscribe(Event.FAULT, self._on_fault)
        self._steps = tracker.require("Print to file")  # records carry the step: count optimizer steps

    def close(self) -> None:
        """fsync and close the file; Print goes back to the screen."""
        with self._lock:
            writer, self.writer = self.writer, None
            target, self.target = self.target, None
            inherited, self._inherited = self._inherited, False
        if self._fault_sub is not None:
            self._fault_sub.remove()
            self._fault_sub = None
        if self._steps is not None:
            self._steps.remove()
            self._steps = None
        if target is not None and not inherited and os.environ.get(ENV_PRINT_FILE) == target:
            del os.environ[ENV_PRINT_FILE]
            os.environ.pop(ENV_PRINT_PID, None)
        if writer is not None:
            writer.close()

    def current(self) -> PrintWriter | None:
        """The open writer, opened on the first call (here, or in a child started with $OBS_PRINT_FILE)."""
        writer = self.writer
        if writer is not None:
            return writer
        if self.target is None and ENV_PRINT_FILE not in os.environ:
            return None
        with self._lock:
            if self.writer is None:
                if self.target is None:
                    self.target, self._inherited = os.environ[ENV_PRINT_FILE], True
                    self.parent_pid = int(os.environ.get(ENV_PRINT_PID, "0") or 0)
                self.writer = self._open(self.target)
                outputs.wrote("print file", self.writer.path)
            return self.writer

    @staticmethod
    def _open(target: str) -> PrintWriter:
        try:
            return _open_print_file(target)
        except UnsafePathError:  # a name planted since set_context: sidestep it, as MindSpore does for any
            return _open_print_file(f"{target}.{int(time.time())}")

    def fsync(self) -> None:
        writer = self.writer
        if writer is not None:
            writer.fsync()

    def _on_fault(self, kind: str, detail: Any, error: Any) -> None:
        self.fsync()

    def _after_fork(self) -> None:
        global _seq
        _seq = itertools.count(1)  # each process numbers its own calls: (pid, seq) is unique in the file
        writer = self.writer
        if writer is not None:
            writer._lock = threading.Lock()
        self._lock = threading.Lock()


feature = PrintFeature()
atexit.register(feature.fsync)
os.register_at_fork(after_in_child=feature._after_fork)


def _step() -> int:
    """The step a call made now belongs to.

    Where only the optimizer hooks detect steps (Print to file, RDR ``step`` granularity), step N has not begun
    while its forward runs: a call inside a module call with grad enabled begins it, as the module hooks would.
    """
    if not tracker.in_step and not tracker.explicit and tracker.detecting:
        torch = sys.modules.get("torch")
        if torch is not None and torch.is_grad_enabled() and _in_module_call(torch):
            tracker.auto_begin()
    return tracker.step


def _in_module_call(torch: Any) -> bool:
    code = torch.nn.Module._call_impl.__code__
    frame: Any = sys._getframe()
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def publish(values: tuple[Any, ...], source: str) -> list[Item]:
    """Write one Print call (file or screen) and emit PRINT; bad values raise before anything is written."""
    items = normalize(values)
    writer = None
    try:
        writer = feature.current()
    except OSError as exc:  # the file could not be made (a race since set_context): say so, print to the screen
        report_internal_error(f"Print: opening {feature.target}", exc)
    meta = CallMeta(next(_seq), time.time_ns(), _step(), rank(), os.getpid(), source, len(items),
                    feature.parent_pid if writer is not None else 0)
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
    Inside ``torch.compile`` it becomes a side-effecting custom op, so it causes no graph break, and
    the call site traced is recorded as its source.
    """
    print_values(values, 2)


def print_values(values: tuple[Any, ...], depth: int) -> None:
    """One Print call (:func:`Print`, ``obs.ops.Print``), its source the caller ``depth`` frames up from here; inside
    ``torch.compile``, the custom op that prints when the graph runs."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.compiler.is_compiling():
        from obs.runtime.torch import print_in_graph

        print_in_graph(values)
        return
    frame = sys._getframe(depth)
    publish(values, f"{frame.f_code.co_filename}:{frame.f_lineno}")


demands.print_sink = publish  # a Print compiled into a graph comes back here when the graph runs
