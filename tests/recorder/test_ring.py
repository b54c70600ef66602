"""The ring file: every kind round-trips, rings wrap and count what they dropped, threads never collide."""

from __future__ import annotations

import json
import mmap
import os
import resource
import threading
import time

import pytest

from recorder.layout import DEFAULT_CAPACITY, MAGIC, SLOT, Header, Kind
from recorder.ring import RingWriter
from recorder.ring_reader import read_ring, read_ring_file

# Every test on the C hot path's counters and string table and on Python's (tests/conftest.py).
pytestmark = [pytest.mark.native("RECORDER"), pytest.mark.usefixtures("native_path")]


@pytest.fixture(name="ring")
def _ring(tmp_path):
    writer = RingWriter(str(tmp_path / "r.obsring"), {**DEFAULT_CAPACITY, "module": 32, "blob": 16}, pid=4242,
                        rank=3, world_size=8, meta={"run_id": "abc", "host": "h"})
    yield writer
    writer.close(remove=False)


def test_every_kind_round_trips(ring):
    step, module, op = ring.appender("step"), ring.appender("module"), ring.appender("op")
    memory, coll = ring.appender("memory"), ring.appender("collective")
    scope, name, sig = ring.intern("Default/net-Net/fc1-Linear"), ring.intern("addmm"), ring.intern("f32[2, 3]")
    step(Kind.STEP_BEGIN, 0, 0, 7, 0, 0)
    module(Kind.MODULE_ENTER, 0, scope, 7, 0, 0)
    op(Kind.OP, 1, name, scope, 1234, sig)
    module(Kind.MODULE_EXIT, 1, scope, 7, 0, 0)
    memory(Kind.MEMORY, 0, ring.intern("cpu"), 7, 1 << 30, 2 << 30)
    coll(Kind.COLLECTIVE, 0, ring.intern("all_reduce group=default"), 5, 999, 2)
    ring.blob(Kind.PRINT, {"values": ["loss", "Float32[] 0.5"]})
    step(Kind.STEP_END, 0, 0, 7, 5555, 0)
    contents = read_ring(ring.buffer())
    events = contents.events()
    assert [e["kind"] for e in events] == ["step_begin", "module_enter", "op", "module_exit", "memory", "collective",
                                           "print", "step_end"]
    assert events[2] == {**events[2], "name": "addmm", "scope": "Default/net-Net/fc1-Linear", "duration_ns": 1234,
                         "inputs": "f32[2, 3]", "error": True}
    assert events[3]["error"] is True and "error" not in events[1]
    assert (events[4]["used_bytes"], events[4]["device"]) == (1 << 30, "cpu")
    assert (events[5]["group_seq"], events[5]["state"]) == (5, "completed")
    assert events[6]["values"] == ["loss", "Float32[] 0.5"] and events[7]["duration_ns"] == 5555
    assert [e["seq"] for e in events] == list(range(1, 9))
    h = contents.header
    assert (h.pid, h.rank, h.world_size, h.meta["run_id"]) == (4242, 3, 8, "abc")
    assert abs(events[0]["t"] - time.time_ns()) < 5e9  # slot clocks are turned into wall time
    assert contents.summary()["last_op"]["name"] == "addmm" and contents.summary()["step"] == 7


def test_rings_wrap_and_count_drops(ring):
    module = ring.appender("module")
    sid = ring.intern("s")
    for i in range(100):
        module(Kind.MODULE_ENTER, 0, sid, i, 0, 0)
    for i in range(20):
        ring.blob(Kind.MARKER, {"i": i})
    contents = read_ring(ring.buffer())
    assert contents.dropped["module"] == 68 and contents.dropped["blob"] == 4
    assert [e["step"] for e in contents.events() if e["kind"] == "module_enter"] == list(range(68, 100))


def test_threads_append_without_collisions(tmp_path):
    writer = RingWriter(str(tmp_path / "t.obsring"), DEFAULT_CAPACITY, pid=1, rank=0, world_size=1, meta={})
    append = writer.appender("op")

    def work(k):
        sid = writer.intern(f"thread-{k}")
        for i in range(5000):
            append(Kind.OP, 0, sid, 0, i, 0)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    contents = read_ring(writer.buffer())
    writer.close(remove=True)
    ops = [e for e in contents.events() if e["kind"] == "op"]
    assert len(ops) == 20000 and len({e["seq"] for e in ops}) == 20000
    for k in range(4):
        assert [e["duration_ns"] for e in ops if e["name"] == f"thread-{k}"] == list(range(5000))


@pytest.mark.parametrize("advice", [True, False], ids=["madvise", "page writes"])
def test_the_first_write_to_a_page_does_not_fault_on_the_training_thread(tmp_path, monkeypatch, advice):
    # MAP_POPULATE maps a shared file read-only: each page's first write would fault into the file system.
    if not advice:
        monkeypatch.setattr("recorder.ring._MADV_POPULATE_WRITE", -1)  # an advice the kernel refuses
    writer = RingWriter(str(tmp_path / "f.obsring"), DEFAULT_CAPACITY, pid=1, rank=0, world_size=1, meta={})
    try:
        mm, region = writer.buffer(), writer.rings["op"]
        pages = range(region.offset, region.offset + region.capacity * SLOT.size, mmap.PAGESIZE)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for at in pages:
            mm[at] = 1
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        assert len(pages) > 800 and faults < len(pages) // 20, (faults, len(pages))
    finally:
        writer.close(remove=True)


