"""The recorder's files over a run's life, in real subprocesses: a full disk keeps the ring, a clean run
leaves nothing behind, ranks started by mp.spawn end up in their own folders."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from recorder.bundle_reader import list_bundles, load_bundle
from recorder.recover import recover_rings

SCRIPT = os.path.join(os.path.dirname(__file__), "lifecycle_script.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(SCRIPT)))


def run(scenario, *args, cwd, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MS_RDR", "OBS_", "RANK", "WORLD_SIZE"))}
    return subprocess.run([sys.executable, SCRIPT, scenario, *map(str, args)], capture_output=True, text=True,
                          timeout=240, cwd=cwd, env={**env, "PYTHONPATH": ROOT, **extra})


def tree(path):
    return sorted(os.path.relpath(os.path.join(d, n), path) for d, ds, fs in os.walk(path) for n in ds + fs)


def test_a_dump_that_fails_on_a_full_disk_keeps_the_ring_and_says_why(tmp_path):
    result = run("disk_full", tmp_path, cwd=tmp_path)
    assert result.returncode == 1 and "boom in forward" in result.stderr
    rdr = tmp_path / "rank_0" / "rdr"
    listing = list_bundles(str(tmp_path))
    assert not listing.bundles and len(listing.rings) == 1  # the evidence is still there
    marker = json.loads((rdr / "marker.json").read_text())
    assert marker["state"] == "dump_failed" and "File too large" in marker["failed"]
    assert marker["failed"].startswith("module_error:") and marker["ring"] == os.path.basename(listing.rings[0].path)
    assert not [n for n in os.listdir(rdr) if n.startswith(".")]  # no half bundle
    (path,) = recover_rings(str(tmp_path))  # recover retries, with room on the disk now
    b = load_bundle(path)
    assert b.manifest["step"] == 21 and b.manifest["recovered"]
    assert [e["fault"] for e in b.events({"fault"})] == ["module_error"]


def test_a_clean_run_with_nothing_to_report_leaves_nothing_in_the_current_folder(tmp_path):
    result = run("clean", cwd=tmp_path, MS_RDR_ENABLE="1")  # no rdr.path: the current folder
    assert result.returncode == 0 and "DONE" in result.stdout, result.stderr
    assert tree(tmp_path) == []


def test_a_crash_leaves_its_bundle_and_marker_in_the_current_folder(tmp_path):
    result = run("crash", cwd=tmp_path, MS_RDR_ENABLE="1")
    assert result.returncode == 1
    (info,) = list_bundles(str(tmp_path)).bundles
    assert info.reason == "module_error" and info.path.startswith(str(tmp_path / "rank_0" / "rdr"))
    marker = json.loads((tmp_path / "rank_0" / "rdr" / "marker.json").read_text())
    assert marker["state"] == "exited" and marker["dumped"] is True
    assert not list_bundles(str(tmp_path)).rings  # its bundle is on disk: the ring went


@pytest.mark.slow
def test_ranks_started_by_mp_spawn_before_init_process_group_get_their_own_folders(tmp_path):
    result = run("spawn", tmp_path, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    reported = {json.loads(line)["rank"]: json.loads(line)["bundle"] for line in result.stdout.splitlines()}
    assert sorted(reported) == [0, 1]
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("rank_")) == ["rank_0", "rank_1"]
    markers = {}
    for r in (0, 1):
        rdr = tmp_path / f"rank_{r}" / "rdr"
        (info,) = list_bundles(str(tmp_path / f"rank_{r}")).bundles
        assert info.path == reported[r] and os.path.dirname(info.path) == str(rdr)
        manifest = load_bundle(info.path).manifest
        assert (manifest["rank"], manifest["world_size"], manifest["step"]) == (r, 2, 3)
        markers[r] = json.loads((rdr / "marker.json").read_text())
        assert (markers[r]["rank"], markers[r]["world_size"], markers[r]["dumped"]) == (r, 2, True)
        assert not list_bundles(str(tmp_path / f"rank_{r}")).rings
    assert markers[0]["pid"] != markers[1]["pid"]  # one marker each: neither overwrote the other
