"""Reading print files: round trips, MindSpore's own files, and every kind of bad file."""

from __future__ import annotations

import threading
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from printsink.dtypes import NUMPY_OF
from printsink.encoder import CallMeta, encode_bytes
from printsink.reader import PrintFileError, PrintFileWarning, TruncatedPrintFile, follow_print, iter_print, parse_print
from printsink.values import normalize
from printsink.writer import PrintWriter
from tests.printsink.print_pb2 import Print

NUMPY_DTYPES = [NUMPY_OF[n] for n in NUMPY_OF if n != "BFloat16"]


def _meta(seq: int, n: int) -> CallMeta:
    return CallMeta(seq, 1_700_000_000_000_000_000 + seq, step=seq * 10, rank=1, pid=99, source=f"t.py:{seq}",
                    n_values=n)


def write_calls(path, calls) -> list[int]:
    """Write each call as one record; returns the record end offsets."""
    ends = []
    with PrintWriter(str(path)) as writer:
        for seq, values in enumerate(calls, start=1):
            items = normalize(values)
            writer.write([encode_bytes(items, _meta(seq, len(items)))])
            ends.append(writer.bytes)
    return ends


arrays = st.sampled_from(NUMPY_DTYPES).flatmap(
    lambda dt: st.lists(st.integers(1, 4), min_size=1, max_size=3).flatmap(
        lambda shape: st.binary(min_size=int(np.prod(shape)) * dt.itemsize, max_size=int(np.prod(shape)) * dt.itemsize)
        .map(lambda raw: np.frombuffer(raw, dt).reshape(shape))))
values = st.one_of(st.text(max_size=12), arrays, st.integers(-(2**63), 2**63 - 1), st.floats(allow_nan=False),
                   st.booleans())


def _same(a, b) -> bool:
    if isinstance(a, str):
        return a == b
    expected = np.asarray(a)
    return b.shape == expected.shape and b.tobytes() == expected.astype(expected.dtype.newbyteorder("<")).tobytes()


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.lists(values, min_size=1, max_size=5), min_size=1, max_size=4))
def test_round_trip_of_dtypes_shapes_and_strings(tmp_path_factory, calls):
    path = tmp_path_factory.mktemp("rt") / "p.pb"
    write_calls(path, calls)
    flat = [v for call in calls for v in call]
    parsed = parse_print(path)
    assert len(parsed) == len(flat) and all(_same(a, b) for a, b in zip(flat, parsed))
    read = list(iter_print(path))
    assert [c.meta.seq for c in read] == list(range(1, len(calls) + 1))
    assert [len(c.values) for c in read] == [len(c) for c in calls]


def test_scalars_are_0d_and_as_torch_gives_tensors(tmp_path):
    path = tmp_path / "p.pb"
    write_calls(path, [("s", 2.5, 7, True, torch.ones(2, dtype=torch.bfloat16) * 1.5)])
    _, f, i, b, bf = parse_print(path)
    assert (f.shape, f.item(), i.item(), b.item()) == ((), 2.5, 7, True)
    assert bf.dtype == np.float32 and bf.tolist() == [1.5, 1.5]
    tensors = parse_print(path, as_torch=True)
    assert tensors[4].dtype == torch.bfloat16 and tensors[4].tolist() == [1.5, 1.5]
    assert tensors[1].dtype == torch.float64 and tensors[1].shape == ()


def test_metadata_and_offsets(tmp_path):
    path = tmp_path / "p.pb"
    ends = write_calls(path, [("a",), ("b", 1)])
    first, second = iter_print(path)
    assert (first.offset, first.end, second.offset, second.end) == (0, ends[0], ends[0], ends[1])
    assert second.meta.step == 20 and second.meta.source == "t.py:2" and second.meta.rank == 1


def test_files_written_by_mindspore(tmp_path):
    """Both MindSpore writers: one message per call (2.x) and one per item (1.x, [1] and [] dims as scalars)."""
    msg = Print()
    msg.value.add().desc = "x is:"
    t = msg.value.add().tensor
    t.dims.extend([2, 3])
    t.tensor_type, t.tensor_content = "Float32", np.arange(6, dtype="<f4").tobytes()
    scalar = Print()
    st_ = scalar.value.add().tensor
    st_.tensor_type, st_.tensor_content = "Int32", np.int32(5).tobytes()
    old = Print()
    ot = old.value.add().tensor
    ot.dims.append(0)
    ot.tensor_type, ot.tensor_content = "Float64", np.float64(0.5).tobytes()
    path = tmp_path / "ms.pb"
    path.write_bytes(msg.SerializeToString() + scalar.SerializeToString() + old.SerializeToString())
    parsed = parse_print(path)
    assert parsed[0] == "x is:" and parsed[1].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert parsed[2].shape == () and parsed[2].item() == 5 and parsed[3].item() == 0.5
    assert all(call.meta is None for call in iter_print(path))


def test_empty_tensor_round_trips(tmp_path):
    path = tmp_path / "p.pb"
    write_calls(path, [(np.zeros((0,), "<f4"), np.zeros((2, 0), "<i8"))])
    a, b = parse_print(path)
    assert a.shape == (0,) and b.shape == (2, 0)


