"""An exporter that outlives its backend: the OTLP receiver goes down for 15 s in the middle of a real run and
comes back on the same port.  Training keeps its pace, export resumes on its own, and what was lost is counted."""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time

import pytest

from tests.exporters.receiver import Receiver

pytestmark = pytest.mark.slow

SCRIPT = os.path.join(os.path.dirname(__file__), "train_script.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The SDK gives up on a batch after its retries (1 + 2 + 4 s of backoff within its 10 s timeout): 15 s of outage
# fail two batches in a row, and a third is retried across the backend's return.
OUTAGE_S = 15.0
STEPS, SLEEP_MS = 56, 500  # 28 s of training: ~4 s before the outage, 15 s of it, the rest after


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _steps(receiver):
    return sorted({s["attributes"]["ml.step"] for s in receiver.spans() if s["name"] == "step"})


def test_a_backend_down_for_15_s_costs_spans_not_steps_and_export_resumes(tmp_path):
    port = _free_port()
    first, second = Receiver(), Receiver()
    url = first.start_http(port)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(PYTHONPATH=ROOT, OTEL_EXPORTER_OTLP_ENDPOINT=url, OTEL_BSP_SCHEDULE_DELAY="200")
    args = {"steps": STEPS, "sleep_ms": SLEEP_MS, "times": True, "context": {"enable_profiling": True}}
    proc = subprocess.Popen([sys.executable, SCRIPT, json.dumps(args)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not [n for n in _steps(first) if n >= 5]:  # the backend takes the first steps
            assert proc.poll() is None and time.monotonic() < deadline, "no step reached the receiver"
            time.sleep(0.2)
        first.stop()
        down_at = max(_steps(first))
        time.sleep(OUTAGE_S)
        second.start_http(port)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        first.stop()
        second.stop()
    assert proc.returncode == 0, err
    took = json.loads(out.split("times ", 1)[1].splitlines()[0])
    assert len(took) == STEPS
    # Training never waited for the backend: an exporter on the training thread would have stalled a step for
    # each export timeout (10 s); the bound is loose so that a loaded machine does not fail it.
    assert max(took) < 10 * statistics.median(took), took
    after = _steps(second)
    assert after and after[-1] == STEPS, "export did not resume with the backend"
    status = json.loads(next((tmp_path / "obs_profile" / "rank_0").glob("status_*.json")).read_text())
    spans_per_step = status["spans"] // STEPS
    assert sum(status["dropped"].values()) > 0 and status["exported"] + sum(status["dropped"].values()) == \
        status["spans"]
    # what arrived is what the exporter says it exported; the steps between are the ones lost in the outage
    assert status["exported"] == len(first.spans()) + len(second.spans())
    lost = set(range(1, STEPS + 1)) - set(_steps(first)) - set(after)
    assert lost and min(lost) > down_at - 1 and max(lost) < after[-1]
    assert sum(status["dropped"].values()) >= len(lost) * spans_per_step - spans_per_step
    assert "obs profiler dropped" in err
