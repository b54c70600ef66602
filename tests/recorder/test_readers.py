"""The ring and bundle readers on damaged input: a DamagedFileError naming file and byte offset (ours, damaged) or a
NotOurFileError (not a ring or bundle at all); never a traceback, and nothing allocated from a length field."""

from __future__ import annotations

import json
import os
import resource
import struct

import pytest

from obs._core.errors import DamagedFileError, NotOurFileError
from recorder.bundle import write_bundle
from recorder.bundle_reader import list_bundles, load_bundle
from recorder.layout import DEFAULT_CAPACITY, HEADER, HEADER_SIZE, REGION, STRINGS_USED_AT, Kind
from recorder.ring import RingWriter
from recorder.ring_reader import read_ring_file

# Rings written by the C hot path and by the Python handlers (tests/conftest.py).
pytestmark = [pytest.mark.native("RECORDER"), pytest.mark.usefixtures("native_path")]

SMALL = {**DEFAULT_CAPACITY, "module": 16, "op": 16, "step": 8, "blob": 4}


@pytest.fixture(name="ring_bytes")
def _ring_bytes(tmp_path):
    writer = RingWriter(str(tmp_path / "seed.obsring"), SMALL, pid=7, rank=0, world_size=1, meta={"run_id": "r"})
    writer.appender("step")(Kind.STEP_BEGIN, 0, 0, 1, 0, 0)
    writer.appender("op")(Kind.OP, 0, writer.intern("addmm"), 0, 10, 0)
    writer.blob(Kind.PRINT, {"values": ["x"]})
    data = bytes(writer.buffer())
    writer.close(remove=True)
    return data


def _edit(data: bytes, offset: int, fmt: str, value: int) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


@pytest.mark.parametrize("damage,offset,message", [
    # the op ring's capacity set to 2^40 slots: 64 TiB claimed by a 4 MiB file
    (lambda d: _edit(d, HEADER.size + 2 * REGION.size + 24, "<Q", 1 << 40), None,
     "ring file is truncated at byte .*: region 'op'"),
    (lambda d: _edit(d, HEADER.size - 4, "<I", 0xFFFFFFFF), HEADER.size - 4, "rings do not fit in the header"),
    (lambda d: _edit(d, STRINGS_USED_AT, "<Q", 1 << 62), STRINGS_USED_AT, "strings used"),
    (lambda d: _edit(d, 24, "<q", -5), 24, "clock values must not be negative"),
    (lambda d: _edit(d, HEADER.size + 5 * REGION.size, "<I", 5000), HEADER.size + 5 * REGION.size,
     "metadata length 5000 runs past"),
    (lambda d: d[:HEADER.size + 5 * REGION.size + 4] + b"[" * 2000 + d[HEADER.size + 5 * REGION.size + 2004:],
     HEADER.size + 5 * REGION.size + 4, "metadata is not JSON"),
    (lambda d: _edit(d, HEADER.size + REGION.size + 16, "<Q", 4096), 4096, "inside the header"),
    (lambda d: d[:HEADER_SIZE + 100], HEADER_SIZE + 100, "truncated"),
    (lambda d: d[:5], 5, "truncated at byte 5"),
])
def test_damaged_rings_name_file_and_offset(tmp_path, ring_bytes, damage, offset, message):
    bad = tmp_path / "ring_7.obsring"
    bad.write_bytes(damage(ring_bytes))
    with pytest.raises(DamagedFileError, match=message) as caught:
        read_ring_file(str(bad))
    assert caught.value.path == str(bad) and str(bad) in str(caught.value)
    if offset is not None:
        assert caught.value.offset == offset and f"byte {offset}" in str(caught.value)


def test_a_length_field_allocates_nothing(tmp_path, ring_bytes):
    """A header claiming 2^60-slot rings in a small file is refused before anything is read out of it."""
    data = bytearray(ring_bytes)
    for i in range(5):
        struct.pack_into("<Q", data, HEADER.size + i * REGION.size + 24, 1 << 60)
    bad = tmp_path / "huge.obsring"
    bad.write_bytes(bytes(data))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(DamagedFileError):
        read_ring_file(str(bad))
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 * 1024  # KiB: < 64 MiB more


@pytest.mark.parametrize("data,message", [
    (b"", "empty file"), (b"hello world, this is text" * 400, "not an obs ring file"),
    (b"OBSRING\x01" + (2).to_bytes(4, "little") + b"\0" * 5000, "version 2 is not supported"),
])
def test_files_that_are_not_rings(tmp_path, data, message):
    path = tmp_path / "x.obsring"
    path.write_bytes(data)
    with pytest.raises(NotOurFileError, match=message):
        read_ring_file(str(path))


