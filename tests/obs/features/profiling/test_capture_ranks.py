"""``obs trace capture`` against a running 2-rank torchrun job (gloo, CPU) under ``obs run``, the profiler at its
always-on level: every rank answers, and each rank's trace has module spans for exactly the 3 steps it answered."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

from obs.cli import main
from tests.obs.features.profiling.traces import steps_with_spans
from tests.recorder._jobs import finish, free_port

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "capture_ranks_script.py")
ROOT = str(pathlib.Path(__file__).resolve().parents[4])  # the repository


@pytest.mark.slow
def test_obs_trace_capture_reaches_every_rank_of_a_torchrun_job_and_each_traces_exactly_its_steps(tmp_path, capsys):
    out, pids = tmp_path / "prof", tmp_path / "pids"
    pids.mkdir()
    config = tmp_path / "obs.json"
    config.write_text(json.dumps({"profiler": {"enable": True, "output": str(out)}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MS_", "OBS_", "OTEL_")) or
           k.startswith("OBS_NATIVE")}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    env.pop("TORCHELASTIC_RUN_ID", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "--monitor-interval", "0.2", "-m", "obs", "run", "--config", str(config), SCRIPT, str(tmp_path)]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    answer, status = None, None
    try:
        deadline = time.monotonic() + 90
        while not all((tmp_path / f"ready_{r}").exists() for r in (0, 1)):
            assert proc.poll() is None, "the job ended before both ranks reached step 2"
            assert time.monotonic() < deadline, "the ranks never reached step 2"
            time.sleep(0.05)
        capsys.readouterr()
        status = main(["trace", "capture", str(out), "--steps", "3", "--level", "task_trace", "--json"])
        answer = json.loads(capsys.readouterr().out)
    finally:
        (tmp_path / "stop").write_text("")
        code, output = finish(proc, pids, SCRIPT, timeout=90)
    assert code == 0, output
    assert status == 0 and answer["complete"], answer
    rows = {row["rank"]: row for row in answer["ranks"]}
    assert sorted(rows) == [0, 1], answer
    for rank, row in rows.items():
        first, last = row["steps"]
        assert last - first == 2 and first > 2, row
        found = steps_with_spans(out / f"rank_{rank}")
        assert found["module"] == {first, first + 1, first + 2}, (rank, row, found.get("module"))
        assert max(found["step"]) > last and {1, 2} <= found["step"]  # steps before and after: spans, no modules
