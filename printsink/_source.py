"""A read buffer over a print file that knows the file offset of every byte, and the parse signals.

Large contents (over 16 KiB) are read straight into the numpy array that is returned; headers and
small values come from a 64 KiB read-ahead buffer.
"""

from __future__ import annotations

import os
from io import BufferedReader

import numpy as np

__all__ = ["Corrupt", "Source", "Truncated"]

_CHUNK = 64 * 1024
_DIRECT = 16 * 1024


class Truncated(Exception):
    """The file ends inside a record."""


class Corrupt(Exception):
    """The bytes at ``offset`` are not a Print record."""

    def __init__(self, offset: int, problem: str) -> None:
        super().__init__(problem)
        self.offset = offset


class Source:
    """A read buffer over a binary file that knows the file offset of every byte."""

    def __init__(self, f: BufferedReader, start: int = 0) -> None:
        self.f, self.buf, self.pos, self.base = f, bytearray(), 0, start

    @property
    def offset(self) -> int:
        return self.base + self.pos

    def rewind(self, offset: int) -> None:
        self.f.seek(offset)
        self.buf, self.pos, self.base = bytearray(), 0, offset

    def seek(self, offset: int) -> None:
        """Go to ``offset``: within the read-ahead buffer by moving ``pos``, else by a file seek."""
        if self.base <= offset <= self.base + len(self.buf):
            self.pos = offset - self.base
        else:
            self.rewind(offset)

    def size(self) -> int:
        return os.fstat(self.f.fileno()).st_size

    def fill(self, need: int) -> bool:
        """Make ``need`` bytes available at ``pos``; False at end of file (partial data kept)."""
        if len(self.buf) - self.pos >= need:
            return True
        del self.buf[:self.pos]
        self.base += self.pos
        self.pos = 0
        while len(self.buf) < need:
            chunk = self.f.read(max(_CHUNK, need - len(self.buf)))
            if not chunk:
                return False
            self.buf += chunk
        return True

    def varint(self) -> int:
        self.fill(10)
        buf, pos, shift, value = self.buf, self.pos, 0, 0
        while True:
            if pos >= len(buf):
                raise Truncated
            byte = buf[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            if byte < 0x80:
                self.pos = pos
                return value
            shift += 7
            if shift >= 70:
                raise Corrupt(self.offset, "varint longer than 10 bytes")

    def take(self, n: int) -> bytes:
        if not self.fill(n):
            raise Truncated
        out = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return out

    def take_array(self, n: int) -> np.ndarray:
        """``n`` bytes as a fresh, writable uint8 array; large ones are read straight into it."""
        have = len(self.buf) - self.pos
        if n <= _DIRECT:
            if not self.fill(n):
                raise Truncated
            out = np.frombuffer(self.buf, np.uint8, n, self.pos).copy()
            self.pos += n
            return out
        out = np.empty(n, np.uint8)
        if have >= n:
            out[:] = np.frombuffer(self.buf, np.uint8, n, self.pos)
            self.pos += n
            return out
        out[:have] = np.frombuffer(self.buf, np.uint8, have, self.pos)
        view = memoryview(out)[have:]  # type: ignore[arg-type]  # numpy's stubs: ndarray.__buffer__ on 3.12+ only
        while view:
            got = self.f.readinto(view)
            if not got:
                raise Truncated
            view = view[got:]
        self.base += len(self.buf) + (n - have)
        self.buf, self.pos = bytearray(), 0
        return out

    def length(self, end: int | None, what: str) -> int:
        """A length prefix, checked against the enclosing message (or, at top level, the file size)."""
        at = self.offset
        n = self.varint()
        if end is None:
            if self.offset + n > self.size():
                raise Truncated
        elif self.offset + n > end:
            raise Corrupt(at, f"a field of {n} bytes runs past the end of its {what}")
        return n

    def skip(self, wire: int, end: int | None, at: int) -> None:
        """Skip the payload of a field whose tag (at ``at``) has wire type ``wire``."""
        if wire == 0:
            self.varint()
        elif wire == 1:
            self.take(8)
        elif wire == 2:
            self.take(self.length(end, "message"))
        elif wire == 5:
            self.take(4)
        else:
            raise Corrupt(at, f"invalid wire type {wire}")
