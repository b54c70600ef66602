"""Append Print records to a file: one ``writev`` per record, no user-space buffer.

The file is opened ``O_APPEND``, so each record lands contiguously even when threads or
processes (forked DataLoader workers share the descriptor; spawned ones reopen the path) write
at once; a lock keeps a record's continuation writes (after a short write) together within a
process.  When ``write`` returns the record is in the kernel: a kill afterwards loses nothing.
"""

from __future__ import annotations

import errno
import os
import threading

from printsink.encoder import Buffer

__all__ = ["PrintWriter"]

_IOV_MAX = 512


class PrintWriter:
    """An open print file.  ``exclusive``: create it, failing if the name exists (O_EXCL)."""

    def __init__(self, path: str, *, exclusive: bool = True) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW
        if exclusive:
            flags |= os.O_EXCL
        self.path = path
        self._fd: int | None = os.open(path, flags, 0o600)
        self._lock = threading.Lock()
        self.records = 0
        self.bytes = 0

    @property
    def closed(self) -> bool:
        return self._fd is None

    def write(self, parts: list[Buffer]) -> None:
        """Append one record (the concatenation of ``parts``)."""
        with self._lock:
            fd = self._fd
            if fd is None:  # closed by another thread (reset_context) while this Print was on its way
                raise OSError(errno.EBADF, f"print file {self.path!r} is closed")
            total = sum(len(p) if not isinstance(p, memoryview) else p.nbytes for p in parts)
            if len(parts) <= _IOV_MAX:
                written = os.writev(fd, parts)
            else:
                written = 0
            if written != total:
                self._write_rest(fd, parts, written)
            self.records += 1
            self.bytes += total

    @staticmethod
    def _write_rest(fd: int, parts: list[Buffer], skip: int) -> None:
        for part in parts:
            view = memoryview(part).cast("B")
            if skip >= len(view):
                skip -= len(view)
                continue
            view, skip = view[skip:], 0
            while view:
                view = view[os.write(fd, view):]

    def fsync(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.fsync(self._fd)

    def close(self) -> None:
        """fsync and close; closing twice is fine."""
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def __enter__(self) -> PrintWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
