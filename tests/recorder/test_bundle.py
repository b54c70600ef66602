"""Bundles: atomic, private, never overwritten; the reader lists, finds and loads them, and names bad ones."""

from __future__ import annotations

import json
import os
import stat

import pytest

from obs._core.errors import DamagedFileError
from obs._core.safe_files import safe_name
from recorder.bundle import bundle_name, write_bundle
from recorder.bundle_reader import find_bundle, list_bundles, load_bundle


def make(folder, reason="exception", created_ns=1_000, **extra):
    manifest = {"schema_version": 1, "reason": reason, "created_ns": created_ns, "rank": 0, "pid": 7, "step": 3,
                "run_id": "r", **extra}
    return write_bundle(str(folder), f"b{created_ns}_{reason}", manifest,
                        {"events.jsonl": ['{"seq":1,"t":5,"kind":"step_begin","step":1}'], "graphs/g.ir": "graph"})


def test_written_atomically_privately_with_a_file_listing(tmp_path):
    path = make(tmp_path)
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(path)]  # no temporary left
    manifest = json.loads((tmp_path / os.path.basename(path) / "manifest.json").read_text())
    assert manifest["files"] == ["events.jsonl", "graphs/g.ir"]
    for root, _dirs, files in os.walk(path):
        assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
        assert all(stat.S_IMODE(os.stat(os.path.join(root, f)).st_mode) == 0o600 for f in files)


def test_a_taken_name_gets_a_suffix_and_nothing_is_overwritten(tmp_path):
    first, second = make(tmp_path), make(tmp_path)
    assert second == first + "-2" and os.path.exists(os.path.join(first, "manifest.json"))


def test_names_are_sanitized():
    assert safe_name("../../etc/passwd") == "etc_passwd"
    assert safe_name("") == "unnamed" and safe_name(".hidden") == "hidden"
    assert bundle_name("SIGTERM", 12, 1_795_000_000_123_456_789).endswith("_12_SIGTERM")
    assert bundle_name("a/b", 1, 0).startswith("19700101T000000.000000Z_1_a_b")


def test_listing_is_newest_first_and_skips_interrupted_dumps(tmp_path):
    old, new = make(tmp_path, "hang", 1_000), make(tmp_path, "SIGTERM", 2_000)
    os.mkdir(tmp_path / ".tmp-half")
    (tmp_path / ".tmp-half" / "events.jsonl").write_text("")
    listing = list_bundles(str(tmp_path))
    assert [b.path for b in listing.bundles] == [new, old] and listing.incomplete == [str(tmp_path / ".tmp-half")]
    assert find_bundle(str(tmp_path)) == new and find_bundle(str(tmp_path / "latest")) == new
    b = load_bundle(str(tmp_path / "latest"))
    assert b.info.reason == "SIGTERM" and b.events() == [{"seq": 1, "t": 5, "kind": "step_begin", "step": 1}]
    assert b.graphs == [os.path.join(new, "graphs", "g.ir")]


def test_bad_bundles_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"no RDR bundle under .*graphs"):
        load_bundle(str(make(tmp_path) + "/graphs"))
    path = make(tmp_path, created_ns=5)
    with open(os.path.join(path, "manifest.json"), "w") as fh:
        fh.write("{not json")
    with pytest.raises(DamagedFileError, match=r"manifest\.json: not valid JSON at byte 1") as caught:
        load_bundle(path)
    assert caught.value.offset == 1 and caught.value.path.endswith("manifest.json")
    newer = make(tmp_path, created_ns=6, schema_version=99)
    with pytest.raises(ValueError, match="schema_version 99 is newer"):
        load_bundle(newer)
    with pytest.raises(FileNotFoundError, match="no such bundle"):
        load_bundle(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="no such folder"):
        list_bundles(str(tmp_path / "nope"))


def test_corrupt_events_name_the_line(tmp_path):
    path = make(tmp_path)
    with open(os.path.join(path, "events.jsonl"), "a") as fh:
        fh.write("\n{broken\n")
    size = os.path.getsize(os.path.join(path, "events.jsonl"))
    with pytest.raises(DamagedFileError, match=f"events.jsonl: not valid JSON at byte {size - 7}") as caught:
        load_bundle(path).events()
    assert caught.value.offset == size - 7
