"""Create and open obs's files and folders safely: the one place every writer and reader goes through.

The rules (docs/reliability.md): folders 0700, files 0600; the final component is opened with
``O_EXCL|O_NOFOLLOW`` (never through a symlink, never over a file someone planted); temporary
files get unpredictable names; a symlink is never followed inside a folder that other users can
write to (a shared ``/tmp``).  Readers of obs's own folders open with ``O_NOFOLLOW`` and take only
regular files owned by the current user.

Every refusal is an :class:`~obs._core.errors.UnsafePathError` naming the path and the reason.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import secrets
import shutil
import stat
from collections.abc import Callable

from obs._core.errors import UnsafePathError

__all__ = ["DIR_MODE", "FILE_MODE", "TMP_FOLDER_PREFIX", "check_dir", "create_file", "ensure_dir", "fsync_dir",
           "new_folder", "open_append", "open_private", "read_private", "safe_name", "temp_path", "write_atomic",
           "write_new"]

DIR_MODE, FILE_MODE = 0o700, 0o600
TMP_FOLDER_PREFIX = ".tmp-"  #: a folder :func:`new_folder` has not finished starts with this (readers skip it)
PORTABLE = "A-Za-z0-9_.-"  #: the characters :func:`safe_name` keeps by default (a regex class body)
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


def _others_can_write(folder_stat: os.stat_result) -> bool:
    return bool(folder_stat.st_mode & _OTHERS_WRITE)


def ensure_dir(path: str) -> str:
    """Create ``path`` and every missing parent 0700; returns ``path``.

    Existing folders are kept as they are.  A component that is a symlink is followed only when the
    folder holding it is writable by its owner alone; anything else that is not a folder raises.
    """
    return _walk(path, create=True)


def check_dir(path: str) -> str:
    """What :func:`ensure_dir` would do, checked without creating anything (same errors); returns the deepest
    folder of ``path`` that exists."""
    return _walk(path, create=False)


def _walk(path: str, *, create: bool) -> str:
    path = os.path.abspath(path)
    current = deepest = os.sep
    for name in [p for p in path.split(os.sep) if p]:
        parent, current = current, os.path.join(current, name)
        try:
            info = os.lstat(current)
        except FileNotFoundError:
            if not create:
                return deepest  # the rest would be created
            try:
                os.mkdir(current, DIR_MODE)
                continue
            except FileExistsError:  # created by another process in between: check what it is
                info = os.lstat(current)
        if stat.S_ISLNK(info.st_mode):
            if _others_can_write(os.stat(parent)):
                raise UnsafePathError(f"refusing to follow the symlink {current!r}: it sits in {parent!r}, a folder "
                                      "other users can write to (anyone there could have planted it); use the real "
                                      f"folder {os.path.realpath(current)!r} instead", path=current)
            info = os.stat(current)
        if not stat.S_ISDIR(info.st_mode):
            raise NotADirectoryError(errno.ENOTDIR, f"{current!r} is not a folder (needed for {path!r})")
        deepest = current
    return path if create else deepest


def create_file(path: str, *, append: bool = False, read: bool = False, folder_ready: bool = False) -> int:
    """Create ``path`` (0600) and return its descriptor; it must not exist yet (``O_EXCL``), and the final
    component is never a symlink (``O_NOFOLLOW``).  Missing folders are created by :func:`ensure_dir`, unless the
    caller made and checked the folder already (``folder_ready``: then it is one ``open``, for hot writers)."""
    if not folder_ready:
        ensure_dir(os.path.dirname(os.path.abspath(path)))
    flags = (os.O_RDWR if read else os.O_WRONLY) | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    if append:
        flags |= os.O_APPEND
    return os.open(path, flags, FILE_MODE)


def safe_name(text: str, *, limit: int = 64, keep: str = PORTABLE, runs: bool = True) -> str:
    """``text`` (a reason, an op or module name: anything) as one path component, safe to join to a folder.

    Each character outside ``keep`` (a regex class body) becomes ``_``; with ``runs``, a run of them becomes one
    ``_`` and ``.``/``_`` are trimmed from both ends.  Never empty (``unnamed``, or ``_`` without ``runs``), never
    ``.``, ``..`` or a hidden name.  Over ``limit`` characters it is cut and ended with ``~`` and 10 hex digits of
    the SHA-1 of the whole name, so that long names that differ past the cut stay distinct."""
    if runs:
        name = re.sub(f"[^{keep}]+", "_", text).strip("._") or "unnamed"
    else:
        name = re.sub(f"[^{keep}]", "_", text) or "_"
        if name.startswith("."):
            name = "_" + name[1:]
    if len(name) > limit:
        name = f"{name[:limit - 11]}~{hashlib.sha1(name.encode()).hexdigest()[:10]}"
    return name


def write_new(path: str, *chunks: bytes | memoryview, folder_ready: bool = False) -> None:
    """Create ``path`` with :func:`create_file` (it must not exist) and write ``chunks`` to it."""
    fd = create_file(path, folder_ready=folder_ready)
    try:
        for chunk in chunks:
            view = memoryview(chunk).cast("B")
            while view:
                view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def open_append(path: str, *, what: str = "file") -> int:
    """Open an existing file of obs's to append to it: a regular file of this user, reached without a symlink
    (``what`` names it in the refusal).  Returns a blocking descriptor."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafePathError(f"refusing to write the {what} through {path!r}: it is a symlink (planted "
                                  "after obs created it?)", path=path) from None
        raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
        os.close(fd)
        raise UnsafePathError(f"refusing to write the {what} {path!r}: it is not a regular file of this user "
                              "(planted after obs created it?)", path=path)
    os.set_blocking(fd, True)
    return fd


