"""The recorder takes the rank torch.distributed gives, whatever it started with: at the next step boundary, or
before a bundle; marker, ring header and manifest agree (torch.distributed faked: its answers patched in)."""

from __future__ import annotations

import json
import os
import socket
from types import SimpleNamespace

import pytest

import obs
from obs.runtime import job
from obs.settings import parallel
from recorder.bundle_reader import load_bundle
from recorder.ring_reader import read_ring


@pytest.fixture
def distributed(monkeypatch):
    """Call with (rank, world size): torch.distributed is up from then on, and its store holds the run id ``job``
    another rank proposed."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(job, "_agreed", [])  # a run id an earlier test's job agreed on stays for the process

    def up(rank, world):
        store = SimpleNamespace(compare_set=lambda key, expected, desired: b"job")
        dist = SimpleNamespace(get_rank=lambda: rank, get_world_size=lambda: world,
                               distributed_c10d=SimpleNamespace(_get_default_store=lambda: store))
        monkeypatch.setattr(parallel, "distributed", lambda: dist)
    return up


def enable(tmp_path):
    path = tmp_path / "obs.json"
    path.write_text(json.dumps({"rdr": {"enable": True, "path": str(tmp_path / "out")}}))
    obs.set_context(env_config_path=str(path))
    return obs.rdr.recorder()


def agree(live, folder, rank, world):
    marker = json.loads((folder / "marker.json").read_text())
    header = read_ring(live.ring.buffer()).header
    assert (marker["rank"], marker["world_size"], marker["host"]) == (rank, world, socket.gethostname())
    assert (header.rank, header.world_size) == (rank, world) and live.dir == str(folder)


def test_a_plain_process_rank_0_of_1_takes_the_world_size_of_init_process_group(tmp_path, distributed):
    live = enable(tmp_path)  # Lightning's rank 0: nothing in its environment says there are other ranks yet
    folder = tmp_path / "out" / "rank_0" / "rdr"
    agree(live, folder, 0, 1)
    distributed(0, 2)
    with obs.step():
        pass
    agree(live, folder, 0, 2)
    manifest = load_bundle(obs.rdr.dump("manual")).manifest
    assert (manifest["rank"], manifest["world_size"], manifest["run_id"]) == (0, 2, "job")


def test_a_rank_started_with_local_rank_and_no_rank_waits_unresolved_then_moves_before_its_bundle(
        tmp_path, distributed, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    live = enable(tmp_path)
    assert not live.rank_known
    assert sorted(os.listdir(tmp_path / "out")) == [".obs_made.json", f"rank_unresolved-{os.getpid()}"]
    distributed(1, 2)
    path = live.dump("exception")  # a fault before any step boundary: the bundle still goes under its rank
    folder = tmp_path / "out" / "rank_1" / "rdr"
    assert os.path.dirname(path) == str(folder) and load_bundle(path).manifest["rank"] == 1
    agree(live, folder, 1, 2)
    assert sorted(os.listdir(tmp_path / "out")) == [".obs_made.json", "rank_1"]


def test_a_guessed_rank_0_that_is_rank_1_moves_and_leaves_rank_0s_marker(tmp_path, distributed):
    live = enable(tmp_path)
    other = tmp_path / "out" / "rank_0" / "rdr" / "marker.json"
    other.write_text(json.dumps({"state": "running", "pid": 1, "rank": 0}))  # the real rank 0 wrote its marker
    distributed(1, 2)
    with obs.step():
        pass
    agree(live, tmp_path / "out" / "rank_1" / "rdr", 1, 2)
    assert json.loads(other.read_text())["pid"] == 1
    obs.reset_context()  # a clean end: rank 1's folder goes, rank 0's stays
    assert sorted(os.listdir(tmp_path / "out")) == [".obs_made.json", "rank_0"]
