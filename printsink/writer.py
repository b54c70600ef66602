"""Append Print records to a file: one ``writev`` per record, no user-space buffer.

The file is opened ``O_APPEND``, so each record lands contiguously even when threads or
processes (forked DataLoader workers share the descriptor; spawned ones reopen the path) write
at once; a lock keeps a record's continuation writes (after a short write) together within a
process.  When ``write`` returns the record is in the kernel: a kill afterwards loses nothing.

A full disk (``ENOSPC``, ``EDQUOT``, ``EFBIG`` past ``RLIMIT_FSIZE``) never leaves a torn record: the
part of the record that made it is cut off again (``ftruncate`` back to the last whole record), the
record is counted in ``dropped_records`` / ``dropped_bytes``, one :class:`PrintFileFullWarning` is
issued, and ``write`` returns normally: Print must not break a training loop because the disk filled.
Later records are written again once there is room.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import warnings

from obs._core import safe_files
from printsink.encoder import Buffer

__all__ = ["PrintFileFullWarning", "PrintWriter"]

_IOV_MAX = 512
_FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
_log = logging.getLogger("obs")


class PrintFileFullWarning(UserWarning):
    """The disk (or the file size limit) is full: Print records are being dropped, the file stays whole."""


class PrintWriter:
    """An open print file, created by :func:`obs._core.safe_files.create_file` (0600, failing if the name exists).

    ``fd``: adopt an already opened descriptor (``path`` is then only its name in messages).
    """

    def __init__(self, path: str, *, fd: int | None = None) -> None:
        if fd is None:
            fd = safe_files.create_file(path, append=True)
        self.path = path
        self._fd: int | None = fd
        self._lock = threading.Lock()
        self.records = 0
        self.bytes = 0
        self.dropped_records = 0
        self.dropped_bytes = 0

    @property
    def closed(self) -> bool:
        return self._fd is None

    def write(self, parts: list[Buffer]) -> None:
        """Append one record (the concatenation of ``parts``); on a full disk drop it whole (see the module)."""
        with self._lock:
            fd = self._fd
            if fd is None:  # closed by another thread (reset_context) while this Print was on its way
                raise OSError(errno.EBADF, f"print file {self.path!r} is closed")
            total = sum(len(p) if not isinstance(p, memoryview) else p.nbytes for p in parts)
            written = 0
            try:
                if len(parts) <= _IOV_MAX:
                    written = os.writev(fd, parts)
                if written != total:
                    start = os.lseek(fd, 0, os.SEEK_END) - written  # where this record began
                    done = [written]
                    try:
                        self._write_rest(fd, parts, done)
                    except OSError as exc:
                        if exc.errno in _FULL:
                            self._cut(fd, start, start + done[0])
                            self._dropped(total, exc)
                            return
                        raise
            except OSError as exc:
                if exc.errno not in _FULL or written:
                    raise
                self._dropped(total, exc)  # nothing of it reached the file
                return
            self.records += 1
            self.bytes += total

    @staticmethod
    def _write_rest(fd: int, parts: list[Buffer], done: list[int]) -> None:
        """Write what the first call left; ``done[0]`` counts the bytes of the record written so far."""
        skip = done[0]
        for part in parts:
            view = memoryview(part).cast("B")
            if skip >= len(view):
                skip -= len(view)
                continue
            view, skip = view[skip:], 0
            while view:
                n = os.write(fd, view)
                done[0] += n
                view = view[n:]

    @staticmethod
    def _cut(fd: int, start: int, end: int) -> None:
        """Cut the torn record (``start``..``end``) off the end of the file.  When another process appended after
        it, cutting would lose that process's whole record: the torn bytes stay, and readers skip them."""
        if os.fstat(fd).st_size == end:
            os.ftruncate(fd, start)

    def _dropped(self, total: int, exc: OSError) -> None:
        self.dropped_records += 1
        self.dropped_bytes += total
        if self.dropped_records == 1:
            message = (f"obs.Print: {self.path!r}: {os.strerror(exc.errno or 0)} "
                       f"({errno.errorcode.get(exc.errno or 0)});"
                       f" dropping Print records that do not fit (the file keeps every whole record written so far); "
                       f"further drops are counted, not warned")
            try:
                warnings.warn(message, PrintFileFullWarning, stacklevel=4)
            except Exception:  # noqa: BLE001 - warnings turned into errors must not break the training loop
                _log.warning(message)

    def fsync(self) -> None:
        """Flush to disk; a full disk is logged, not raised (at exit and on a fault there is no one to tell)."""
        with self._lock:
            if self._fd is not None:
                try:
                    os.fsync(self._fd)
                except OSError as exc:
                    if exc.errno not in _FULL:
                        raise
                    _log.warning("obs.Print: %r: fsync failed: %s", self.path, exc)

    def close(self) -> None:
        """fsync and close; closing twice is fine.  Says how much was dropped, if anything was."""
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.fsync(fd)
        except OSError as exc:
            if exc.errno not in _FULL:
                raise
            _log.warning("obs.Print: %r: fsync failed at close: %s", self.path, exc)
        finally:
            os.close(fd)
            if self.dropped_records:
                _log.warning("obs.Print: %r: dropped %d record(s), %d byte(s), for want of disk space; the %d whole "
                             "record(s) before and between them are in the file", self.path, self.dropped_records,
                             self.dropped_bytes, self.records)

    def __enter__(self) -> PrintWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
