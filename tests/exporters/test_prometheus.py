"""A real Prometheus (Debian's ``prometheus`` package) scrapes the metrics endpoints of a 2-rank torchrun job while
it trains, and its query API returns the step-time and loss series of rank 0 and rank 1, and every query of the
Grafana dashboard in docs/ answers for both ranks.

Skipped where no ``prometheus`` binary is installed (``.ci/run`` installs it).  Every process the test starts
(Prometheus, torchrun and its workers) is killed in ``finally``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest

from tests.recorder._jobs import free_port, kill_leftovers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "metrics_script.py")
DASHBOARD = os.path.join(ROOT, "docs", "grafana-dashboard.json")
PROMETHEUS = next((p for p in ("/usr/bin/prometheus", shutil.which("prometheus")) if p and os.access(p, os.X_OK)),
                  None)

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(PROMETHEUS is None, reason="no prometheus binary (apt-get install prometheus)")]


def two_free_ports() -> int:
    """A port p with p + 1 free too (local ranks 0 and 1)."""
    for _ in range(50):
        base = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", base + 1))
            except OSError:
                continue
        return base
    raise RuntimeError("no two consecutive free ports")


def query(web: int, expr: str) -> list[dict]:
    url = f"http://127.0.0.1:{web}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        reply = json.loads(urllib.request.urlopen(url, timeout=2).read())
    except OSError:
        return []  # Prometheus not up yet
    return reply["data"]["result"] if reply.get("status") == "success" else []


def by_rank(results: list[dict]) -> dict[str, float]:
    return {r["metric"].get("ml_rank", "?"): float(r["value"][1]) for r in results}


def dashboard_queries() -> list[str]:
    """The dashboard's PromQL, its variables set to every job, rank and scalar."""
    with open(DASHBOARD) as fh:
        panels = json.load(fh)["panels"]
    values = {"$job": ".*", "$rank": ".*", "$scalar": ".*", "$__rate_interval": "5s"}
    out = []
    for panel in panels:
        for target in panel["targets"]:
            expr = target["expr"]
            for name, value in values.items():
                expr = expr.replace(name, value)
            out.append(expr)
    return out


def stop(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_prometheus_scrapes_step_time_and_loss_of_both_ranks_of_a_torchrun_job(tmp_path):
    base, web = two_free_ports(), free_port()
    (tmp_path / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
        "scrape_configs:\n  - job_name: obs\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{base}', '127.0.0.1:{base + 1}']\n")
    pids, stop_file, config = tmp_path / "pids", tmp_path / "stop", tmp_path / "obs.json"
    pids.mkdir()
    config.write_text(json.dumps({"profiler": {"enable": True, "batch_size": 16, "tokens_per_step": 128}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TORCHELASTIC", "SLURM_"))}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1", OTEL_METRICS_EXPORTER="prometheus",
               OTEL_EXPORTER_PROMETHEUS_HOST="127.0.0.1", OTEL_EXPORTER_PROMETHEUS_PORT=str(base))
    prometheus = job = None
    try:
        with open(tmp_path / "prometheus.log", "w") as log:
            prometheus = subprocess.Popen(
                [PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
                 f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{web}"],
                stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True)
            job = subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                 "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "job-77",
                 "--monitor-interval", "0.2", SCRIPT, str(stop_file), str(pids), str(config)],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path,
                start_new_session=True)
            steps = loss = collectives = info = {}
            panels: dict[str, dict[str, float]] = {}
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and job.poll() is None:
                steps = by_rank(query(web, "obs_step_duration_seconds_count"))
                loss = by_rank(query(web, 'obs_scalar{name="loss"}'))
                if set(steps) == set(loss) == {"0", "1"} and min(steps.values()) >= 3:
                    collectives = by_rank(query(web, "obs_step_collectives_duration_seconds_sum"))
                    info = {r["metric"]["ml_rank"]: r["metric"] for r in query(web, "target_info")}
                    panels = {expr: by_rank(query(web, expr)) for expr in dashboard_queries()}
                    if all(set(found) == {"0", "1"} for found in panels.values()):
                        break  # rates need two scrapes of a moving series: until then, ask again
                time.sleep(0.5)
            stop_file.touch()
            out, _ = job.communicate(timeout=30)
        assert job.returncode == 0, out[-3000:]
        log = (tmp_path / "prometheus.log").read_text()
        assert set(steps) == {"0", "1"} and min(steps.values()) >= 3, (steps, out[-2000:], log[-2000:])
        assert set(loss) == {"0", "1"} and all(v > 0 for v in loss.values())
        assert set(collectives) == {"0", "1"} and all(v > 0 for v in collectives.values())  # the stop all_reduce
        assert set(info) == {"0", "1"}
        for rank, labels in info.items():
            assert labels["ml_world_size"] == "2" and labels["ml_job_id"] == "job-77"
            assert labels["instance"] == f"127.0.0.1:{base + int(rank)}"  # each rank on the port + its local rank
        assert info["0"]["ml_run_id"] == info["1"]["ml_run_id"] == "job-77"
        empty = {expr: found for expr, found in panels.items() if set(found) != {"0", "1"}}
        assert panels and not empty, empty
    finally:
        stop(job)
        kill_leftovers(pids, "metrics_script.py")
        if prometheus is not None and prometheus.poll() is None:
            prometheus.terminate()
            try:
                prometheus.wait(10)
            except subprocess.TimeoutExpired:
                stop(prometheus)
