"""safe_files: names from untrusted text, and appends that refuse what obs did not create."""

from __future__ import annotations

import os

import pytest

from obs._core import safe_files
from obs._core.errors import UnsafePathError
from obs._core.safe_files import safe_name as name


def test_safe_name_makes_one_harmless_path_component_of_anything():
    assert name("../../etc/passwd") == "etc_passwd"
    assert name("") == "unnamed" and name("..") == "unnamed"
    assert name(".hidden") == "hidden"
    long_a, long_b = "x" * 100 + "a", "x" * 100 + "b"
    assert len(name(long_a)) == 64 and name(long_a) != name(long_b)
    assert name(long_a).startswith("x" * 53 + "~")
    # MindSpore's escape: one for one, no trimming
    keep = r"A-Za-z0-9_+=()\-"
    assert name("Default/net-Net/fc1.Linear op", keep=keep, runs=False) == "Default_net-Net_fc1_Linear_op"
    assert name("", keep=keep, runs=False) == "_"
    assert name("..", keep=keep, runs=False) == "__"


def test_an_atomic_write_into_a_folder_someone_else_owns_never_makes_the_folder_again(tmp_path):
    gone = tmp_path / "requests" / "answer.json"
    with pytest.raises(FileNotFoundError):
        safe_files.write_atomic(str(gone), "{}", fsync=False, folder_ready=True)
    assert not gone.parent.exists()
    safe_files.write_atomic(str(gone), "{}", fsync=False)  # a writer of its own folder makes it
    assert gone.read_text() == "{}" and os.listdir(gone.parent) == ["answer.json"]


def test_open_append_takes_a_regular_file_and_refuses_a_symlink_or_a_folder(tmp_path):
    target = tmp_path / "dump.csv"
    safe_files.write_new(str(target), b"a\n")
    fd = safe_files.open_append(str(target), what="dump file")
    os.write(fd, b"b\n")
    os.close(fd)
    assert target.read_bytes() == b"a\nb\n"
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(UnsafePathError, match=r"dump file .*symlink"):
        safe_files.open_append(str(tmp_path / "link"), what="dump file")
    with pytest.raises(OSError):
        safe_files.open_append(str(tmp_path), what="dump file")
    with pytest.raises(FileExistsError):
        safe_files.write_new(str(target), b"again")
    assert target.read_bytes() == b"a\nb\n"


def test_a_new_folder_is_complete_or_absent_and_never_replaces_another(tmp_path):
    def fill(tmp):
        assert os.path.basename(tmp).startswith(safe_files.TMP_FOLDER_PREFIX)
        safe_files.write_new(os.path.join(tmp, "meta.json"), b"{}")

    first = safe_files.new_folder(str(tmp_path / "rank_0"), "b", fill, fsync=True)
    second = safe_files.new_folder(str(tmp_path / "rank_0"), "b", fill)
    assert (first, second) == (str(tmp_path / "rank_0" / "b"), first + "-2")
    assert os.listdir(second) == ["meta.json"] and oct(os.stat(second).st_mode & 0o777) == "0o700"

    def broken(tmp):
        safe_files.write_new(os.path.join(tmp, "half"), b"")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        safe_files.new_folder(str(tmp_path / "rank_0"), "b", broken)
    assert sorted(os.listdir(tmp_path / "rank_0")) == ["b", "b-2"]  # no half folder left
