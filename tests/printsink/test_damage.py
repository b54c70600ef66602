"""Damaged and foreign print files: packed dims, bounded dims and memory, corruption kept apart from truncation,
skipping bad records with ``strict=False``, and files that are not print files at all."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

from obs._core.errors import DamagedFileError, NotOurFileError
from printsink.encoder import CallMeta, encode_bytes, varint
from printsink.reader import (
    MAX_RANK,
    NotAPrintFile,
    PrintFileError,
    PrintFileWarning,
    TruncatedPrintFile,
    iter_print,
    parse_print,
)
from printsink.values import normalize
from tests.printsink.print_pb2 import Print

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _record(seq: int, *values) -> bytes:
    items = normalize(values)
    return encode_bytes(items, CallMeta(seq, 1_700_000_000_000_000_000, seq, 0, 7, f"t.py:{seq}", len(items)))


def _raw_tensor(dims_field: bytes, dtype: str, content: bytes) -> bytes:
    """One MindSpore-style record holding one tensor, with the dims field bytes given as they are."""
    name = dtype.encode()
    tensor = dims_field + b"\x12" + varint(len(name)) + name + b"\x1a" + varint(len(content)) + content
    value = b"\x12" + varint(len(tensor)) + tensor
    return b"\x0a" + varint(len(value)) + value


def _packed(dims) -> bytes:
    body = b"".join(varint(d) for d in dims)
    return b"\x0a" + varint(len(body)) + body


def _unpacked(dims) -> bytes:
    return b"".join(b"\x08" + varint(d) for d in dims)


def test_packed_dims_are_read_like_unpacked_ones(tmp_path):
    """proto3 writers pack repeated ints: both encodings must give the same tensor."""
    content = np.arange(6, dtype="<f4").tobytes()
    path = tmp_path / "p.pb"
    path.write_bytes(_raw_tensor(_packed([2, 3]), "Float32", content) + _raw_tensor(_unpacked([3, 2]), "Float32",
                                                                                    content))
    packed, unpacked = parse_print(path)
    assert packed.shape == (2, 3) and unpacked.shape == (3, 2)
    assert packed.tolist() == [[0, 1, 2], [3, 4, 5]]


@pytest.mark.parametrize("dims,problem", [
    ([1 << 62, 1 << 62], "do not match"),                 # overflowed int64 products must not wrap to a match
    ([1 << 62, 4, 0], "impossibly large"),                 # empty, yet numpy could not shape it
    ([(1 << 64) - 1], "do not match"),                     # -1
    ([1] * (MAX_RANK + 1), f"more than {MAX_RANK} dims"),
])
def test_huge_or_many_dims_are_clear_errors(tmp_path, dims, problem):
    path = tmp_path / "p.pb"
    content = b"" if 0 in dims or len(dims) == 2 else b"\0" * 4
    path.write_bytes(_record(1, "before") + _raw_tensor(_unpacked(dims), "Float32", content))
    with pytest.raises(PrintFileError, match=problem) as info:
        parse_print(path)
    assert isinstance(info.value, DamagedFileError) and info.value.offset is not None


def test_billion_empty_rows_cost_no_memory_in_obs_print_json(tmp_path):
    """A 23-byte record with dims [1000000000, 0]: ``obs print --json`` under a 1 GiB address-space limit."""
    path = tmp_path / "huge.pb"
    record = _raw_tensor(_unpacked([1_000_000_000, 0]), "Float32", b"")
    assert len(record) == 23
    path.write_bytes(record)
    script = textwrap.dedent(f"""
        import resource, sys
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
        from obs.cli import main
        sys.exit(main(["print", {str(path)!r}, "--json"]))
    """)
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT,
                            env=env)
    assert result.returncode == 0, result.stderr
    assert '"shape": [1000000000, 0], "value": []' in result.stdout
    assert len(parse_print(path)[0].shape) == 2


def _three(tmp_path):
    records = [_record(1, "one", np.arange(4, dtype="<f4")), _record(2, "two", np.ones(3)), _record(3, "three")]
    return tmp_path / "p.pb", records


def test_corrupt_contents_mid_file_is_corruption_and_partial_skips_only_that_record(tmp_path):
    path, records = _three(tmp_path)
    bad = bytearray(records[1])
    at = bad.index(b"Float64")
    bad[at:at + 7] = b"Float65"  # framing intact, contents bad
    path.write_bytes(records[0] + bytes(bad) + records[2])
    with pytest.raises(PrintFileError) as info:
        parse_print(path)
    assert not isinstance(info.value, TruncatedPrintFile)
    assert "unknown tensor_type 'Float65'" in str(info.value) and "strict=False" in str(info.value)
    assert info.value.offset >= len(records[0])
    with pytest.warns(PrintFileWarning) as caught:
        calls = list(iter_print(path, strict=False))
    assert [c.values[0] for c in calls] == ["one", "three"]
    (w,) = caught
    assert (w.message.records, w.message.skipped_bytes, w.message.truncated) == (1, len(bad), False)
    assert "skipped 1 damaged record(s)" in str(w.message)


def test_a_broken_length_mid_file_is_corruption_not_truncation(tmp_path):
    """A length that runs past the end of the file, with intact records after it, is not a torn last record."""
    path, records = _three(tmp_path)
    bad = bytearray(records[1])
    bad[1] = 0x7F  # the metadata length byte: now runs into the values
    path.write_bytes(records[0] + bytes(bad) + records[2])
    with pytest.raises(PrintFileError) as info:
        parse_print(path)
    assert not isinstance(info.value, TruncatedPrintFile)
    with pytest.warns(PrintFileWarning, match="skipped 1 damaged record"):
        calls = list(iter_print(path, strict=False))
    assert [c.values[0] for c in calls] == ["one", "three"]


def test_a_length_prefix_pointing_past_the_end_mid_file(tmp_path):
    path, records = _three(tmp_path)
    bad = bytearray(records[1])
    first_value = 2 + bad[1]  # after the metadata's tag, one-byte length and body
    assert bad[first_value] == 0x0A
    bad[first_value + 1:first_value + 2] = varint(1 << 30)
    path.write_bytes(records[0] + bytes(bad) + records[2])
    with pytest.raises(PrintFileError, match="intact record starts at byte offset") as info:
        parse_print(path)
    assert not isinstance(info.value, TruncatedPrintFile) and info.value.offset == len(records[0])
    with pytest.warns(PrintFileWarning):
        assert [c.values[0] for c in iter_print(path, strict=False)] == ["one", "three"]


def test_torn_last_record_after_damage_reports_both(tmp_path):
    path, records = _three(tmp_path)
    bad = bytearray(records[1])
    bad[bad.index(b"Float64")] = ord("X")
    path.write_bytes(records[0] + bytes(bad) + records[2][:-2])
    with pytest.warns(PrintFileWarning) as caught:
        assert [c.values[0] for c in iter_print(path, strict=False)] == ["one"]
    (w,) = caught
    assert w.message.records == 1 and w.message.truncated and "is truncated after 1 complete" in str(w.message)


def test_mindspore_files_resynchronise_too(tmp_path):
    msgs = []
    for text in ("a", "b", "c"):
        m = Print()
        m.value.add().desc = text
        msgs.append(m.SerializeToString())
    path = tmp_path / "ms.pb"
    path.write_bytes(msgs[0] + b"\x0f\x0f\x0f" + msgs[1] + msgs[2])
    with pytest.raises(PrintFileError, match=f"offset {len(msgs[0])}: invalid wire type 7"):
        parse_print(path)
    with pytest.warns(PrintFileWarning, match="3 byte"):
        assert parse_print(path, strict=False) == ["a", "b", "c"]


@pytest.mark.parametrize("content", [b"# obs\n\nAn observability runtime.\n", b"", b"\x00\x00\x00", b"z" * 40,
                                     b"\x89PNG\r\n\x1a\n" + b"\0" * 30])
def test_files_that_are_not_print_files(tmp_path, content):
    path = tmp_path / "README.md"
    path.write_bytes(content)
    with pytest.raises(NotAPrintFile, match="is not a print file") as info:
        parse_print(path, strict=False)
    assert isinstance(info.value, NotOurFileError) and isinstance(info.value, ValueError)


def test_follow_tells_a_text_file_from_a_damaged_print_file(tmp_path):
    from printsink.reader import follow_print

    text = tmp_path / "notes.txt"
    text.write_text("# notes\n")
    with pytest.raises(NotAPrintFile):
        next(follow_print(text, poll_s=0.01))
    path, records = _three(tmp_path)
    path.write_bytes(records[0] + b"\x00\x00")
    follower = follow_print(path, poll_s=0.01)
    assert next(follower).values[0] == "one"
    with pytest.raises(PrintFileError, match=f"offset {len(records[0])}"):
        next(follower)


def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "pipe.pb"
    os.mkfifo(fifo)
    with pytest.raises(NotAPrintFile, match="not a regular file"):
        parse_print(fifo)


def test_clean_file_gives_no_warning_with_strict_false(tmp_path):
    path, records = _three(tmp_path)
    path.write_bytes(b"".join(records))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(list(iter_print(path, strict=False))) == 3


def test_worker_metadata_round_trips(tmp_path):
    path = tmp_path / "p.pb"
    meta = CallMeta(1, 5, 2, 0, 4242, "w.py:1", 1, parent_pid=4200)
    path.write_bytes(encode_bytes(normalize(("x",)), meta))
    (call,) = iter_print(path)
    assert call.meta == meta
    assert Print.FromString(path.read_bytes()).value[0].desc == "x"  # MindSpore still reads it
