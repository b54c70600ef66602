"""collectives.bin: a bundle's collectives in columns, as analyze reads them (real rings and bundles, no torch)."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import numpy as np
import pytest

from obs._core.errors import DamagedFileError
from recorder import collective_table
from recorder.analyze import analyze
from recorder.assemble import bundle_parts
from recorder.collective_desc import COLLECTIVE_STATES, collective_desc
from recorder.collective_table import FLIGHT_RECORDER, CollectiveTable, decode
from recorder.flight_recorder import merge_entries
from recorder.layout import DEFAULT_CAPACITY, Kind
from recorder.ring import RingWriter
from recorder.ring_reader import read_ring
from tests.recorder.test_analyze import all_reduces, write_rank


def _contents(tmp_path, n=5):
    ring = RingWriter(str(tmp_path / "r.obsring"), dict(DEFAULT_CAPACITY), pid=1, rank=0, world_size=2,
                      meta={"run_id": "job", "host": "h", "granularity": "step"})
    step, coll = ring.appender("step"), ring.appender("collective")
    for n_step in range(1, n + 1):
        step(Kind.STEP_BEGIN, 0, 0, n_step, 0, 0)
        for group, op in (("default", "all_reduce"), ("7", "broadcast")):
            desc = ring.intern(collective_desc({"op": op, "group": group, "dtype": "float32", "sizes": [[n_step]]}))
            coll(Kind.COLLECTIVE, 0, desc, n_step, 0, COLLECTIVE_STATES.index("started"))
            failed = n_step == n and group == "7"
            coll(Kind.COLLECTIVE, int(failed), desc, n_step, 1000, COLLECTIVE_STATES.index("failed" if failed else
                                                                                            "completed"))
        step(Kind.STEP_END, 0, 0, n_step, 0, 0)
    contents = read_ring(ring.buffer())
    ring.close(remove=True)
    return contents


def _as_events(table):
    return [{"t": t, "step": st, "group_seq": q, "duration_ns": d, "desc": table.descs[i], "state": s, "flags": f}
            for t, st, q, d, i, s, f in zip(*(table.rows[k].tolist() for k in ("t", "step", "group_seq",
                                                                                 "duration_ns", "desc", "state",
                                                                                 "flags")))]


def test_the_table_holds_what_collectives_jsonl_says_and_reads_back_byte_for_byte(tmp_path):
    contents = _contents(tmp_path)
    table = CollectiveTable.from_contents(contents)
    lines = [json.loads(line) for line in contents.event_lines((Kind.COLLECTIVE,))]
    assert len(table.rows) == len(lines) == 20
    assert _as_events(table) == _as_events(CollectiveTable.from_events(lines))
    assert table.rows["state"][-1] == COLLECTIVE_STATES.index("failed") and table.rows["flags"][-1] == 1
    assert list(table.rows["step"][:4]) == [1, 1, 1, 1] and table.rows["step"][-1] == 5
    data = table.encode()
    again = decode(data, "collectives.bin")
    assert again.descs == table.descs and again.rows.tobytes() == table.rows.tobytes()
    assert again.encode() == data


def test_flight_recorder_entries_join_the_table_in_time_order(tmp_path):
    contents = _contents(tmp_path, n=2)
    _manifest, files = bundle_parts(contents, "hang")
    t0 = int(CollectiveTable.from_contents(contents).rows["t"][1])
    entry = {"op": "all_reduce", "group": "default", "seq": 40, "sizes": [[9]], "dtype": "float32",
             "state": "completed", "t": t0 + 1, "duration_ns": 5}
    assert merge_entries(files, [entry]) == 1
    table = decode(files[collective_table.FILE], "collectives.bin")
    assert len(table.rows) == 9 and (np.diff(table.rows["t"]) >= 0).all()
    (added,) = table.rows[table.rows["flags"] & FLIGHT_RECORDER != 0]
    assert (int(added["group_seq"]), int(added["duration_ns"])) == (40, 5)
    assert table.descs[int(added["desc"])] == collective_desc(entry)
    assert sum('"group_seq":40' in line for line in files["collectives.jsonl"]) == 1  # the same entry, both files


@pytest.mark.parametrize(("damage", "said"), [
    (lambda d: d[:-7], "bytes follow (torn?)"),
    (lambda d: d.split(b"\n", 1)[1], "is not JSON"),
    (lambda d: b"no newline at all", "no header line"),
    (lambda d: d.replace(b'"version":1', b'"version":9', 1), "version 9; this obs reads version 1"),
    (lambda d: d.replace(b'"rows":20', b'"rows":-1', 1), "says -1 rows"),
    (lambda d: d.replace(b'"descs":[', b'"descs":[7,', 1), "with a list of descriptions"),
])
def test_a_damaged_table_is_an_error_that_names_the_file_and_what_is_wrong(tmp_path, damage, said):
    data = CollectiveTable.from_contents(_contents(tmp_path)).encode()
    with pytest.raises(DamagedFileError, match=r"^b/collectives\.bin: ") as caught:
        decode(damage(data), "b/collectives.bin")
    assert said in str(caught.value)


def test_a_row_naming_a_description_that_is_not_there_is_damage(tmp_path):
    table = CollectiveTable.from_contents(_contents(tmp_path))
    rows = table.rows.copy()
    rows["desc"][3] = len(table.descs)
    with pytest.raises(DamagedFileError, match="names description"):
        decode(CollectiveTable(rows, table.descs).encode(), "collectives.bin")


@pytest.mark.parametrize("files", [("collectives.bin",), ("collectives.bin", "collectives.jsonl")])
def test_analyze_finds_the_same_first_mismatch_from_the_table_and_from_the_lines(tmp_path, files):
    """300 collectives; rank 2 ran #150 with another size, and its record ends at #280: the
    first mismatch of the group is #150, from the table as from collectives.jsonl or events.jsonl."""
    for variant in ("table", "lines"):
        for rank in range(3):
            ops = all_reduces(300)
            if rank == 2:
                ops = ops[:149] + [(150, {"op": "all_reduce", "sizes": [[8]]}, "completed")] + ops[150:280]
            bundle = write_rank(tmp_path / variant, rank, 3, ops, steps=4)
            assert os.path.getsize(os.path.join(bundle, "collectives.bin")) > 0  # what the "table" variant reads
            if variant == "lines":
                for name in files:
                    os.unlink(os.path.join(bundle, name))
    table, lines = analyze(str(tmp_path / "table")), analyze(str(tmp_path / "lines"))
    (m,) = table.mismatches
    assert (m.seq, m.kind, m.culprits) == (150, "size", [2])
    assert m.sides == {"all_reduce float32 [[4]]": [0, 1], "all_reduce float32 [[8]]": [2]}
    untimed = [replace(x, t=0) for x in lines.mismatches + [s.last_collective for s in lines.ranks]]
    assert untimed == [replace(x, t=0) for x in table.mismatches + [s.last_collective for s in table.ranks]]
    assert (lines.verdict, lines.stragglers) == (table.verdict, table.stragglers)