def test_missing_empty_and_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.pb"):
        parse_print(tmp_path / "nope.pb")
    (tmp_path / "empty.pb").write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty\.pb.*is empty"):
        parse_print(tmp_path / "empty.pb")
    with pytest.raises(IsADirectoryError):
        parse_print(tmp_path)


def test_every_cut_of_a_file_is_a_truncation_never_a_wrong_answer(tmp_path):
    path = tmp_path / "p.pb"
    ends = write_calls(path, [("first", np.arange(3, dtype="<f4")), ("second", 2.0), ("third", np.ones((2, 2)))])
    data = path.read_bytes()
    cut = tmp_path / "cut.pb"
    for n in range(1, len(data)):
        cut.write_bytes(data[:n])
        complete = sum(end <= n for end in ends)
        if n in ends:
            assert len(list(iter_print(cut))) == complete
            continue
        with pytest.raises(TruncatedPrintFile) as info:
            parse_print(cut)
        assert info.value.complete == complete and info.value.offset == ([0] + ends)[complete]
        assert "strict=False" in str(info.value) and "cut.pb" in str(info.value)
        with pytest.warns(PrintFileWarning, match=f"after {complete} complete"):
            calls = list(iter_print(cut, strict=False))
        assert len(calls) == complete


@pytest.mark.parametrize("garbage,offset,problem", [
    (b"\x00\x01\x02", 0, "invalid field tag 0x0"),
    (b"\x0f\x00", 0, "invalid wire type 7"),
    (b"\x0a\x03\x12\x05abcde", 3, "a field of 5 bytes runs past the end of its Print.Value"),
])
def test_corrupt_bytes_name_file_and_offset(tmp_path, garbage, offset, problem):
    path = tmp_path / "bad.pb"
    good = encode_bytes(normalize(("ok",)), _meta(1, 1))
    path.write_bytes(good + garbage)
    with pytest.raises(PrintFileError, match=f"bad.pb' is corrupt at byte offset {len(good) + offset}: {problem}"):
        parse_print(path)


def _tensor_record(dtype: str, dims: list[int], content: bytes) -> bytes:
    msg = Print()
    t = msg.value.add().tensor
    t.dims.extend(dims)
    t.tensor_type, t.tensor_content = dtype, content
    return msg.SerializeToString()


@pytest.mark.parametrize("record,problem", [
    (_tensor_record("Float8", [], b"\0"), "unknown tensor_type 'Float8'"),
    (_tensor_record("Float32", [2], b"\0" * 12), r"dims \[2\] do not match 3 Float32 elements"),
    (_tensor_record("Int32", [], b"\0" * 3), "not a whole number of Int32 elements"),
    (_tensor_record("Int32", [], b""), "scalar Int32 tensor has no content"),
    (b"\x0a\x00", "neither desc nor tensor"),
    (b"\x0a\x03\x0a\x01\xff", "desc is not UTF-8"),
])
def test_bad_tensors(tmp_path, record, problem):
    path = tmp_path / "bad.pb"
    path.write_bytes(record)
    with pytest.raises(PrintFileError, match=problem):
        parse_print(path)


def test_unknown_fields_of_newer_writers_are_skipped(tmp_path):
    path = tmp_path / "p.pb"
    path.write_bytes(b"\x10\x05" + b"\x1d\x00\x00\x00\x00" + encode_bytes(normalize(("v",))))
    assert parse_print(path) == ["v"]


def test_large_tensors_land_in_their_own_writable_arrays(tmp_path):
    path = tmp_path / "p.pb"
    big = np.random.default_rng(0).standard_normal(300_000).astype("<f4")
    write_calls(path, [("big", big), ("small", big[:10])])
    _, got, _, small = parse_print(path)
    assert np.array_equal(got, big) and got.flags.writeable and got.flags.aligned and small.flags.writeable
    got[0] = 1.0


def test_follow_yields_records_as_they_complete(tmp_path):
    path = tmp_path / "live.pb"
    path.write_bytes(b"")
    records = [encode_bytes(normalize((f"call {i}", np.full(50_000, i, "<f4"))), _meta(i, 2)) for i in range(4)]
    done = threading.Event()

    def writer():
        with open(path, "ab") as f:
            for record in records:
                half = len(record) // 2
                f.write(record[:half])
                f.flush()
                done.wait(0.05)
                f.write(record[half:])
                f.flush()

    thread = threading.Thread(target=writer)
    thread.start()
    seen = []
    for call in follow_print(path, poll_s=0.01, stop=lambda: len(seen) == 4):
        seen.append(call)
    thread.join()
    assert [c.values[0] for c in seen] == [f"call {i}" for i in range(4)]
    assert all(c.values[1][0] == i for i, c in enumerate(seen))


def test_no_warning_when_file_is_complete(tmp_path):
    path = tmp_path / "p.pb"
    write_calls(path, [("a",)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert parse_print(path, strict=False) == ["a"]
