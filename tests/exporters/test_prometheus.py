"""A real Prometheus (Debian's ``prometheus`` package) and one 2-rank torchrun job (metrics_script.py: rank 1 sleeps
0.2 s in its data loading at every step), shared by every test here through one module-scoped fixture:

- Prometheus is told no target: it finds both ranks through the file service-discovery folder the exporters write
  under the profiler's output (``prometheus_sd``), and its queries return both ranks' step time and loss;
- every query of the Grafana dashboard in docs/ answers for both ranks (the training-health monitor is on, for its
  panels), and obs's alerting rules load and evaluate;
- once the ranks stop training (and idle, still served), ``obs top --prometheus`` names rank 1 as the straggler,
  slow in its data loading, as the ring-based ``obs top`` does, and both JSON documents agree on rank, step and
  slow phase;
- a rank that ends removes its target file.

Skipped where no ``prometheus`` binary is installed (``.ci/run`` installs it).  Every process the test starts
(Prometheus, torchrun and its workers) is killed in ``finally``.  Its cost is the job's (two ranks' torch start-up
and a few seconds of training): the Prometheus checks add no process that imports torch.
"""

from __future__ import annotations

import contextlib
import io
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
from types import SimpleNamespace

import pytest

from obs.cli import main
from recorder.live import read_job
from tests.recorder._jobs import free_port, kill_leftovers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "metrics_script.py")
DASHBOARD = os.path.join(ROOT, "docs", "grafana-dashboard.json")
RULES = os.path.join(ROOT, "docs", "prometheus", "obs-rules.yml")
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


def api(web: int, path: str, **params: str) -> dict:
    url = f"http://127.0.0.1:{web}/api/v1/{path}" + ("?" + urllib.parse.urlencode(params) if params else "")
    try:
        reply = json.loads(urllib.request.urlopen(url, timeout=5).read())
    except OSError:
        return {}  # Prometheus not up yet
    return reply.get("data", {}) if reply.get("status") == "success" else {}


def query(web: int, expr: str) -> list[dict]:
    return api(web, "query", query=expr).get("result", [])


def by_rank(results: list[dict], label: str = "ml_rank") -> dict[str, float]:
    return {r["metric"].get(label, "?"): float(r["value"][1]) for r in results}


def dashboard_queries() -> dict[str, str]:
    """Each panel's PromQL (title and target), its variables set to every job, rank and scalar."""
    with open(DASHBOARD) as fh:
        panels = json.load(fh)["panels"]
    values = {"$job": ".*", "$rank": ".*", "$scalar": ".*", "$__rate_interval": "5s"}
    out = {}
    for panel in panels:
        for target in panel["targets"]:
            expr = target["expr"]
            for name, value in values.items():
                expr = expr.replace(name, value)
            out[f"{panel['title']} / {target['refId']}"] = expr
    return out


