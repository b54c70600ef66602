"""The job doctor on real gloo jobs under torchrun (doctor_script.py): `obs top` names the rank the others wait for
while the job runs, and `obs rdr analyze` names the straggler and the phase its time went to once it ended."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import time

import pytest

from obs.cli import main
from recorder.live import read_job
from tests.recorder._jobs import finish, free_port

pytestmark = pytest.mark.slow

SCRIPT = os.path.join(os.path.dirname(__file__), "doctor_script.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(SCRIPT)))




def _start(tmp_path, scenario, steps, ranks=3):
    config = tmp_path / "obs.json"
    config.write_text(json.dumps({"rdr": {"enable": True, "path": str(tmp_path / "rdr"), "mode": 2}}))
    pids = tmp_path / "pids"
    pids.mkdir()
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    env.pop("TORCHELASTIC_RUN_ID", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port",
           str(free_port()), "--monitor-interval", "0.2", SCRIPT, str(config), str(pids), scenario, str(steps)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)


def _finish(proc, pids, timeout=120):
    return finish(proc, pids, "doctor_script.py", timeout)


def _analyze(tmp_path, capsys):
    code = main(["rdr", "analyze", str(tmp_path / "rdr"), "--json"])
    return code, json.loads(capsys.readouterr().out)


def _wait_for_steps(proc, tmp_path, ranks, steps=6):
    """Until every rank of the running job has begun ``steps`` steps (a few collectives lined up), or it ended."""
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            job = read_job(str(tmp_path / "rdr"))
        except FileNotFoundError:
            job = None
        if job is not None and len(job.ranks) == ranks and min(r.step for r in job.ranks) >= steps:
            return
        time.sleep(0.2)


@pytest.fixture(scope="module")
def data_job(tmp_path_factory):
    """2 DDP ranks, the last one 0.2 s slow in its data loading at every step: ``obs top --once`` (JSON, then the
    table) while it runs, then the job's exit code and output, then ``obs rdr analyze --json`` once it ended."""
    tmp_path = tmp_path_factory.mktemp("data")
    root = str(tmp_path / "rdr")
    proc = _start(tmp_path, "ddp_data", 0, ranks=2)
    try:
        _wait_for_steps(proc, tmp_path, 2)
        with contextlib.redirect_stdout(io.StringIO()) as doc:
            assert main(["top", root, "--once", "--json"]) == 0
        with contextlib.redirect_stdout(io.StringIO()) as table:
            assert main(["top", root, "--once"]) == 0
    finally:
        (tmp_path / "stop").touch()
        code, out = _finish(proc, tmp_path / "pids")
    with contextlib.redirect_stdout(io.StringIO()) as result:
        analyzed = main(["rdr", "analyze", root, "--json"])
    return json.loads(doc.getvalue()), table.getvalue(), (code, out), (analyzed, json.loads(result.getvalue()))


def test_top_and_analyze_name_the_rank_slow_in_its_data_loading(data_job):
    doc, table, (code, out), (analyzed, result) = data_job
    assert code == 0, out
    slow = doc["ranks"][1]
    assert slow["straggler"] and slow["late_phase"] == "data" and slow["lateness_s"] > 0.01
    assert all(r["steps_per_s"] and r["steps_per_s"] < 6 for r in doc["ranks"])  # 0.2 s per step: under 5 steps/s
    assert re.search(r"the others wait for (rank \d: [^;]*; )*rank 1: [\d.]+ ms late per step", table), table

    assert analyzed == 0 and result["consistent"]  # a straggler slows the job, it does not break it
    assert result["culprits"] == []
    assert [(s["rank"], s["phase"]) for s in result["stragglers"]] == [(1, "data")]
    assert result["stragglers"][0]["phase_excess_s"] == pytest.approx(0.2, abs=0.05)
    assert "rank 1 is a straggler" in result["verdict"] and "data loading" in result["verdict"]


def test_analyze_names_the_ddp_rank_slow_in_backward_not_the_ranks_that_waited(tmp_path, capsys):
    proc = _start(tmp_path, "ddp", 12)
    code, out = _finish(proc, tmp_path / "pids")
    assert code == 0, out
    code, result = _analyze(tmp_path, capsys)
    assert code == 0 and result["culprits"] == [] and "rank 1 is a straggler" in result["verdict"], result["verdict"]
    assert [(s["rank"], s["phase"]) for s in result["stragglers"]] == [(1, "backward")]
    assert result["stragglers"][0]["phase_excess_s"] == pytest.approx(0.2, abs=0.05)
    # DDP equalised the step times: every rank's backward took as long; the lineup tells them apart
    lineup = {x["rank"]: x for x in result["lineup"]["ranks"]}
    assert lineup[0]["phases"]["backward"] < 0 and lineup[2]["phases"]["backward"] < 0
    assert not lineup[0]["straggler"] and not lineup[2]["straggler"]


def test_top_names_the_ddp_rank_slow_in_its_data_loading_while_it_runs(data_job):
    """Its peer waits for it in DDP's first bucket all_reduce, which the relay records as it is issued."""
    doc, _, (code, out), _ = data_job
    assert code == 0, out
    assert [r["rank"] for r in doc["ranks"]] == [0, 1] and all(r["alive"] for r in doc["ranks"])
    assert doc["waited_for"] == [1], doc
    slow = doc["ranks"][1]
    assert slow["straggler"] and slow["late_phase"] == "data" and not doc["ranks"][0]["straggler"]
