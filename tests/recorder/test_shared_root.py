"""Ranks sharing one rdr root: whichever leaves last takes away the root obs made, in any order; a root obs did not
make stays."""

from __future__ import annotations

import os

import pytest

from recorder.shared_root import NOTE, leave, make


def rank_dir(root, r):
    return str(root / f"rank_{r}" / "rdr")


@pytest.mark.parametrize("last", [0, 1])
def test_the_rank_that_leaves_last_takes_away_the_root_the_other_made(tmp_path, last):
    root = tmp_path / "a" / "rdr"
    made = {0: make(rank_dir(root, 0), str(root))}  # rank 0 made the root (and a/ above it)
    made[1] = make(rank_dir(root, 1), str(root))  # rank 1 found it there: the race of a 2-rank run
    assert sorted(os.listdir(root)) == [NOTE, "rank_0", "rank_1"]
    for r in (1 - last, last):
        leave(made[r], str(root))
    assert os.listdir(tmp_path) == []  # the root and the folder above it obs made: gone


def test_a_root_obs_did_not_make_stays(tmp_path):
    root = tmp_path / "rdr"
    root.mkdir()
    made = make(rank_dir(root, 0), str(root))
    assert made == [rank_dir(root, 0), str(root / "rank_0")] and os.listdir(root) == ["rank_0"]
    leave(made, str(root))
    assert os.listdir(tmp_path) == ["rdr"] and os.listdir(root) == []


def test_a_root_with_something_else_in_it_stays(tmp_path):
    root = tmp_path / "rdr"
    made = make(rank_dir(root, 0), str(root))
    (root / "rank_1").mkdir()  # a rank still there, or a bundle of an earlier run
    leave(made, str(root))
    assert sorted(os.listdir(root)) == [NOTE, "rank_1"]


def test_a_note_never_removes_a_folder_that_is_not_above_its_root(tmp_path):
    root, elsewhere = tmp_path / "rdr", tmp_path / "elsewhere"
    elsewhere.mkdir()
    made = make(rank_dir(root, 0), str(root))
    (root / NOTE).write_text(f'{{"made": ["{elsewhere}"]}}')
    leave(made, str(root))
    assert os.listdir(tmp_path) == ["elsewhere"]