def stop(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def cli_json(*argv: str) -> tuple[int, dict]:
    with contextlib.redirect_stdout(io.StringIO()) as out:
        code = main(list(argv))
    return code, json.loads(out.getvalue()) if code == 0 else {}


def poll(deadline_s: float, check, job: subprocess.Popen):
    """``check()`` until it returns something true, the deadline passes or the job ends; its last answer."""
    deadline = time.monotonic() + deadline_s
    found = check()
    while not found and time.monotonic() < deadline and job.poll() is None:
        time.sleep(0.3)
        found = check()
    return found


@pytest.fixture(scope="module")
def seen(tmp_path_factory):
    """The job, run once: what Prometheus held while it trained, both ``obs top`` documents while it idled after
    training, and what was left once it ended."""
    tmp_path = tmp_path_factory.mktemp("prometheus")
    base, web = two_free_ports(), free_port()
    profile, rdr = tmp_path / "profile", tmp_path / "rdr"
    (tmp_path / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n"
        f"rule_files: ['{RULES}']\n"
        "scrape_configs:\n  - job_name: obs\n    file_sd_configs:\n"
        f"      - files: ['{profile}/prometheus_sd/*.json']\n        refresh_interval: 1s\n")
    pids, stop_file, config = tmp_path / "pids", tmp_path / "stop", tmp_path / "obs.json"
    pids.mkdir()
    config.write_text(json.dumps({"profiler": {"enable": True, "output": str(profile), "batch_size": 16,
                                               "tokens_per_step": 128},
                                  "rdr": {"enable": True, "path": str(rdr)},
                                  "monitor": {"enable": True, "path": str(tmp_path / "monitor")}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TORCHELASTIC", "SLURM_", "MS_RDR"))}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1", OTEL_METRICS_EXPORTER="prometheus",
               OTEL_EXPORTER_PROMETHEUS_HOST="127.0.0.1", OTEL_EXPORTER_PROMETHEUS_PORT=str(base))
    out = SimpleNamespace(base=base, web=web, url=f"http://127.0.0.1:{web}", steps={}, loss={}, collectives={},
                          info={}, panels={}, busy={}, targets=[], sd_files={}, ring={}, prom={}, table="", rules=[],
                          steady={}, left=None)
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

            def training() -> bool:  # every series and panel answers for both ranks while they train
                out.steps = by_rank(query(web, "obs_step_duration_seconds_count"))
                out.loss = by_rank(query(web, 'obs_scalar{name="loss"}'))
                if not (set(out.steps) == set(out.loss) == {"0", "1"} and min(out.steps.values()) >= 6):
                    return False
                out.collectives = by_rank(query(web, "obs_step_collectives_duration_seconds_sum"))
                out.info = {r["metric"]["ml_rank"]: r["metric"] for r in query(web, "target_info")}
                out.busy = by_rank(query(web, "obs:step_busy_seconds:rate5m"), "rank")
                out.panels = {name: by_rank(query(web, expr)) for name, expr in dashboard_queries().items()}
                return all(set(found) == {"0", "1"} for found in out.panels.values()) and len(out.busy) == 2

            poll(60, training, job)
            out.targets = api(web, "targets").get("activeTargets", [])
            out.sd_files = {p.name: json.loads(p.read_text()) for p in (profile / "prometheus_sd").glob("*.json")}
            stop_file.touch()

            def steady() -> bool:  # the ranks idle after their last step, and Prometheus scraped it
                if not all((tmp_path / f"held_{r}").exists() for r in (0, 1)):
                    return False
                ring = {r.rank: r.step for r in read_job(str(rdr)).ranks}
                out.steady = {"ring": ring, "prometheus": by_rank(query(web, "obs_step"), "rank")}
                return len(ring) == 2 and out.steady["prometheus"] == {str(k): float(v) for k, v in ring.items()}

            if poll(30, steady, job):
                out.ring = cli_json("top", str(rdr), "--once", "--json")
                out.prom = cli_json("top", "--prometheus", out.url, "--once", "--json")
                with contextlib.redirect_stdout(io.StringIO()) as table:
                    main(["top", "--prometheus", out.url, "--once"])
                out.table = table.getvalue()
                out.rules = [rule for group in api(web, "rules").get("groups", []) for rule in group["rules"]]
            (tmp_path / "release").touch()
            out.output, _ = job.communicate(timeout=60)
        out.code = job.returncode
        out.left = sorted(p.name for p in (profile / "prometheus_sd").glob("*.json"))
        out.log = (tmp_path / "prometheus.log").read_text()
    finally:
        stop(job)
        kill_leftovers(pids, "metrics_script.py")
        if prometheus is not None and prometheus.poll() is None:
            prometheus.terminate()
            try:
                prometheus.wait(10)
            except subprocess.TimeoutExpired:
                stop(prometheus)
    return out


def test_prometheus_finds_both_ranks_through_the_file_sd_folder_and_scrapes_their_step_time_and_loss(seen):
    assert seen.code == 0, seen.output[-3000:]
    assert set(seen.steps) == {"0", "1"} and min(seen.steps.values()) >= 6, (seen.steps, seen.log[-2000:])
    assert set(seen.loss) == {"0", "1"} and all(v > 0 for v in seen.loss.values())
    assert set(seen.collectives) == {"0", "1"} and all(v > 0 for v in seen.collectives.values())
    assert set(seen.info) == {"0", "1"}
    for rank, labels in seen.info.items():
        assert labels["ml_world_size"] == "2" and labels["ml_job_id"] == "job-77" and labels["ml_run_id"] == "job-77"
        assert labels["instance"] == f"127.0.0.1:{seen.base + int(rank)}"  # each rank on the port + its local rank
        assert labels["run_id"] == "job-77" and labels["rank"] == rank and labels["local_rank"] == rank
    # Prometheus was given the folder only: each target came from a rank's file, with its labels
    assert sorted(t["labels"]["instance"] for t in seen.targets) == [f"127.0.0.1:{seen.base}",
                                                                      f"127.0.0.1:{seen.base + 1}"]
    assert all(t["discoveredLabels"]["__meta_filepath"].endswith(".json") for t in seen.targets)
    entries = sorted((entry for entries in seen.sd_files.values() for entry in entries), key=lambda e: e["targets"])
    assert [(e["targets"], e["labels"]["rank"], e["labels"]["run_id"]) for e in entries] == [
        ([f"127.0.0.1:{seen.base}"], "0", "job-77"), ([f"127.0.0.1:{seen.base + 1}"], "1", "job-77")]
    assert all(e["labels"]["node"] == socket.gethostname() for e in entries)


def test_a_rank_that_ends_removes_its_target_file(seen):
    assert seen.code == 0, seen.output[-3000:]
    assert len(seen.sd_files) == 2 and seen.left == []


def test_every_dashboard_panel_answers_for_both_ranks(seen):
    with open(DASHBOARD) as fh:
        titles = {p["title"] for p in json.load(fh)["panels"]}
    assert {"Step time per rank (heatmap)", "Ranks behind"} <= titles
    empty = {name: found for name, found in seen.panels.items() if set(found) != {"0", "1"}}
    assert seen.panels and not empty, empty


def test_the_alerting_rules_load_and_evaluate_on_the_job(seen):
    assert seen.rules, seen.log[-2000:]
    unhealthy = {r["name"]: r.get("lastError") for r in seen.rules if r["health"] != "ok"}
    assert not unhealthy
    assert {r["name"] for r in seen.rules if r["type"] == "alerting"} == {
        "ObsRankHung", "ObsStraggler", "ObsThroughputDown", "ObsExporterDown", "ObsNonFinite", "ObsMemoryClimbing",
        "ObsMonitorAnomaly"}
    assert set(seen.busy) == {"0", "1"} and seen.busy["1"] > seen.busy["0"] + 0.1  # rank 1 busy 0.2 s more


def test_obs_top_from_prometheus_names_the_slow_rank_and_phase_as_the_rings_do(seen):
    assert seen.ring and seen.prom, (seen.steady, seen.output[-2000:])
    (ring_code, ring), (prom_code, prom) = seen.ring, seen.prom
    assert ring_code == prom_code == 0
    assert prom["run_id"] == "job-77" and prom["runs"] == ["job-77"] and prom["queries"] < 12
    for doc in (ring, prom):
        assert [r["rank"] for r in doc["ranks"]] == [0, 1] and doc["waited_for"] == [1], doc
        assert doc["ranks"][1]["straggler"] and doc["ranks"][1]["late_phase"] == "data"
        assert not doc["ranks"][0]["straggler"]
    for mine, theirs in zip(prom["ranks"], ring["ranks"]):
        assert (mine["rank"], mine["step"], mine["straggler"], mine["late_phase"]) == \
            (theirs["rank"], theirs["step"], theirs["straggler"], theirs["late_phase"])
        assert mine["alive"] and not mine["stuck"] and mine["host"] == theirs["host"] and mine["behind"] == 0
        assert mine["memory_used_bytes"]["cpu"] > 2**20 and mine["steps_per_s"] > 1
    slow = prom["ranks"][1]
    assert slow["lateness_s"] == pytest.approx(0.2, abs=0.08) and slow["phase_excess_s"]["data"] > 0.1
    assert "the others wait for rank 1" in seen.table and "in data" in seen.table
