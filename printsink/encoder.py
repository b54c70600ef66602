"""Pure encoder of ``mindspore.prntpb.Print`` records, framed by hand for zero-copy writes.

A record is one serialized ``Print`` message: the obs metadata (field 15, which MindSpore's
parser keeps as an unknown field and ignores) followed by one ``value`` (field 1) per item::

    message Print { repeated Value value = 1;  optional CallMeta obs_meta = 15; }
    message Value { oneof value { string desc = 1; TensorProto tensor = 2; } }
    message TensorProto { repeated int64 dims = 1; required string tensor_type = 2;
                          required bytes tensor_content = 3; }
    message CallMeta { uint64 seq = 1; uint64 time_ns = 2; uint64 step = 3; uint64 rank = 4;
                       uint64 pid = 5; string source = 6; uint64 n_values = 7; }

``dims`` are unpacked (proto2), one ``0x08`` tag per dim, as MindSpore writes them.  Tensor
contents are returned as memoryviews of the caller's arrays (no copy) unless they are small,
in which case they are folded into the preceding header so a record costs few iovecs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from printsink.values import Item, TensorItem

__all__ = ["META_FIELD", "CallMeta", "encode_bytes", "encode_meta", "encode_record", "varint"]

META_FIELD = 15
_INLINE_MAX = 16 * 1024  # contents up to this size are copied into the header buffer

Buffer = Union[bytes, bytearray, memoryview]


@dataclass(frozen=True, slots=True)
class CallMeta:
    """When and where one Print call happened; ``n_values`` lets a reader spot a cut record."""

    seq: int
    time_ns: int
    step: int
    rank: int
    pid: int
    source: str
    n_values: int


def varint(value: int) -> bytes:
    """Protobuf base-128 varint of a non-negative int (negative int64 take 10 bytes, as protobuf)."""
    if value < 0:
        value += 1 << 64
    if value < 0x80:
        return bytes((value,))
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _put_len(out: bytearray, tag: int, payload: bytes) -> None:
    out.append(tag)
    out += varint(len(payload))
    out += payload


def encode_meta(meta: CallMeta) -> bytes:
    """The whole field-15 entry (tag, length, CallMeta message)."""
    body = bytearray()
    for number, value in ((1, meta.seq), (2, meta.time_ns), (3, meta.step), (4, meta.rank), (5, meta.pid)):
        body.append(number << 3)
        body += varint(value)
    _put_len(body, (6 << 3) | 2, meta.source.encode("utf-8", "surrogatepass"))
    body.append(7 << 3)
    body += varint(meta.n_values)
    out = bytearray()
    _put_len(out, (META_FIELD << 3) | 2, bytes(body))
    return bytes(out)


def encode_record(items: list[Item], meta: CallMeta | None = None) -> list[Buffer]:
    """Buffers whose concatenation is one serialized Print message (for ``os.writev``)."""
    parts: list[Buffer] = []
    head = bytearray(encode_meta(meta)) if meta is not None else bytearray()
    for item in items:
        if isinstance(item, str):
            desc = bytearray()
            _put_len(desc, 0x0A, item.encode("utf-8", "surrogatepass"))
            head.append(0x0A)
            head += varint(len(desc))
            head += desc
            continue
        nbytes = item.nbytes
        tensor = bytearray()
        for dim in item.dims:
            tensor.append(0x08)
            tensor += varint(dim)
        _put_len(tensor, 0x12, item.dtype.encode("ascii"))
        tensor.append(0x1A)
        tensor += varint(nbytes)
        tensor_len = len(tensor) + nbytes
        head.append(0x0A)
        head += varint(1 + len(varint(tensor_len)) + tensor_len)
        head.append(0x12)
        head += varint(tensor_len)
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

