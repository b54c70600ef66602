"""obs rdr analyze on jobs written here rank by rank (real rings and bundles, no torch): the verdicts that the
torchrun tests (test_dist.py) do not reach."""

from __future__ import annotations

import json
import os
import time

from obs.cli import main
from recorder.analyze import analyze
from recorder.assemble import bundle_parts
from recorder.bundle import write_bundle
from recorder.collective_desc import COLLECTIVE_STATES, collective_desc
from recorder.layout import DEFAULT_CAPACITY, Kind
from recorder.ring import RingWriter
from recorder.ring_reader import read_ring


def write_rank(root, rank, world, collectives, *, reason="hang", steps=1, recovered=False):
    """A bundle of ``rank`` whose ring holds ``collectives``: (group seq, record fields, final state)."""
    rdr = os.path.join(root, f"rank_{rank}", "rdr")
    os.makedirs(rdr, 0o700, exist_ok=True)
    ring = RingWriter(os.path.join(rdr, f"ring_{rank}.obsring"), dict(DEFAULT_CAPACITY), pid=1000 + rank, rank=rank,
                      world_size=world, meta={"run_id": "job", "host": "h", "granularity": "step"})
    step, coll = ring.appender("step"), ring.appender("collective")
    for n in range(1, steps + 1):
        step(Kind.STEP_BEGIN, 0, 0, n, 0, 0)
    for seq, fields, state in collectives:
        desc = ring.intern(collective_desc({"group": "default", "dtype": "float32", "sizes": [[4]], **fields}))
        coll(Kind.COLLECTIVE, 0, desc, seq, 0, COLLECTIVE_STATES.index("started"))
        if state != "started":
            coll(Kind.COLLECTIVE, int(state == "failed"), desc, seq, 10, COLLECTIVE_STATES.index(state))
    manifest, files = bundle_parts(read_ring(ring.buffer()), reason, recovered=recovered)
    ring.close(remove=True)
    return write_bundle(rdr, f"b_{rank}_{reason}", manifest, files, fsync=False)


def all_reduces(n, state="completed", **fields):
    return [(seq, {"op": "all_reduce", **fields}, state) for seq in range(1, n + 1)]


def test_a_rank_whose_bundle_was_written_before_the_others_went_on_is_behind_not_missing(tmp_path):
    write_rank(tmp_path, 1, 2, all_reduces(3))
    time.sleep(0.01)
    write_rank(tmp_path, 0, 2, all_reduces(5), steps=2)
    result = analyze(str(tmp_path))
    assert not result.mismatches and result.consistent
    assert [(s.rank, s.behind_steps, s.behind_collectives) for s in result.stragglers] == [(1, 1, 2)]


def test_a_different_dtype_and_a_tie_of_two_ranks_name_both_sides(tmp_path):
    write_rank(tmp_path, 0, 2, all_reduces(2) + [(3, {"op": "all_reduce"}, "started")])
    write_rank(tmp_path, 1, 2, all_reduces(2) + [(3, {"op": "all_reduce", "dtype": "float16"}, "started")])
    result = analyze(str(tmp_path))
    (m,) = result.mismatches
    assert (m.seq, m.kind, m.culprits) == (3, "dtype", [0, 1])
    assert m.sides == {"all_reduce float32 [[4]]": [0], "all_reduce float16 [[4]]": [1]}


