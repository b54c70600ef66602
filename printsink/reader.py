"""Read print files: a streaming record reader, ``parse_print`` and a follower for live files.

Pure: files in, dataclasses and numpy arrays out.  Memory is bounded by the largest record (never
more than the file's size: every length is checked against the file or the enclosing message before
anything is allocated); tensor contents larger than 16 KiB are read straight into the array returned,
smaller ones are copied out of a 64 KiB read-ahead buffer.  Files from MindSpore (no obs metadata)
are read too: each value is then its own call, with ``meta=None``.

Damage is told apart by where it is: a record cut by the end of the file, with no intact record
after it, is a *truncation* (the writer was killed mid-record); anything else is *corruption* at a
byte offset.  With ``strict=False`` a corrupt record whose framing (its length prefixes) is intact is
skipped and reading goes on after it; when the framing itself is broken, reading resumes at the next
intact record found by a scan; what was skipped is counted in one :class:`PrintFileWarning`.
"""

from __future__ import annotations

import math
import os
import re
import stat
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from io import BufferedReader
from typing import Any

import numpy as np

from obs._core.errors import DamagedFileError, NotOurFileError, shorten
from printsink._source import Corrupt, Source, Truncated
from printsink.dtypes import NUMPY_OF
from printsink.encoder import META_FIELD, CallMeta

__all__ = ["MAX_RANK", "NotAPrintFile", "PrintCall", "PrintFileError", "PrintFileWarning", "TruncatedPrintFile",
           "follow_print", "iter_print", "parse_print"]

MAX_RANK = 32  #: the most dims a tensor may have (numpy's and MindSpore's limits are at least this)

_META_TAG = (META_FIELD << 3) | 2
_VALUE_TAG = 0x0A
_MAX_FIELD = (1 << 29) - 1
_SCAN_CHUNK = 1 << 20
_SCAN_TRIES = 4096  # full parses tried per resynchronisation scan; candidates are rare (a 3-byte pattern)
# A record of ours starts with field 15 (tag 0x7a), its length, and CallMeta's first field (seq, tag 0x08).
_META_START = re.compile(rb"\x7a(?:[\x80-\xff]{1,2}[\x00-\x7f]|[\x00-\x7f])\x08")
# A MindSpore record starts with a Print.Value (tag 0x0a), its length, and desc (0x0a) or tensor (0x12).
_VALUE_START = re.compile(rb"\x0a(?:[\x80-\xff]{1,3}[\x00-\x7f]|[\x00-\x7f])[\x0a\x12]")


@dataclass(frozen=True, slots=True)
class PrintCall:
    """One Print call: its values (``str`` / numpy arrays / torch tensors), metadata, byte range."""

    values: list[Any]
    meta: CallMeta | None
    offset: int
    end: int


class PrintFileError(DamagedFileError):
    """A print file that is damaged (corrupt bytes, a torn record); names the file and the byte offset."""

    def __init__(self, path: str, offset: int, problem: str) -> None:
        super().__init__(f"print file {path!r} is corrupt at byte offset {offset}: {problem}", path=path,
                         offset=offset)


class TruncatedPrintFile(PrintFileError):
    """The last record was cut short (writer killed mid-write); ``complete`` records precede it."""

    def __init__(self, path: str, offset: int, size: int, complete: int) -> None:
        self.fact = (f"print file {path!r} ends inside a record: the record at byte offset {offset} is truncated "
                     f"(file size {size}) after {complete} complete record(s)")
        DamagedFileError.__init__(self, f"{self.fact}; parse with strict=False to get the complete ones", path=path,
                                  offset=offset)
        self.complete = complete