def fsync_dir(path: str) -> None:
    """Make the entries of folder ``path`` durable (after a create or a rename in it)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_path(path: str) -> str:
    """An unpredictable sibling name for writing ``path`` before renaming it into place."""
    folder, base = os.path.split(path)
    return os.path.join(folder, f".{base}.tmp-{secrets.token_hex(8)}")


def write_atomic(path: str, data: bytes | str, *, fsync: bool = True, folder_ready: bool = False) -> None:
    """Replace ``path`` with ``data`` through a fresh temporary file and a rename (readers see old or new).

    ``folder_ready``: the folder is not made when missing (see :func:`create_file`): a ``FileNotFoundError``
    then, for a writer into a folder someone else owns and may remove."""
    tmp = temp_path(path)
    fd = create_file(tmp, folder_ready=folder_ready)
    try:
        view = memoryview(data.encode() if isinstance(data, str) else data)
        while view:
            view = view[os.write(fd, view):]
        if fsync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        _unlink_quietly(tmp)
        raise
    os.close(fd)
    try:
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise


def new_folder(parent: str, name: str, fill: Callable[[str], None], *, fsync: bool = False) -> str:
    """Create the folder ``parent/name`` complete or not at all, and return its path.

    ``fill(tmp)`` writes the folder's files into ``tmp``: a fresh folder (0700, made by ``mkdir``, so nothing can be
    planted in it) with a hidden, unpredictable name starting with :data:`TMP_FOLDER_PREFIX`.  Once ``fill``
    returns it is renamed to ``name``, or to ``name-2``, ``name-3``... where that is taken: never over another
    folder.  On any error it is removed and the error propagates.  ``fsync``: every folder in it, and ``parent``,
    are on disk when this returns (``fill`` syncs its own files)."""
    ensure_dir(parent)
    tmp = os.path.join(parent, f"{TMP_FOLDER_PREFIX}{name}-{secrets.token_hex(6)}")
    os.mkdir(tmp, DIR_MODE)  # fails if anything is there: nothing planted is reused
    try:
        fill(tmp)
        if fsync:
            for folder, _, _ in os.walk(tmp):
                fsync_dir(folder)
        final, n = os.path.join(parent, name), 1
        while os.path.lexists(final):
            n += 1
            final = os.path.join(parent, f"{name}-{n}")
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if fsync:
        fsync_dir(parent)
    return final


def open_private(path: str, *, owned: bool = True) -> int:
    """Open ``path`` read-only for a reader of obs's folders: never through a symlink, only a regular file,
    and (``owned``) only one that belongs to the current user.  Returns the descriptor."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafePathError(f"refusing to read {path!r}: it is a symlink", path=path) from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnsafePathError(f"refusing to read {path!r}: not a regular file", path=path)
        if owned and info.st_uid != os.geteuid():
            raise UnsafePathError(f"refusing to read {path!r}: it belongs to uid {info.st_uid}, not to this user "
                                  f"(uid {os.geteuid()})", path=path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_private(path: str, *, limit: int | None = None, owned: bool = True) -> bytes:
    """The bytes of ``path`` opened by :func:`open_private`; at most ``limit`` bytes when given."""
    fd = open_private(path, owned=owned)
    with os.fdopen(fd, "rb") as fh:
        return fh.read() if limit is None else fh.read(limit)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
