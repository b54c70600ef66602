"""Fuzz targets: ``obs rdr analyze`` over a two-rank job whose rank 1 has a mutated events.jsonl (the collective
descriptions it parses, in a bundle of before ``collectives.bin``) or collectives.bin (the table of the collectives),
or left only a mutated marker.json (no bundle), through
:func:`recorder.analyze.analyze` and the CLI.

Seeds are real: each rank's ring written by :class:`RingWriter` with collectives described by
:func:`collective_desc` (a world group, a subgroup, a point-to-point pair, scheduled / completed /
failed states), turned into bundles by :func:`bundle_parts`, with the recorder's marker beside them.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib

from tests.fuzz import Target, cli_exit

_FILES: dict[str, bytes] = {}  #: "rank_{r}/{file}" → bytes of the intact job, made once


def _job(scratch: str) -> dict[str, bytes]:
    if _FILES:
        return _FILES
    import recorder.layout as layout
    from recorder import collective_table
    from recorder.assemble import bundle_parts
    from recorder.collective_desc import COLLECTIVE_STATES, collective_desc
    from recorder.layout import Kind
    from recorder.ring import RingWriter
    from recorder.ring_reader import read_ring

    capacity = {**{name: 4 for name in layout.DEFAULT_CAPACITY}, "step": 16, "collective": 32}
    for rank in (0, 1):
        saved, layout.STRINGS_SIZE = layout.STRINGS_SIZE, 4096
        try:
            ring = RingWriter(os.path.join(scratch, f"r{rank}.obsring"), capacity,
                              pid=100 + rank, rank=rank, world_size=2,
                              meta={"run_id": "fuzzjob", "host": "h", "granularity": "step"})
        finally:
            layout.STRINGS_SIZE = saved
        step, coll = ring.appender("step"), ring.appender("collective")
        records = [{"op": "all_reduce", "group": "default", "dtype": "float32", "sizes": [[8, 4]]},
                   {"op": "broadcast", "group": "1", "ranks": "0,1", "dtype": "int64", "sizes": [[1]]},
                   {"op": "send" if rank == 0 else "recv", "group": "default:p2p:0-1", "peer": 1 - rank,
                    "dtype": "float32", "sizes": [[2]]}]
        for n in range(1, 4):
            step(Kind.STEP_BEGIN, 0, 0, n, 0, 0)
            for record in records:
                desc = ring.intern(collective_desc(record))
                last = n == 3 and rank == 1 and record["op"] == "all_reduce"
                coll(Kind.COLLECTIVE, 0, desc, n, 0, 1)
                coll(Kind.COLLECTIVE, int(last), desc, n, 1000, COLLECTIVE_STATES.index("failed" if last else
                                                                                        "completed"))
            step(Kind.STEP_END, 0, 0, n, 5000, 0)
        ring.blob(Kind.MARKER, {"marker": "run_id", "run_id": "fuzzjob"})
        manifest, files = bundle_parts(read_ring(ring.buffer()), "exception" if rank else "hang")
        ring.close(remove=True)
        _FILES[f"rank_{rank}/manifest.json"] = json.dumps(manifest).encode()
        _FILES[f"rank_{rank}/events.jsonl"] = "".join(line + "\n" for line in files["events.jsonl"]).encode()
        _FILES[f"rank_{rank}/{collective_table.FILE}"] = files[collective_table.FILE]
        _FILES[f"rank_{rank}/marker.json"] = json.dumps({"state": "dumped", "pid": 100 + rank, "rank": rank,
                                                         "world_size": 2, "run_id": "fuzzjob"}).encode()
    return _FILES


def _seeds(name: str):  # noqa: ANN202
    def seeds(scratch: str) -> list[bytes]:
        return [_job(scratch)[f"rank_1/{name}"]]

    return seeds


def _place(name: str):  # noqa: ANN202 - the job with rank 1's ``name`` replaced by the mutated bytes
    def place(folder: str, data: bytes) -> str:
        root = os.path.join(folder, "rdr")
        for key, content in _FILES.items():
            rank, file = key.split("/")
            rdr = os.path.join(root, rank, "rdr")
            bundle = os.path.join(rdr, f"20260101T00000{rank[-1]}.000000Z_10{rank[-1]}_x")
            os.makedirs(rdr if name == "marker.json" and rank == "rank_1" else bundle, 0o700, exist_ok=True)
            if name == "marker.json" and rank == "rank_1" and file != "marker.json":
                continue  # rank 1 left only its marker: analyze says why from it
            if name == "events.jsonl" and file == "collectives.bin":
                continue  # a bundle of before collectives.bin: analyze reads the collectives from events.jsonl
            target = os.path.join(rdr if file == "marker.json" else bundle, file)
            with open(target, "wb") as fh:
                fh.write(data if key == f"rank_1/{name}" else content)
        return root

    return place


def _analyze(name: str):  # noqa: ANN202 - the engine, then one CLI form chosen by the input
    def read(root: str) -> None:
        from recorder.analyze import analyze

        result = analyze(root)
        assert result.world_size >= 2 and result.verdict
        with open(os.path.join(root, "rank_1", "rdr", "marker.json") if name == "marker.json" else
                  next(os.path.join(d, name) for d, _, f in os.walk(os.path.join(root, "rank_1")) if name in f),
                  "rb") as fh:
            pick = zlib.crc32(fh.read()) & 1
        try:
            cli_exit("--traceback", "rdr", "analyze", root, *(("--json",) if pick else ()))
        finally:
            shutil.rmtree(root, ignore_errors=True)

    return read


TARGETS = [
    Target("rdr_analyze_events", _seeds("events.jsonl"), _analyze("events.jsonl"), place=_place("events.jsonl")),
    Target("rdr_analyze_collectives", _seeds("collectives.bin"), _analyze("collectives.bin"),
           place=_place("collectives.bin")),
    Target("rdr_analyze_marker", _seeds("marker.json"), _analyze("marker.json"), place=_place("marker.json")),
]