class NotAPrintFile(NotOurFileError):
    """The input is not a print file at all (empty, text, another format): nothing in it reads as a record."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path!r} is not a print file: {problem}", path=path)


class PrintFileWarning(UserWarning):
    """``strict=False`` skipped damage: ``records`` and ``skipped_bytes`` say how much, ``truncated`` whether
    the file ended inside a record."""

    def __init__(self, message: str, *, records: int = 0, skipped_bytes: int = 0, truncated: bool = False) -> None:
        super().__init__(message)
        self.records, self.skipped_bytes, self.truncated = records, skipped_bytes, truncated


_UNREAD = object()  # a tensor checked but not read (scanning for the next intact record)


class _BadRecord(Exception):
    """A record whose framing is intact (``start``..``end`` is known) but whose contents are not valid."""

    def __init__(self, corrupt: Corrupt, start: int, end: int) -> None:
        super().__init__(str(corrupt))
        self.offset, self.start, self.end = corrupt.offset, start, end


class _Parser:
    def __init__(self, path: str, source: Source, as_torch: bool, *, contents: bool = True) -> None:
        self.path, self.src, self.as_torch, self.contents = path, source, as_torch, contents
        self.ours = False  # a record's framing or metadata read well: this is a print file, however damaged

    def record(self) -> PrintCall | None:
        """The next call, or None at a clean end of file.

        Raises Truncated (the file ends inside the record), Corrupt (its framing is broken: where the next
        record starts is unknown) or _BadRecord (framing intact, contents bad; the source is at its end).
        """
        src = self.src
        start = src.offset
        bad: list[Corrupt] = []
        while True:
            if not src.fill(1):
                return None
            at = src.offset
            tag = src.varint()
            if tag == _META_TAG:
                meta = self._bounded(self._meta, "obs call metadata", bad)
                if meta is not None:
                    self.ours = True
                values: list[Any] = []
                while meta is None or len(values) < meta.n_values:
                    at = src.offset
                    if not src.fill(1):
                        if meta is None:
                            break
                        raise Truncated
                    if meta is None and src.buf[src.pos] != _VALUE_TAG:
                        break  # metadata unreadable: the values run up to the next record's tag
                    if src.varint() != _VALUE_TAG:
                        raise Corrupt(at, f"expected value {len(values) + 1} of {meta.n_values} of the call")
                    values.append(self._bounded(self._value, "Print.Value", bad))
                break
            if tag == _VALUE_TAG:
                meta = None
                values = [self._bounded(self._value, "Print.Value", bad)]
                break
            if tag >> 3 == 0 or tag >> 3 > _MAX_FIELD:
                raise Corrupt(at, f"invalid field tag 0x{tag:x}: not a Print message")
            src.skip(tag & 7, None, at)  # a field of a newer writer: ignore it, as protobuf does
        if bad:
            self.ours = True
            raise _BadRecord(bad[0], start, src.offset)
        return PrintCall(values, meta, start, src.offset)

    def _bounded(self, read: Callable[[int], Any], what: str, bad: list[Corrupt]) -> Any:
        """Read one length-delimited field's payload; on bad contents note the problem and go to its end."""
        src = self.src
        length = src.length(None, "file")
        end = src.offset + length
        try:
            return read(end)
        except Corrupt as exc:
            bad.append(exc)
        except Truncated:  # the payload lies inside the file (checked above): its last field runs past it
            bad.append(Corrupt(end, f"a field runs past the end of its {what}"))
        src.seek(end)
        return None

    def _meta(self, end: int) -> CallMeta:
        src = self.src
        ints = {1: 0, 2: 0, 3: 0, 4: 0, 5: 0, 7: 0, 8: 0}
        source = ""
        while src.offset < end:
            at = src.offset
            tag = src.varint()
            if tag == (6 << 3) | 2:
                source = src.take(src.length(end, "obs call metadata")).decode("utf-8", "replace")
            elif tag == (2 << 3) | 1:
                ints[2] = int.from_bytes(src.take(8), "little")
            elif tag & 7 == 0 and tag >> 3 in ints:
                ints[tag >> 3] = src.varint()
            else:
                self._skip(tag, end, at)
        self._check_end(end, "obs call metadata")
        return CallMeta(ints[1], ints[2], ints[3], ints[4], ints[5], source, ints[7], ints[8])

    def _skip(self, tag: int, end: int, at: int) -> None:
        if tag >> 3 == 0 or tag >> 3 > _MAX_FIELD:
            raise Corrupt(at, f"invalid field tag 0x{tag:x}")
        self.src.skip(tag & 7, end, at)

    def _value(self, end: int) -> Any:
        src = self.src
        start = src.offset
        result: Any = None
        while src.offset < end:
            at = src.offset
            tag = src.varint()
            if tag == 0x0A:
                raw = src.take(src.length(end, "Print.Value"))
                try:
                    result = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise Corrupt(at, f"desc is not UTF-8 ({exc.reason})") from None
            elif tag == 0x12:
                result = self._tensor(src.length(end, "Print.Value"))
            else:
                self._skip(tag, end, at)
        self._check_end(end, "Print.Value")
        if result is None:
            raise Corrupt(start, "Print.Value holds neither desc nor tensor")
        return result

    def _tensor(self, length: int) -> Any:
        src = self.src
        start = src.offset
        end = start + length
        dims: list[int] = []
        dtype = None
        raw: np.ndarray | None = None
        nbytes = -1
        while src.offset < end:
            at = src.offset
            tag = src.varint()
            if tag == 0x08:
                dims.append(_int64(src.varint()))
            elif tag == 0x0A:  # packed dims, as proto3 writers emit them
                n = src.length(end, "TensorProto")
                stop = src.offset + n
                while src.offset < stop:
                    dims.append(_int64(src.varint()))
                if src.offset != stop:
                    raise Corrupt(at, "packed dims run past the end of their field")
            elif tag == 0x12:
                dtype = src.take(src.length(end, "TensorProto")).decode("ascii", "replace")
            elif tag == 0x1A:
                nbytes = src.length(end, "TensorProto")
                if self.contents:
                    raw = src.take_array(nbytes)
                else:
                    src.seek(src.offset + nbytes)
            else:
                self._skip(tag, end, at)
            if len(dims) > MAX_RANK:
                raise Corrupt(at, f"a tensor has more than {MAX_RANK} dims")
        self._check_end(end, "TensorProto")
        if dtype is None or nbytes < 0:
            raise Corrupt(start, "TensorProto lacks its required tensor_type or tensor_content")
        np_dtype, shape = _check_tensor(dtype, dims, nbytes, start)
        if raw is None:
            return _UNREAD
        data = raw.view(np_dtype)
        data = data[:1].reshape(()) if shape == () else data.reshape(shape)
        return _convert(data, dtype, self.as_torch)

    def _check_end(self, end: int, what: str) -> None:
        if self.src.offset != end:
            raise Corrupt(end, f"a field runs past the end of its {what}")


