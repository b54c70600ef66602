"""Recover and the writers on hostile folders: liveness from the writer's lock (no pid is ever signalled), one
bad ring never stops the others, no file is read or written through a planted symlink or hard link, and the
ring's size is bounded."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from obs._core.errors import DamagedFileError, ObsConfigError, UnsafePathError
from recorder.bundle import write_bundle, write_json_atomic
from recorder.bundle_reader import list_bundles, load_bundle
from recorder.layout import DEFAULT_CAPACITY, MAX_RING_BYTES, Kind, check_capacity
from recorder.recover import recover, recover_rings
from recorder.ring import RingWriter
from recorder.ring_files import find_rings
from tests.obs.cli.test_cli import obs_cli

# Rings written by the C hot path and by the Python handlers (tests/conftest.py).
pytestmark = [pytest.mark.native("RECORDER"), pytest.mark.usefixtures("native_path")]

SMALL = {**DEFAULT_CAPACITY, "module": 16, "op": 16, "step": 8, "blob": 4}
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def dead_ring(folder, pid, *, step=3, name=None):
    """A ring left behind by a writer that is gone (closed without removing: the lock is released)."""
    path = os.path.join(str(folder), name or f"ring_{pid}.obsring")
    writer = RingWriter(path, SMALL, pid=pid, rank=0, world_size=1, meta={"run_id": f"run{pid}"})
    writer.appender("step")(Kind.STEP_BEGIN, 0, 0, step, 0, 0)
    writer.close(remove=False)
    return path


@pytest.fixture(name="no_kill")
def _no_kill(monkeypatch):
    def refuse(pid, sig):
        raise AssertionError(f"os.kill({pid}, {sig}) called: liveness must never signal a pid")

    monkeypatch.setattr(os, "kill", refuse)


def test_liveness_is_the_writers_lock_not_a_pid_in_a_name(tmp_path, no_kill):
    # A ring named after this (live) process but whose writer is gone: recoverable.
    dead = dead_ring(tmp_path, os.getpid())
    # A live writer in a file named after a pid that does not exist: left alone.
    live = RingWriter(str(tmp_path / "ring_999999999.obsring"), SMALL, pid=123, rank=0, world_size=1, meta={})
    try:
        rings = {r.path: r for r in find_rings(str(tmp_path))}
        assert rings[dead].alive is False and rings[dead].pid == os.getpid()
        assert rings[live.path].alive is True and rings[live.path].pid == 123  # the header's pid, not the name's
        result = recover(str(tmp_path))
        assert len(result.made) == 1 and result.alive == [live.path] and not result.problems
        assert os.path.exists(live.path) and os.path.exists(dead + ".recovered")
    finally:
        live.close(remove=True)


def test_a_killed_writer_releases_its_lock(tmp_path, no_kill):
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {ROOT!r})
        from recorder.layout import DEFAULT_CAPACITY, Kind
        from recorder.ring import RingWriter
        w = RingWriter({str(tmp_path / "ring_1.obsring")!r}, DEFAULT_CAPACITY, pid=os.getpid(), rank=0,
                       world_size=1, meta={{}})
        w.appender("step")(Kind.STEP_BEGIN, 0, 0, 5, 0, 0)
        print("up", flush=True)
        sys.stdin.readline()
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    with subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True) as child:
        try:
            assert child.stdout.readline() == "up\n"
            (ring,) = find_rings(str(tmp_path))
            assert ring.alive and ring.pid == child.pid
            assert recover_rings(str(tmp_path)) == []  # alive: left alone
            child.stdin.write("go\n")
            child.stdin.flush()
            assert child.wait(timeout=60) == -9
        finally:
            child.kill()
    (bundle,) = recover_rings(str(tmp_path))  # the pid in the name (1, init) is irrelevant
    assert load_bundle(bundle).info.step == 5


def test_one_bad_ring_does_not_stop_the_others(tmp_path):
    rdr = tmp_path / "rank_0" / "rdr"
    good_a, good_b = dead_ring(rdr, 11), dead_ring(rdr, 33)
    bad = rdr / "ring_22.obsring"
    bad.write_bytes(Path(good_a).read_bytes()[:6000])
    result = recover(str(tmp_path))
    assert len(result.made) == 2 and [type(e) for e in result.problems] == [DamagedFileError]
    assert result.problems[0].path == str(bad) and "truncated at byte 6000" in str(result.problems[0])
    assert os.path.exists(good_a + ".recovered") and os.path.exists(good_b + ".recovered") and bad.exists()
    with pytest.raises(DamagedFileError):
        recover_rings(str(tmp_path))  # the old API raises, after recovering what it can (nothing left here)
    cli = obs_cli("rdr", "recover", str(tmp_path))
    assert cli.returncode == 1 and str(bad) in cli.stderr and "Traceback" not in cli.stderr


def test_one_bad_manifest_does_not_stop_ls(tmp_path):
    rdr = tmp_path / "rank_0" / "rdr"
    good = write_bundle(str(rdr), "good", {"schema_version": 1, "reason": "SIGTERM", "created_ns": 2}, {},
                        fsync=False)
    bad = write_bundle(str(rdr), "bad", {"schema_version": 1, "reason": "hang", "created_ns": 1}, {}, fsync=False)
    with open(os.path.join(bad, "manifest.json"), "w") as fh:
        fh.write('{"schema_version": 1, "reason": ')
    dead_ring(rdr, 44)
    (rdr / "ring_55.obsring").write_bytes(b"OBSRING\x01")
    listing = list_bundles(str(tmp_path))
    assert [b.path for b in listing.bundles] == [good] and len(listing.rings) == 1
    assert sorted(e.path for e in listing.damaged) == [os.path.join(bad, "manifest.json"),
                                                       str(rdr / "ring_55.obsring")]
    cli = obs_cli("rdr", "ls", str(tmp_path))
    assert cli.returncode == 1 and "SIGTERM" in cli.stdout and "obs rdr recover" in cli.stdout
    assert os.path.join(bad, "manifest.json") in cli.stderr and "ring_55.obsring" in cli.stderr
    data = json.loads(obs_cli("rdr", "ls", str(tmp_path), "--json").stdout)
    assert len(data["damaged"]) == 2 and len(data["bundles"]) == 1


def test_a_symlinked_fatal_file_is_not_copied(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("the password is hunter2\n")
    rdr = tmp_path / "rdr"
    ring = dead_ring(rdr, 66)
    os.symlink(secret, rdr / "fatal_66.txt")
    result = recover(str(rdr))
    (bundle,) = result.made
    assert [type(e) for e in result.problems] == [UnsafePathError] and "symlink" in str(result.problems[0])
    for root, _dirs, files in os.walk(bundle):
        for name in files:
            assert "hunter2" not in Path(root, name).read_text()
    assert load_bundle(bundle).manifest["fault"]["fatal_stacks_refused"]
    assert os.path.islink(rdr / "fatal_66.txt") and os.path.exists(ring + ".recovered")


def test_a_symlinked_ring_is_refused(tmp_path):
    elsewhere = dead_ring(tmp_path / "elsewhere", 77)
    rdr = tmp_path / "rdr"
    rdr.mkdir()
    os.symlink(elsewhere, rdr / "ring_77.obsring")
    result = recover(str(rdr))
    assert not result.made and [type(e) for e in result.problems] == [UnsafePathError]
    assert os.path.exists(elsewhere)


@pytest.fixture(name="shared")
def _shared(tmp_path):
    """A folder anyone can write to, like /tmp (sticky, world-writable)."""
    folder = tmp_path / "shared"
    folder.mkdir()
    os.chmod(folder, 0o1777)
    return folder


def test_a_symlinked_rank_folder_in_a_shared_folder_is_refused(tmp_path, shared):
    victim = tmp_path / "victim"
    victim.mkdir()
    os.symlink(victim, shared / "rank_0")
    with pytest.raises(UnsafePathError, match="refusing to follow the symlink"):
        RingWriter(str(shared / "rank_0" / "rdr" / "ring_1.obsring"), SMALL, pid=1, rank=0, world_size=1, meta={})
    with pytest.raises(UnsafePathError):
        write_bundle(str(shared / "rank_0" / "rdr"), "b", {"schema_version": 1}, {})
    with pytest.raises(UnsafePathError):
        write_json_atomic(str(shared / "rank_0" / "rdr" / "marker.json"), {"state": "x"})
    assert os.listdir(victim) == []


def test_writers_create_private_folders(shared):
    writer = RingWriter(str(shared / "run" / "rank_0" / "rdr" / "ring_1.obsring"), SMALL, pid=1, rank=0,
                        world_size=1, meta={})
    writer.close(remove=True)
    for folder in (shared / "run", shared / "run" / "rank_0", shared / "run" / "rank_0" / "rdr"):
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700, folder


def test_the_marker_never_writes_through_a_planted_name(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    rdr = tmp_path / "rdr"
    rdr.mkdir()
    for pid_name in (f"marker.json.tmp-{os.getpid()}", f".marker.json.tmp-{os.getpid()}"):
        os.symlink(victim, rdr / pid_name)  # the old predictable temp name, O_TRUNC without O_EXCL
    os.link(victim, rdr / "marker.json")  # a hard link planted as the marker itself
    write_json_atomic(str(rdr / "marker.json"), {"state": "running"})
    assert victim.read_text() == "keep"
    assert json.loads((rdr / "marker.json").read_text()) == {"state": "running"}
    assert stat.S_IMODE(os.stat(rdr / "marker.json").st_mode) == 0o600
    leftovers = sorted(n for n in os.listdir(rdr) if "tmp" in n)
    assert leftovers == sorted([f"marker.json.tmp-{os.getpid()}", f".marker.json.tmp-{os.getpid()}"])


def test_a_ring_never_opens_a_planted_hard_link(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    os.link(victim, tmp_path / "ring_1.obsring")
    with pytest.raises(FileExistsError):
        RingWriter(str(tmp_path / "ring_1.obsring"), SMALL, pid=1, rank=0, world_size=1, meta={})
    assert victim.read_text() == "keep"


def test_a_bundle_never_writes_into_a_planted_folder(tmp_path):
    rdr = tmp_path / "rdr"
    first = write_bundle(str(rdr), "b", {"schema_version": 1}, {"a.txt": "1"}, fsync=False)
    tmp_names = [n for n in os.listdir(rdr) if n.startswith(".tmp-")]
    assert not tmp_names and os.path.basename(first) == "b"
    second = write_bundle(str(rdr), "b", {"schema_version": 1}, {"a.txt": "2"}, fsync=False)
    assert second.endswith("b-2") and Path(first, "a.txt").read_text() == "1"


def test_the_ring_size_is_bounded():
    assert check_capacity({}) == check_capacity(DEFAULT_CAPACITY) < 32 << 20
    with pytest.raises(ObsConfigError) as caught:
        check_capacity({"blob": 16777216})
    message = str(caught.value)
    assert caught.value.option == "capacity.blob" and "capacity.blob=16777216" in message
    assert "32.0 GiB" in message and "1.0 GiB" in message
    assert check_capacity({"op": (MAX_RING_BYTES - check_capacity({"op": 1})) // 56}) <= MAX_RING_BYTES
    for bad in ({"op": 0}, {"op": -3}, {"op": 1.5}, {"op": True}, {"nope": 4}):
        with pytest.raises(ObsConfigError, match=r"capacity\."):
            check_capacity(bad)


def test_an_oversized_ring_is_refused_before_any_file(tmp_path):
    with pytest.raises(ObsConfigError, match=r"capacity\.blob"):
        RingWriter(str(tmp_path / "r.obsring"), {**DEFAULT_CAPACITY, "blob": 16777216}, pid=1, rank=0,
                   world_size=1, meta={})
    assert os.listdir(tmp_path) == []


def test_a_ring_larger_than_the_free_space_is_a_clear_error(tmp_path):
    """On a real 8 MiB file system (tmpfs in a private mount namespace), a 14 MiB ring is refused."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs unshare and root to mount a small file system")
    mount = tmp_path / "small"
    mount.mkdir()
    script = (f"import sys; sys.path.insert(0, {ROOT!r}); from recorder.ring import RingWriter; "
              "from recorder.layout import DEFAULT_CAPACITY; "
              f"RingWriter({str(mount / 'rdr' / 'ring_1.obsring')!r}, DEFAULT_CAPACITY, pid=1, rank=0, world_size=1, "
              "meta={})")
    result = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=8m tmpfs {mount} && "
                             f"{sys.executable} -c \"{script}\"; ls -A {mount}/rdr"],
                            capture_output=True, text=True, timeout=120)
    if "mount:" in result.stderr or "unshare:" in result.stderr:
        pytest.skip(f"cannot mount here: {result.stderr.strip()}")
    assert "not enough free disk space for the ring file" in result.stderr, result.stderr
    assert "it needs" in result.stderr and "MiB) free" in result.stderr
    assert result.stdout.strip() == ""  # no partial ring left behind
