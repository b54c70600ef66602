"""Pure encoder of ``mindspore.prntpb.Print`` records, framed by hand for zero-copy writes.

A record is one serialized ``Print`` message: the obs metadata (field 15, which MindSpore's
parser keeps as an unknown field and ignores) followed by one ``value`` (field 1) per item::

    message Print { repeated Value value = 1;  optional CallMeta obs_meta = 15; }
    message Value { oneof value { string desc = 1; TensorProto tensor = 2; } }
    message TensorProto { repeated int64 dims = 1; required string tensor_type = 2;
                          required bytes tensor_content = 3; }
    message CallMeta { uint64 seq = 1; fixed64 time_ns = 2; uint64 step = 3; uint64 rank = 4;
                       uint64 pid = 5; string source = 6; uint64 n_values = 7; uint64 parent_pid = 8; }

``dims`` are unpacked (proto2), one ``0x08`` tag per dim, as MindSpore writes them.  Tensor
contents are returned as memoryviews of the caller's arrays (no copy) unless they are small,
in which case they are folded into the preceding header so a record costs few iovecs.
"""

from __future__ import annotations

import functools
import struct
from typing import NamedTuple

from printsink.dtypes import SUPPORTED
from printsink.values import Item

__all__ = ["META_FIELD", "CallMeta", "encode_bytes", "encode_meta", "encode_record", "varint"]

META_FIELD = 15
_INLINE_MAX = 16 * 1024  # contents up to this size are copied into the header buffer
_META_TAG = bytes(((META_FIELD << 3) | 2,))
_FIXED64 = struct.Struct("<Q").pack

Buffer = bytes | bytearray | memoryview


class CallMeta(NamedTuple):
    """When and where one Print call happened; ``n_values`` lets a reader spot a cut record.

    ``seq`` counts the calls of one process (from 1; ``(pid, seq)`` is unique in a file even with
    DataLoader workers); ``parent_pid`` is the process that set ``print_file_path`` (0: not recorded),
    so a call with ``pid != parent_pid`` was made by a worker.
    """

    seq: int
    time_ns: int
    step: int
    rank: int
    pid: int
    source: str
    n_values: int
    parent_pid: int = 0


_ONE_BYTE = [bytes((i,)) for i in range(0x80)]


def varint(value: int) -> bytes:
    """Protobuf base-128 varint of a non-negative int (negative int64 take 10 bytes, as protobuf)."""
    if 0 <= value < 0x80:
        return _ONE_BYTE[value]
    if value < 0:
        value += 1 << 64
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _len_field(tag: bytes, payload: bytes) -> bytes:
    return tag + varint(len(payload)) + payload


@functools.lru_cache(maxsize=256)
def _who(rank: int, pid: int, parent_pid: int) -> tuple[bytes, bytes]:
    """The fields that stay the same in a process: (rank and pid, parent pid)."""
    return b"\x20" + varint(rank) + b"\x28" + varint(pid), b"\x40" + varint(parent_pid)


@functools.lru_cache(maxsize=4096)
def _source(source: str) -> bytes:
    return _len_field(b"\x32", source.encode("utf-8", "surrogatepass"))


def encode_meta(meta: CallMeta) -> bytes:
    """The whole field-15 entry (tag, length, CallMeta message)."""
    who, parent = _who(meta.rank, meta.pid, meta.parent_pid)
    body = b"".join((
        b"\x08", varint(meta.seq), b"\x11", _FIXED64(meta.time_ns), b"\x18", varint(meta.step), who,
        _source(meta.source), b"\x38", varint(meta.n_values), parent))
    return _len_field(_META_TAG, body)


def encode_record(items: list[Item], meta: CallMeta | None = None) -> list[Buffer]:
    """Buffers whose concatenation is one serialized Print message (for ``os.writev``)."""
    parts: list[Buffer] = []
    head = bytearray(encode_meta(meta)) if meta is not None else bytearray()
    for item in items:
        if isinstance(item, str):
            head += _len_field(b"\x0a", _len_field(b"\x0a", item.encode("utf-8", "surrogatepass")))
            continue
        nbytes = item.nbytes
        name = _NAME_FIELD.get(item.dtype) or _len_field(b"\x12", item.dtype.encode("ascii"))
        tensor = b"".join([b"\x08" + varint(d) for d in item.dims] + [name, b"\x1a", varint(nbytes)])
        tensor_len = len(tensor) + nbytes
        size = varint(tensor_len)
        head += b"\x0a"
        head += varint(1 + len(size) + tensor_len)
        head += b"\x12"
        head += size
        head += tensor
        if nbytes <= _INLINE_MAX:
            head += item.content()
        else:
            parts.append(head)
            parts.append(item.content())
            head = bytearray()
    if head:
        parts.append(head)
    return parts


def encode_bytes(items: list[Item], meta: CallMeta | None = None) -> bytes:
    """One record as a single bytes object (tests and small tools)."""
    return b"".join(bytes(p) for p in encode_record(items, meta))



_NAME_FIELD = {name: _len_field(b"\x12", name.encode("ascii")) for name in SUPPORTED}