def _check_tensor(dtype: str, dims: list[int], nbytes: int, at: int) -> tuple[np.dtype, tuple[int, ...]]:
    """The numpy dtype and shape of a tensor, after checking that the dims agree with its byte length."""
    np_dtype = NUMPY_OF.get(dtype)
    if np_dtype is None:
        raise Corrupt(at, f"unknown tensor_type {shorten(dtype)}; expected one of {', '.join(NUMPY_OF)}")
    if nbytes % np_dtype.itemsize:
        raise Corrupt(at, f"{nbytes} content bytes is not a whole number of {dtype} elements")
    count = nbytes // np_dtype.itemsize
    if not dims or (dims == [0] and count == 1):  # a scalar: MindSpore writes no dims (older writers [0])
        if count < 1:
            raise Corrupt(at, f"scalar {dtype} tensor has no content")
        return np_dtype, ()
    if any(d < 0 for d in dims) or math.prod(dims) != count:
        raise Corrupt(at, f"dims {shorten(dims)} do not match {count} {dtype} elements")
    if math.prod(d for d in dims if d) * np_dtype.itemsize >= 1 << 62:
        raise Corrupt(at, f"dims {shorten(dims)} describe an impossibly large (if empty) tensor")
    return np_dtype, tuple(dims)


def _int64(value: int) -> int:
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def _convert(data: np.ndarray, dtype: str, as_torch: bool) -> Any:
    if as_torch:
        import torch

        if dtype == "BFloat16":
            return torch.from_numpy(data.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(data)
    if dtype == "BFloat16":
        return (data.astype("<u4") << 16).view("<f4")
    return data


def _open(path: str | os.PathLike[str]) -> tuple[str, BufferedReader, int]:
    """Open a print file for reading; only a regular file (a FIFO or device would block or never end)."""
    name = os.fspath(path)
    fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)  # FileNotFoundError names the path
    info = os.fstat(fd)
    if stat.S_ISDIR(info.st_mode):
        os.close(fd)
        raise IsADirectoryError(f"print file {name!r} is a directory; give the file print_file_path named")
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise NotAPrintFile(name, "it is not a regular file (a device, FIFO or socket)")
    os.set_blocking(fd, True)
    return name, os.fdopen(fd, "rb"), info.st_size


