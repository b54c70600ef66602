"""The encoder writes exactly MindSpore's wire format: known bytes, and protobuf's own serializer agrees."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from printsink.dtypes import NUMPY_OF
from printsink.encoder import CallMeta, encode_bytes, encode_record, varint
from printsink.values import TensorItem, normalize
from tests.printsink.print_pb2 import ObsPrint, Print

DTYPES = [name for name in NUMPY_OF if name != "BFloat16"]


def test_reference_bytes_of_a_small_message():
    data = np.arange(6, dtype="<f4").reshape(2, 3)
    encoded = encode_bytes(normalize(("x is:", data)))
    expected = (bytes.fromhex("0a 07 0a 05") + b"x is:" + bytes.fromhex("0a 29 12 27 08 02 08 03 12 07") + b"Float32"
                + bytes.fromhex("1a 18") + data.tobytes())
    assert encoded == expected


def test_varint_matches_protobuf():
    for value in (0, 1, 127, 128, 300, 2**32, 2**63 - 1, -1, -(2**63)):
        msg = Print()
        msg.value.add().tensor.dims.append(value)
        msg.value[0].tensor.tensor_type, msg.value[0].tensor.tensor_content = "Int8", b"\0"
        assert varint(value) in msg.SerializeToString()
    assert varint(-1) == b"\xff" * 9 + b"\x01"


def _reference(items) -> bytes:
    msg = Print()
    for item in items:
        value = msg.value.add()
        if isinstance(item, str):
            value.desc = item
        else:
            value.tensor.dims.extend(item.dims)
            value.tensor.tensor_type = item.dtype
            value.tensor.tensor_content = bytes(item.content())
    return msg.SerializeToString()


shapes = st.lists(st.integers(0, 5), max_size=4).map(tuple)
texts = st.text(max_size=20)


@st.composite
def tensor_items(draw):
    name = draw(st.sampled_from(DTYPES))
    shape = draw(shapes)
    raw = draw(st.binary(min_size=int(np.prod(shape)) * NUMPY_OF[name].itemsize,
                         max_size=int(np.prod(shape)) * NUMPY_OF[name].itemsize))
    data = np.frombuffer(raw, NUMPY_OF[name]).reshape(shape) if shape else np.frombuffer(raw, NUMPY_OF[name])[0:1]
    return TensorItem(name, shape, np.ascontiguousarray(data.reshape(shape)))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.one_of(texts, tensor_items()), max_size=6))
def test_same_bytes_as_the_protobuf_library(items):
    assert encode_bytes(items) == _reference(items)


def test_large_contents_are_passed_without_copy():
    big = np.ones(1 << 16, dtype="<f4")
    parts = encode_record(normalize(("big", big)))
    views = [p for p in parts if isinstance(p, memoryview)]
    assert len(views) == 1 and np.shares_memory(np.asarray(views[0]), big)


def test_metadata_is_an_unknown_field_to_mindspore_and_readable_with_its_schema():
    meta = CallMeta(seq=7, time_ns=1_795_000_000_123_456_789, step=41873, rank=3, pid=4242, source="train.py:12",
                    n_values=2)
    record = encode_bytes(normalize(("loss:", 0.25)), meta)
    original = Print.FromString(record)
    assert [v.desc for v in original.value][:1] == ["loss:"] and len(original.value) == 2
    extended = ObsPrint.FromString(record)
    assert (extended.obs_meta.seq, extended.obs_meta.step, extended.obs_meta.rank) == (7, 41873, 3)
    assert extended.obs_meta.time_ns == meta.time_ns and extended.obs_meta.source == "train.py:12"
    assert extended.obs_meta.n_values == 2


def test_concatenated_records_merge_into_one_message_in_mindspore():
    records = [encode_bytes(normalize((f"call {i}", np.full((2,), i, "<i4"))), CallMeta(i, 0, 0, 0, 1, "", 2))
               for i in range(3)]
    merged = Print.FromString(b"".join(records))
    assert [v.desc for v in merged.value if v.HasField("desc")] == ["call 0", "call 1", "call 2"]
    assert [np.frombuffer(v.tensor.tensor_content, "<i4").tolist() for v in merged.value if v.HasField("tensor")] \
        == [[0, 0], [1, 1], [2, 2]]
