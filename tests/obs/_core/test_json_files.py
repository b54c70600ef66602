"""json_files: one reader of obs's own JSON files, whose errors name the file, what was expected and what was found."""

from __future__ import annotations

import os

import pytest

from obs._core.errors import DamagedFileError, NotOurFileError, UnsafePathError
from obs._core.json_files import is_int, parse_json, read_json


def test_a_file_of_obs_reads_as_its_json_object(tmp_path):
    path = tmp_path / "marker.json"
    path.write_text('{"pid": 7, "run_id": "job"}')
    assert read_json(str(path), what="a rank's marker") == {"pid": 7, "run_id": "job"}
    assert read_json(str(path), what="a rank's marker", limit=len(path.read_bytes())) == {"pid": 7, "run_id": "job"}


def test_a_file_over_its_limit_is_refused_unread_with_its_size(tmp_path):
    path = tmp_path / "request.json"
    path.write_text('{"pad": "' + "x" * 100 + '"}')
    with pytest.raises(NotOurFileError, match=r"request\.json: 111 bytes, more than a request ever holds \(64 bytes\)"):
        read_json(str(path), what="a request", limit=64)


def test_another_shape_names_the_expectation_and_the_value(tmp_path):
    path = tmp_path / "status.json"
    path.write_text("[1, 2]")
    with pytest.raises(NotOurFileError, match=r"status\.json: not a status: expected a JSON object, found a JSON "
                                              r"array \[1, 2\]") as caught:
        read_json(str(path), what="a status")
    assert caught.value.path == str(path)
    assert read_json(str(path), what="a status", expect=list) == [1, 2]
    assert read_json(str(path), what="a status", expect=None) == [1, 2]


@pytest.mark.parametrize("data,message,offset", [
    (b'{"a": 1,}', r"not valid JSON at byte 8 \(Expecting property name .*; found '}'\)", 8),
    (b'{"a": ', r"not valid JSON at byte 6 \(.*; found the end\)", 6),
    (b'{"a": "\xff"}', r"not UTF-8 at byte 7 \(found b'\\xff\"}'\)", 7),
    (b"[" * 100_000 + b"]" * 100_000, r"unreadable JSON at byte 0", 0),
])
def test_damaged_json_names_the_byte_and_what_stands_there(tmp_path, data, message, offset):
    path = tmp_path / "manifest.json"
    path.write_bytes(data)
    with pytest.raises(DamagedFileError, match=message) as caught:
        read_json(str(path), what="an RDR manifest")
    assert (caught.value.path, caught.value.offset) == (str(path), offset)


def test_a_line_inside_a_file_names_its_byte_in_the_file():
    with pytest.raises(DamagedFileError, match=r"events\.jsonl: not valid JSON at byte 103") as caught:
        parse_json(b"{broken", "events.jsonl", base=102)
    assert caught.value.offset == 103


def test_a_symlink_is_refused_and_an_absent_file_is_the_file_systems_error(tmp_path):
    target = tmp_path / "real.json"
    target.write_text("{}")
    os.symlink(target, tmp_path / "link.json")
    with pytest.raises(UnsafePathError, match="symlink"):
        read_json(str(tmp_path / "link.json"), what="a marker")
    with pytest.raises(FileNotFoundError):
        read_json(str(tmp_path / "absent.json"), what="a marker")


def test_is_int_takes_json_integers_and_not_booleans():
    assert is_int(0) and is_int(-(1 << 70))
    assert not is_int(True) and not is_int(1.0) and not is_int("1") and not is_int(None)