def _find_next(path: str, f: BufferedReader, after: int, size: int, as_torch: bool) -> int | None:
    """The offset of the first intact record that starts after ``after``, or None (scans the rest of the file)."""
    head = os.pread(f.fileno(), 1, 0)
    pattern = _META_START if head == bytes((_META_TAG,)) else _VALUE_START
    tries = 0
    chunk_at = after + 1
    while chunk_at < size and tries < _SCAN_TRIES:
        chunk = os.pread(f.fileno(), _SCAN_CHUNK + 8, chunk_at)
        for match in pattern.finditer(chunk):
            at = chunk_at + match.start()
            if match.start() >= _SCAN_CHUNK:
                break
            tries += 1
            if _intact_at(path, f, at, size, as_torch):
                return at
            if tries >= _SCAN_TRIES:
                break
        chunk_at += _SCAN_CHUNK
    return None


def _plausible_start(head: bytes) -> bool:
    """Whether the first bytes of a file cut short could be the start of a record (a torn first record)."""
    if not head or head[0] not in (_META_TAG, _VALUE_TAG):
        return False
    i = 1
    while i < len(head) and head[i] & 0x80:
        i += 1
    i += 1
    return i >= len(head) or head[i] in ((0x08,) if head[0] == _META_TAG else (0x0A, 0x12))


def _intact_at(path: str, f: BufferedReader, at: int, size: int, as_torch: bool) -> bool:
    """Whether a whole, valid record starts at ``at`` and ends at the end of the file or where another starts."""
    src = Source(f, at)
    src.rewind(at)
    try:
        call = _Parser(path, src, as_torch, contents=False).record()
    except (Corrupt, Truncated, _BadRecord):
        return False
    if call is None:
        return False
    if call.end == size:
        return True
    follower = os.pread(f.fileno(), 1, call.end)
    return follower in (bytes((_META_TAG,)), bytes((_VALUE_TAG,)))


def iter_print(path: str | os.PathLike[str], *, strict: bool = True, as_torch: bool = False) -> Iterator[PrintCall]:
    """Yield the calls of a print file in order, one record in memory at a time.

    Not a print file (empty, text, a device) → :class:`NotAPrintFile`; a damaged one →
    :class:`PrintFileError` naming the file and byte offset; a truncated last record →
    :class:`TruncatedPrintFile`.  With ``strict=False`` damaged records are skipped and the intact ones
    before and after them returned, and one :class:`PrintFileWarning` says how many records and bytes
    were skipped.  Both error classes are ValueErrors.
    """
    name, f, size = _open(path)
    with f:
        if size == 0:
            raise NotAPrintFile(name, "it is empty (did print_file_path point here, and did the job print "
                                "anything?)")
        yield from _read(name, f, size, strict, as_torch)