def test_every_rank_waiting_in_the_same_collective_is_a_hang_without_a_culprit(tmp_path, capsys):
    for rank in range(3):
        write_rank(tmp_path, rank, 3, all_reduces(4) + [(5, {"op": "barrier", "sizes": []}, "started")])
    result = analyze(str(tmp_path))
    assert result.stuck is not None and result.stuck.seq == 5 and result.culprits == []
    assert not result.consistent and "every rank waits in default collective #5" in result.verdict
    assert main(["rdr", "analyze", str(tmp_path), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["stuck"]["op"] == "barrier"


def test_point_to_point_pairs_and_subgroups_line_up_with_their_own_members(tmp_path, capsys):
    p2p = "default:p2p:0-1"
    sub = {"group": "1", "ranks": "0,2"}
    write_rank(tmp_path, 2, 3, [(1, {"op": "all_reduce", **sub}, "completed"),
                                (2, {"op": "all_reduce", **sub}, "started")])
    write_rank(tmp_path, 1, 3, [(1, {"op": "recv", "group": p2p, "peer": 0}, "completed")])
    write_rank(tmp_path, 0, 3, [(1, {"op": "send", "group": p2p, "peer": 1}, "completed"),
                                (1, {"op": "all_reduce", **sub}, "completed")])  # dumped last: it never got to #2
    result = analyze(str(tmp_path))
    (m,) = result.mismatches  # rank 0 never entered the subgroup's second all_reduce; rank 1 is not in it
    assert (m.group, m.seq, m.kind, m.sides["never reached it"]) == ("1", 2, "missing", [0])
    assert main(["rdr", "analyze", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "culprit rank(s): 0" in out and "first disagreement in group 1: collective #2" in out


def test_a_rank_without_a_bundle_is_explained_by_its_marker(tmp_path):
    write_rank(tmp_path, 0, 2, all_reduces(2))
    rdr = tmp_path / "rank_1" / "rdr"
    rdr.mkdir(parents=True)
    (rdr / "marker.json").write_text(json.dumps({"state": "dump_failed", "rank": 1, "world_size": 2,
                                                 "failed": "hang: OSError: No space left on device"}))
    result = analyze(str(tmp_path))
    assert result.no_bundle == [1] and result.culprits == [1]
    assert "No space left on device" in result.ranks[1].note


def test_a_rank_that_died_without_dumping_is_named_where_the_collectives_agree(tmp_path, capsys):
    write_rank(tmp_path, 1, 2, all_reduces(3), reason="recovered", steps=3, recovered=True)
    write_rank(tmp_path, 0, 2, all_reduces(3), reason="SIGTERM", steps=3)  # stopped before it waited on rank 1
    result = analyze(str(tmp_path))
    assert not result.mismatches and result.died == [1] and result.culprits == [1] and not result.consistent
    assert result.verdict.startswith("rank(s) 1 died without dumping (SIGKILL, OOM kill?) at step 3")
    write_rank(tmp_path, 1, 2, all_reduces(3), reason="fatal_signal", steps=3, recovered=True)
    assert "(a fatal signal)" in analyze(str(tmp_path)).verdict
    assert main(["rdr", "analyze", str(tmp_path), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["died"] == [1]


def test_bundles_without_the_split_files_are_read_from_events_jsonl_alike(tmp_path):
    """Bundles written before collectives.bin, steps.jsonl and faults.jsonl existed: analyze parses events.jsonl,
    same verdict."""
    for rank in range(2):
        write_rank(tmp_path / "new", rank, 2, all_reduces(4), steps=6)
        old = write_rank(tmp_path / "old", rank, 2, all_reduces(4), steps=6)
        for name in ("steps.jsonl", "faults.jsonl", "collectives.bin", "collectives.jsonl"):
            os.unlink(os.path.join(old, name))
    new, old = analyze(str(tmp_path / "new")), analyze(str(tmp_path / "old"))
    assert (new.verdict, new.consistent, new.lineup.collectives) == (old.verdict, old.consistent,
                                                                    old.lineup.collectives)
    assert new.consistent and new.lineup.collectives == 4


def test_a_damaged_steps_file_names_its_byte(tmp_path, capsys):
    bundle = write_rank(tmp_path, 0, 1, all_reduces(2), steps=3)
    size = os.path.getsize(os.path.join(bundle, "steps.jsonl"))
    with open(os.path.join(bundle, "steps.jsonl"), "ab") as fh:
        fh.write(b'{"seq": 9, "t": "late"}\n')
    assert main(["rdr", "analyze", str(tmp_path)]) == 1  # a problem: the bundle cannot be read
    err = capsys.readouterr().err
    assert "steps.jsonl" in err and f"byte {size} is not an event" in err
