"""rank_folders: every output names a rank's folder one way, and readers read the rank back from the name."""

from __future__ import annotations

import fnmatch

from obs._core.rank_folders import GLOB, folder_rank, rank_folder, unresolved


def test_a_rank_and_a_process_that_does_not_know_its_rank_get_folders_that_read_back():
    assert rank_folder(3) == "rank_3" and folder_rank("rank_3") == 3
    pending = rank_folder(0, unresolved_pid=4242)
    assert pending == "rank_unresolved-4242" and unresolved(pending) and folder_rank(pending) is None
    assert fnmatch.fnmatch("rank_3", GLOB) and fnmatch.fnmatch(pending, GLOB)


def test_other_names_are_no_rank_folders():
    for name in ("rank_", "rank_x", "rank_3.tmp", "xrank_3", "rank_unresolved-", "rank_unresolved-12a", "rdr"):
        assert folder_rank(name) is None and not unresolved(name), name