def _read(name: str, f: BufferedReader, size: int, strict: bool, as_torch: bool) -> Iterator[PrintCall]:
    parser = _Parser(name, Source(f), as_torch)
    complete = skipped = skipped_bytes = 0
    first: tuple[int, str] = (0, "")
    truncated, cut_bytes, fact = False, 0, ""
    while True:
        start = parser.src.offset
        try:
            call = parser.record()
        except _BadRecord as bad:
            if strict:
                raise PrintFileError(name, bad.offset, f"{bad} (parse with strict=False to skip this record)") \
                    from None
            skipped, skipped_bytes = skipped + 1, skipped_bytes + bad.end - bad.start
            first = first if skipped > 1 else (bad.offset, str(bad))
            continue
        except (Truncated, Corrupt) as exc:
            is_cut = isinstance(exc, Truncated)
            after = _find_next(name, f, start, size, as_torch)
            if after is None and complete == 0 and skipped == 0 and not parser.ours and not (
                    is_cut and _plausible_start(os.pread(f.fileno(), 8, 0))):
                where = exc.offset if isinstance(exc, Corrupt) else start
                problem = "the file ends inside the first record" if is_cut else str(exc)
                raise NotAPrintFile(name, f"no Print record at byte offset {where} ({problem})") from None
            if is_cut and after is None:
                error = TruncatedPrintFile(name, start, size, complete)
                if strict:
                    raise error from None
                truncated, cut_bytes, skipped_bytes = True, size - start, skipped_bytes + size - start
                fact = f"the last record, at byte offset {start}, is truncated after {complete} complete record(s)"
                break
            offset = exc.offset if isinstance(exc, Corrupt) else start
            problem = (f"the record's lengths run past the end of the file, yet an intact record starts at byte "
                       f"offset {after}" if is_cut else str(exc))
            if strict:
                hint = "parse with strict=False to skip it" if after is not None else "no intact record follows"
                raise PrintFileError(name, offset, f"{problem} ({hint})") from None
            first = first if skipped else (offset, problem)
            stop = size if after is None else after
            skipped, skipped_bytes = skipped + 1, skipped_bytes + stop - start
            if after is None:
                break
            parser.src.rewind(after)
            continue
        if call is None:
            break
        complete += 1
        yield call
    if skipped or truncated:
        parts = []
        if skipped:
            parts.append(f"skipped {skipped} damaged record(s), {skipped_bytes - cut_bytes} byte(s) (the first at byte "
                         f"offset {first[0]}: {first[1]})")
        if truncated:
            parts.append(f"{fact}, {cut_bytes} byte(s)")
        warnings.warn(PrintFileWarning(f"print file {name!r}: " + "; ".join(parts)
                                       + f"; returned the {complete} intact record(s)", records=skipped,
                                       skipped_bytes=skipped_bytes, truncated=truncated), stacklevel=3)


def parse_print(path: str | os.PathLike[str], *, strict: bool = True, as_torch: bool = False) -> list[Any]:
    """All values of a print file in order, like MindSpore's ``parse_print``.

    ``str`` for strings, numpy arrays for tensors (0-d for scalars), torch tensors with
    ``as_torch=True``.  Errors as :func:`iter_print`; a missing file raises FileNotFoundError.
    """
    return [value for call in iter_print(path, strict=strict, as_torch=as_torch) for value in call.values]


def follow_print(path: str | os.PathLike[str], *, poll_s: float = 0.25, stop: Callable[[], bool] = lambda: False,
                 as_torch: bool = False, wait: bool = False) -> Iterator[PrintCall]:
    """Yield calls as a running job appends them; a record is yielded once complete.  Ends when ``stop()``.

    ``wait``: a file that does not exist yet is waited for (a job creates its print file on its first
    Print).  A damaged record raises :class:`PrintFileError` (a live file is never skipped over).
    """
    while True:
        try:
            name, f, _ = _open(path)
            break
        except FileNotFoundError:
            if not wait or stop():
                raise
            time.sleep(poll_s)
    with f:
        parser = _Parser(name, Source(f), as_torch)
        while not stop():
            start = parser.src.offset
            try:
                call = parser.record()
            except Truncated:
                call = None
            except (Corrupt, _BadRecord) as exc:
                if start == 0 and not parser.ours:
                    raise NotAPrintFile(name, f"no Print record at byte offset {exc.offset} ({exc})") from None
                raise PrintFileError(name, exc.offset, str(exc)) from None
            if call is None:
                parser.src.rewind(start)
                time.sleep(poll_s)
                continue
            yield call
