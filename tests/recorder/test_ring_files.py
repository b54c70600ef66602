"""ring_files: one search finds the rings under a folder, RDR's and the profiler's, and the ranks still writing them."""

from __future__ import annotations

import os

import pytest

from recorder.layout import DEFAULT_CAPACITY
from recorder.ring import RingWriter
from recorder.ring_files import PROFILE_RINGS, LiveRank, find_rings, live_ranks

SMALL = {**DEFAULT_CAPACITY, "module": 16, "op": 16, "step": 8, "blob": 4}


def _ring(path, *, pid, rank, host="node1"):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return RingWriter(str(path), SMALL, pid=pid, rank=rank, world_size=2, meta={"host": host})


def test_the_live_ranks_of_a_job_name_the_root_their_requests_go_to_whatever_folder_was_passed(tmp_path):
    root = tmp_path / "rdr"
    live = _ring(root / "rank_1" / "rdr" / "ring_11.obsring", pid=11, rank=1)
    gone = _ring(root / "rank_0" / "rdr" / "ring_10.obsring", pid=10, rank=0)
    gone.close(remove=False)  # its writer ended without removing it: the lock is free
    try:
        expected = [LiveRank(str(root), live.path, 1, "node1", 11)]
        assert live_ranks(str(root)) == expected
        assert live_ranks(str(root / "rank_1")) == expected and live_ranks(live.path) == expected
        assert live_ranks(str(tmp_path)) == expected  # a folder of runs, each with its root
        found = {os.path.basename(r.path): (r.alive, r.rank, r.pid) for r in find_rings(str(root))}
        assert found == {"ring_10.obsring": (False, 0, 10), "ring_11.obsring": (True, 1, 11)}
    finally:
        live.close(remove=True)


def test_the_profilers_rings_sit_one_folder_under_its_output_folder(tmp_path):
    output = tmp_path / "obs_profile"
    ranks = [_ring(output / f"rank_{r}" / f"profile_{20 + r}_1.obsring", pid=20 + r, rank=r, host="") for r in (1, 0)]
    try:
        found = live_ranks(str(output), PROFILE_RINGS)
        assert [(r.root, r.rank, r.pid, r.host) for r in found] == [(str(output), 0, 20, "?"),
                                                                     (str(output), 1, 21, "?")]
        assert live_ranks(str(output)) == []  # no RDR ring there
    finally:
        for ring in ranks:
            ring.close(remove=True)


def test_a_ring_that_is_not_one_is_listed_with_its_error_and_is_no_live_rank(tmp_path):
    folder = tmp_path / "rank_0" / "rdr"
    folder.mkdir(parents=True)
    (folder / "ring_1.obsring").write_bytes(b"not a ring")
    (ring,) = find_rings(str(tmp_path))
    assert ring.error is not None and (ring.pid, ring.alive) == (-1, False)
    assert live_ranks(str(tmp_path)) == []
    with pytest.raises(FileNotFoundError, match="no such folder"):
        live_ranks(str(tmp_path / "missing"))