def _bundle(tmp_path, events=None, **manifest):
    lines = events if events is not None else ['{"seq":1,"t":5,"kind":"step_begin","step":1}']
    return write_bundle(str(tmp_path), "b", {"schema_version": 1, "reason": "x", "created_ns": 1, **manifest},
                        {"events.jsonl": lines}, fsync=False)


@pytest.mark.parametrize("line,message", [
    ('{"seq":2,"kind":"op"}', "line 2 .* is not an event"),  # no "t": KeyError 't' in the view before
    ('[1, 2]', "line 2 .* is not an event"),
    ('{"seq":2,"t":1,"kind":5}', "line 2 .* is not an event"),
    ("[" * 5000 + "]" * 5000, "unreadable JSON"),
    ('{"seq":2,"t":1,"kind":"op"', "not valid JSON at byte"),
    ('{"seq":2,"t":1,"kind":"op","x":"\udcff"}', "not UTF-8 at byte"),
])
def test_damaged_events_name_the_byte(tmp_path, line, message):
    path = _bundle(tmp_path, ['{"seq":1,"t":5,"kind":"step_begin","step":1}', line])
    with pytest.raises(DamagedFileError, match=message) as caught:
        load_bundle(path).events()
    second_line_at = len('{"seq":1,"t":5,"kind":"step_begin","step":1}\n')
    assert caught.value.path == os.path.join(path, "events.jsonl") and caught.value.offset >= second_line_at


@pytest.mark.parametrize("manifest,error,message", [
    ({"reason": ["a"]}, DamagedFileError, "manifest key 'reason' must be str"),
    ({"created_ns": "soon"}, DamagedFileError, "'created_ns' must be int"),
    ({"step": True}, DamagedFileError, "'step' must be int"),
    ({"exception": "boom"}, DamagedFileError, "'exception' must be dict or null"),
    ({"schema_version": "1"}, DamagedFileError, "schema_version must be a whole number"),
    ({"schema_version": 7}, NotOurFileError, "schema_version 7 is newer"),
])
def test_damaged_manifests_name_the_key(tmp_path, manifest, error, message):
    path = _bundle(tmp_path, **manifest)
    with pytest.raises(error, match=message):
        load_bundle(path)


def test_a_manifest_that_is_someone_elses(tmp_path):
    folder = tmp_path / "webapp"
    folder.mkdir()
    (folder / "manifest.json").write_text(json.dumps({"name": "my app", "icons": []}))
    listing = list_bundles(str(tmp_path))
    assert not listing.bundles and not listing.damaged
    assert [type(e) for e in listing.skipped] == [NotOurFileError] and "no schema_version" in str(listing.skipped[0])


def test_stacks_and_exception_records_are_checked(tmp_path):
    path = _bundle(tmp_path)
    with open(os.path.join(path, "stacks.json"), "w") as fh:
        json.dump([{"thread": "main", "frames": [{"file": 3}]}], fh)
    with pytest.raises(DamagedFileError, match=r"stacks\.json: thread 0 is not a stack"):
        load_bundle(path)
    os.unlink(os.path.join(path, "stacks.json"))
    with open(os.path.join(path, "exception.json"), "w") as fh:
        json.dump({"traceback": ["not", "text"]}, fh)
    with pytest.raises(DamagedFileError, match=r"exception\.json: not an exception record"):
        load_bundle(path)


def test_bundle_files_are_never_read_through_a_symlink(tmp_path):
    from obs._core.errors import UnsafePathError

    secret = tmp_path / "secret"
    secret.write_text('{"seq":1,"t":1,"kind":"print","values":["the secret"]}\n')
    path = _bundle(tmp_path / "b")
    os.unlink(os.path.join(path, "events.jsonl"))
    os.symlink(secret, os.path.join(path, "events.jsonl"))
    with pytest.raises(UnsafePathError, match="symlink"):
        load_bundle(path).events()


def test_a_pick_says_how_many_events_matched_besides_the_ones_it_kept(tmp_path):
    lines = ['{"seq":1,"t":1,"kind":"step_begin","step":5}'] + \
        [f'{{"seq":{i},"t":{i},"kind":"module_enter","scope":"m{i}"}}' for i in range(2, 42)] + \
        ['{"seq":42,"t":42,"kind":"step_begin","step":6}', '{"seq":43,"t":43,"kind":"module_enter","scope":"n"}']
    b = load_bundle(_bundle(tmp_path, lines))
    last = b.pick({"module_enter"}, last=3, step=5)
    assert [e["seq"] for e in last.events] == [39, 40, 41] and last.matched == 40
    first = b.pick({"module_enter"}, first=2)
    assert [e["seq"] for e in first.events] == [2, 3] and first.matched == 41
    assert b.pick(step=6).matched == len(b.events(step=6)) == 2