def test_long_blobs_are_cut_but_stay_json(ring):
    ring.blob(Kind.FAULT, {"fault": "exception", "detail": "x" * 10_000, "error": "E"})
    (event,) = read_ring(ring.buffer()).events()
    assert event["truncated"] is True and event["fault"] == "exception" and event["detail"].endswith("…[cut]")


def test_a_full_string_table_degrades_to_unknown(tmp_path, monkeypatch):
    import recorder.layout as layout

    monkeypatch.setattr(layout, "STRINGS_SIZE", 64)
    writer = RingWriter(str(tmp_path / "s.obsring"), DEFAULT_CAPACITY, pid=1, rank=0, world_size=1, meta={})
    ids = [writer.intern(f"scope-{i:04d}") for i in range(10)]
    assert ids[:4] == [1, 2, 3, 4] and ids[-1] == -1
    append = writer.appender("module")
    append(Kind.MODULE_ENTER, 0, -1, 0, 0, 0)
    (event,) = [e for e in read_ring(writer.buffer()).events() if e["kind"] == "module_enter"]
    writer.close(remove=True)
    assert event["scope"] is None


def test_the_file_survives_the_writer(ring, tmp_path):
    ring.appender("step")(Kind.STEP_BEGIN, 0, 0, 1, 0, 0)
    # no close, no flush: another reader of the file sees it (the page cache is shared)
    assert read_ring_file(str(tmp_path / "r.obsring")).summary()["step"] == 1


def test_never_overwrites_or_follows_links(tmp_path):
    target = tmp_path / "victim"
    target.write_text("keep")
    os.symlink(target, tmp_path / "link.obsring")
    with pytest.raises(FileExistsError):
        RingWriter(str(tmp_path / "link.obsring"), DEFAULT_CAPACITY, pid=1, rank=0, world_size=1, meta={})
    assert target.read_text() == "keep"


@pytest.mark.parametrize("mutate,message", [
    (lambda b: b"NOTARING" + b[8:], "not an obs ring file"),
    (lambda b: b[:8] + (99).to_bytes(4, "little") + b[12:], "version 99 is not supported"),
    (lambda b: b[:100_000], "truncated"),
])
def test_bad_ring_files(ring, tmp_path, mutate, message):
    data = bytes(ring.buffer())
    bad = tmp_path / "bad.obsring"
    bad.write_bytes(mutate(data))
    with pytest.raises(ValueError, match=message):
        read_ring_file(str(bad))


def test_header_round_trip():
    from recorder.layout import plan

    strings, blobs, rings, size = plan(DEFAULT_CAPACITY)
    header = Header(1, 2, 3, 4, 5, strings, 6, blobs, rings, {"k": "v"})
    data = header.encode()
    assert data[:8] == MAGIC and Header.decode(data, size=size) == header and size > len(data)
    with pytest.raises(ValueError, match="too large"):
        Header(1, 2, 3, 4, 5, strings, 6, blobs, rings, {"k": "v" * 5000}).encode()
    assert json.loads(json.dumps(header.meta)) == {"k": "v"}


def test_every_event_gets_its_step(ring):
    """Op and collective slots store no step: the reader gives them the step of the latest step event before them."""
    step, op, coll = ring.appender("step"), ring.appender("op"), ring.appender("collective")
    name, desc = ring.intern("addmm"), ring.intern("all_reduce")
    op(Kind.OP, 0, name, 0, 1, 0)  # before any step event: one less than the first STEP_BEGIN
    for n in (4, 5):
        step(Kind.STEP_BEGIN, 0, 0, n, 0, 0)
        op(Kind.OP, 0, name, 0, 1, 0)
        coll(Kind.COLLECTIVE, 0, desc, 9, 1, 2)
        ring.blob(Kind.PRINT, {"values": ["x"]})
        step(Kind.STEP_END, 0, 0, n, 1, 0)
    op(Kind.OP, 0, name, 0, 1, 0)  # between steps: the step that just ended
    ring.blob(Kind.MARKER, {"marker": "m", "step": 99})  # a payload's own step wins
    events = read_ring(ring.buffer()).events()
    assert all("step" in e for e in events)
    assert [(e["kind"], e["step"]) for e in events] == [
        ("op", 3), ("step_begin", 4), ("op", 4), ("collective", 4), ("print", 4), ("step_end", 4),
        ("step_begin", 5), ("op", 5), ("collective", 5), ("print", 5), ("step_end", 5), ("op", 5), ("marker", 99)]


def test_old_bundles_get_op_steps_from_the_reader(tmp_path):
    """A bundle written before op events carried a step: the reader derives it while streaming."""
    from recorder.bundle import write_bundle
    from recorder.bundle_reader import load_bundle

    lines = ['{"seq":1,"t":1,"kind":"step_begin","step":7}', '{"seq":2,"t":2,"kind":"op","name":"mm"}',
             '{"seq":3,"t":3,"kind":"step_end","step":7}', '{"seq":4,"t":4,"kind":"step_begin","step":8}',
             '{"seq":5,"t":5,"kind":"op","name":"add"}']
    path = write_bundle(str(tmp_path), "old", {"schema_version": 1}, {"events.jsonl": lines}, fsync=False)
    b = load_bundle(path)
    assert [(e["kind"], e["step"]) for e in b.events({"op"})] == [("op", 7), ("op", 8)]
    assert [e["name"] for e in b.events({"op"}, step=8)] == ["add"]
