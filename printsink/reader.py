"""Read print files: a streaming record reader, ``parse_print`` and a follower for live files.

Pure: files in, dataclasses and numpy arrays out.  Memory is bounded by the largest record;
tensor contents larger than 16 KiB are read straight into the array returned (no copy after
the kernel's), smaller ones are copied out of a 64 KiB read-ahead buffer.  Files from MindSpore (no
obs metadata) are read too: each value is then its own call, with ``meta=None``.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

from printsink._source import Corrupt, Source, Truncated
from printsink.dtypes import NUMPY_OF
from printsink.encoder import META_FIELD, CallMeta

__all__ = ["PrintCall", "PrintFileError", "PrintFileWarning", "TruncatedPrintFile", "follow_print",
           "iter_print", "parse_print"]

_META_TAG = (META_FIELD << 3) | 2
_VALUE_TAG = 0x0A


@dataclass(frozen=True, slots=True)
class PrintCall:
    """One Print call: its values (``str`` / numpy arrays / torch tensors), metadata, byte range."""

    values: list[Any]
    meta: CallMeta | None
    offset: int
    end: int


class PrintFileError(ValueError):
    """A print file that is not a sequence of Print records; names the file and the byte offset."""

    def __init__(self, path: str, offset: int, problem: str) -> None:
        super().__init__(f"print file {path!r} is corrupt at byte offset {offset}: {problem}")
        self.path, self.offset = path, offset


class TruncatedPrintFile(PrintFileError):
    """The last record was cut short (writer killed mid-write); ``complete`` records precede it."""

    def __init__(self, path: str, offset: int, size: int, complete: int) -> None:
        self.fact = (f"print file {path!r} ends inside a record: the record at byte offset {offset} is truncated "
                     f"(file size {size}) after {complete} complete record(s)")
        ValueError.__init__(self, f"{self.fact}; parse with strict=False to get the complete ones")
        self.path, self.offset, self.complete = path, offset, complete


class PrintFileWarning(UserWarning):
    """A truncated last record was skipped (``strict=False``)."""


class _Parser:
    def __init__(self, path: str, source: Source, as_torch: bool) -> None:
        self.path, self.src, self.as_torch = path, source, as_torch

    def record(self) -> PrintCall | None:
        """The next call, or None at a clean end of file."""
        src = self.src
        start = src.offset
        while True:
            if not src.fill(1):
                return None
            at = src.offset
            tag = src.varint()
            if tag == _META_TAG:
                meta = self._meta(src.length(None, "file"))
                values = []
                for _ in range(meta.n_values):
                    at = src.offset
                    if not src.fill(1):
                        raise Truncated
                    if src.varint() != _VALUE_TAG:
                        raise Corrupt(at, f"expected value {len(values) + 1} of {meta.n_values} of the call")
                    values.append(self._value(src.length(None, "file")))
                return PrintCall(values, meta, start, src.offset)
            if tag == _VALUE_TAG:
                return PrintCall([self._value(src.length(None, "file"))], None, start, src.offset)
            if tag >> 3 == 0:
                raise Corrupt(at, f"invalid field tag 0x{tag:x}: not a Print message")
            src.skip(tag & 7, None, at)  # a field of a newer writer: ignore it, as protobuf does

    def _meta(self, length: int) -> CallMeta:
        src = self.src
        end = src.offset + length
        ints = {1: 0, 2: 0, 3: 0, 4: 0, 5: 0, 7: 0}
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
                src.skip(tag & 7, end, at)
        self._check_end(end, "obs call metadata")
        return CallMeta(ints[1], ints[2], ints[3], ints[4], ints[5], source, ints[7])

    def _value(self, length: int) -> Any:
        src = self.src
        end = src.offset + length
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
                src.skip(tag & 7, end, at)
        self._check_end(end, "Print.Value")
        if result is None:
            raise Corrupt(end - length, "Print.Value holds neither desc nor tensor")
        return result

    def _tensor(self, length: int) -> Any:
        src = self.src
        start = src.offset
        end = start + length
        dims: list[int] = []
        dtype = None
        raw = None
        while src.offset < end:
            at = src.offset
            tag = src.varint()
            if tag == 0x08:
                dims.append(_int64(src.varint()))
            elif tag == 0x0A:  # packed dims, as proto3 writers emit them
                stop = src.offset + src.length(end, "TensorProto")
                while src.offset < stop:
                    dims.append(_int64(src.varint()))
            elif tag == 0x12:
                dtype = src.take(src.length(end, "TensorProto")).decode("ascii", "replace")
            elif tag == 0x1A:
                raw = src.take_array(src.length(end, "TensorProto"))
            else:
                src.skip(tag & 7, end, at)
        self._check_end(end, "TensorProto")
        if dtype is None or raw is None:
            raise Corrupt(start, "TensorProto lacks its required tensor_type or tensor_content")
        return self._array(dtype, dims, raw, start)

    def _array(self, dtype: str, dims: list[int], raw: np.ndarray, at: int) -> Any:
        np_dtype = NUMPY_OF.get(dtype)
        if np_dtype is None:
            raise Corrupt(at, f"unknown tensor_type {dtype!r}; expected one of {', '.join(NUMPY_OF)}")
        if raw.size % np_dtype.itemsize:
            raise Corrupt(at, f"{raw.size} content bytes is not a whole number of {dtype} elements")
        data = raw.view(np_dtype)
        if dims and not (dims == [0] and data.size == 1):
            if any(d < 0 for d in dims) or int(np.prod(dims, dtype=np.int64)) != data.size:
                raise Corrupt(at, f"dims {dims} do not match {data.size} {dtype} elements")
            data = data.reshape(dims)
        else:  # a scalar: MindSpore writes no dims (older writers also [0] or [1])
            if data.size < 1:
                raise Corrupt(at, f"scalar {dtype} tensor has no content")
            data = data[:1].reshape(())
        return _convert(data, dtype, self.as_torch)

    def _check_end(self, end: int, what: str) -> None:
        if self.src.offset != end:
            raise Corrupt(end, f"a field runs past the end of its {what}")


def _int64(value: int) -> int:
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


def _open(path: str | os.PathLike[str]) -> tuple[str, BinaryIO, int]:
    name = os.fspath(path)
    f = open(name, "rb")  # FileNotFoundError / IsADirectoryError name the path
    size = os.fstat(f.fileno()).st_size
    return name, f, size


def iter_print(path: str | os.PathLike[str], *, strict: bool = True, as_torch: bool = False) -> Iterator[PrintCall]:
    """Yield the calls of a print file in order, one record in memory at a time.

    Empty file → ValueError; corrupt → :class:`PrintFileError` (a ValueError) naming the file and
    byte offset; a truncated last record → :class:`TruncatedPrintFile` unless ``strict=False``,
    which stops before it with a :class:`PrintFileWarning`.
    """
    name, f, size = _open(path)
    with f:
        if size == 0:
            raise ValueError(f"print file {name!r} is empty: make sure print_file_path pointed here and the job "
                             "printed something")
        parser = _Parser(name, Source(f), as_torch)
        complete = 0
        while True:
            start = parser.src.offset
            try:
                call = parser.record()
            except Truncated:
                error = TruncatedPrintFile(name, start, size, complete)
                if strict:
                    raise error from None
                warnings.warn(f"{error.fact}; returning the complete ones", PrintFileWarning,
                              stacklevel=2)
                return
            except Corrupt as exc:
                raise PrintFileError(name, exc.offset, str(exc)) from None
            if call is None:
                return
            complete += 1
            yield call


def parse_print(path: str | os.PathLike[str], *, strict: bool = True, as_torch: bool = False) -> list[Any]:
    """All values of a print file in order, like MindSpore's ``parse_print``.

    ``str`` for strings, numpy arrays for tensors (0-d for scalars), torch tensors with
    ``as_torch=True``.  Errors as :func:`iter_print`; a missing file raises FileNotFoundError.
    """
    return [value for call in iter_print(path, strict=strict, as_torch=as_torch) for value in call.values]


def follow_print(path: str | os.PathLike[str], *, poll_s: float = 0.25, stop: Callable[[], bool] = lambda: False,
                 as_torch: bool = False) -> Iterator[PrintCall]:
    """Yield calls as a running job appends them; a record is yielded once complete.  Ends when ``stop()``."""
    name, f, _ = _open(path)
    with f:
        parser = _Parser(name, Source(f), as_torch)
        while not stop():
            start = parser.src.offset
            try:
                call = parser.record()
            except Truncated:
                call = None
            except Corrupt as exc:
                raise PrintFileError(name, exc.offset, str(exc)) from None
            if call is None:
                parser.src.rewind(start)
                time.sleep(poll_s)
                continue
            yield call
