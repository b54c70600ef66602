"""Two real ranks (gloo): each dumps into its own rank_{r} folder, and the collectives show who waited on whom."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from recorder.bundle_reader import list_bundles, load_bundle

SCRIPT = os.path.join(os.path.dirname(__file__), "ranks_script.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(SCRIPT)))


def run_ranks(tmp_path, scenario):
    config = tmp_path / "obs.json"
    config.write_text(json.dumps({"rdr": {"enable": True, "path": str(tmp_path / "rdr")}}))
    env = {**os.environ, "PYTHONPATH": ROOT}
    procs = [subprocess.Popen([sys.executable, SCRIPT, str(r), "2", str(tmp_path / "store"), str(config), scenario],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for r in range(2)]
    outs = [p.communicate(timeout=180) for p in procs]
    return [p.returncode for p in procs], outs


def bundles(tmp_path, rank):
    return list_bundles(str(tmp_path / "rdr" / f"rank_{rank}")).bundles


def stuck_collectives(bundle):
    events = bundle.events({"collective"})
    done = {e["group_seq"] for e in events if e["state"] == "completed"}
    return [e for e in events if e["group_seq"] not in done], len(done)


@pytest.mark.slow
def test_a_stalled_peer_makes_both_ranks_dump_a_hang(tmp_path):
    codes, outs = run_ranks(tmp_path, "stalls")
    assert codes == [0, 0], outs
    # a rank whose peer's watchdog fired first dumped for it (peer_hang) before its own watchdog fired
    (waiting,) = [b for b in bundles(tmp_path, 0) if b.reason == "hang"]
    (stalled,) = [b for b in bundles(tmp_path, 1) if b.reason == "hang"]
    assert {b.reason for b in bundles(tmp_path, 0) + bundles(tmp_path, 1)} <= {"hang", "peer_hang"}
    assert (waiting.reason, waiting.rank, waiting.step) == ("hang", 0, 3)
    assert (stalled.reason, stalled.rank, stalled.step) == ("hang", 1, 3)
    b0 = load_bundle(waiting.path)
    stuck, done = stuck_collectives(b0)
    assert [(e["state"], e["group_seq"]) for e in stuck] == [("started", 9)] and done == 8  # 4 params x 2 steps
    assert "all_reduce" in stuck[0]["desc"] and b0.manifest["world_size"] == 2
    assert any("all_reduce" in f["code"] for f in next(s for s in b0.stacks if s["main"])["frames"])
    b1 = load_bundle(stalled.path)
    assert stuck_collectives(b1) == ([], 8)  # rank 1 never reached its 9th collective
    assert next(s for s in b1.stacks if s["main"])["frames"][-1]["function"] == "load_batch"


def test_a_dead_peer_fails_the_collective_of_the_other_rank(tmp_path):
    codes, outs = run_ranks(tmp_path, "dies")
    assert codes[1] == 1 and "lost its data loader" in outs[1][1] and codes[0] != 0
    (dead,) = bundles(tmp_path, 1)
    assert (dead.reason, dead.rank, dead.step) == ("exception", 1, 3)
    (survivor,) = bundles(tmp_path, 0)
    assert (survivor.reason, survivor.rank, survivor.step) == ("exception", 0, 3)
    stuck, done = stuck_collectives(load_bundle(survivor.path))
    assert [(e["state"], e["group_seq"]) for e in stuck] == [("started", 9), ("failed", 9)] and done == 8
    assert stuck[1].get("error") is True
