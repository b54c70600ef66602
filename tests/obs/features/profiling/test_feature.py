"""The profiler through the public API and the CLI: settings and their errors, a session's life, hot reload,
obs run, obs trace export, and the in-process fallback (obs demo's: tests/obs/cli/test_cli.py)."""

from __future__ import annotations

import json
import logging
import os
import pathlib
import subprocess
import sys
import time

import pytest

import obs
from obs import profiling
from obs.cli import main
from tests.exporters.receiver import Receiver
from tests.training import train

ROOT = str(pathlib.Path(__file__).resolve().parents[4])  # the repository
SCRIPT = os.path.join(ROOT, "tests", "exporters", "train_script.py")




@pytest.mark.parametrize("kwargs, words", [
    ({"profiling_options": "training_trace:task_trac"}, ["'profiling_options'", "task_trace", "task_trac"]),
    ({"profiling_options": '{"output": "relative/dir"}'}, ["'profiling_options.output'", "absolute", "relative/dir"]),
    ({"profiling_options": '{"op_trace": "yes"}'}, ["'profiling_options.op_trace'", "'on' or 'off'", "yes"]),
    ({"profiling_options": 3}, ["profiling_options", "str"]),
    ({"enable_profiling": "yes"}, ["enable_profiling"]),
])
def test_bad_context_values_are_rejected_naming_key_expectation_and_value(kwargs, words):
    with pytest.raises((ValueError, TypeError)) as info:
        obs.set_context(**kwargs)
    assert all(w in str(info.value) for w in words), str(info.value)
    assert profiling.session() is None


def test_bad_profiler_section_lists_every_problem(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"profiler": {"enable": True, "steps": "1-x", "span_budget": 2, "protocol": "udp",
                                             "endpoint": "collector:4317", "optin": "x"}}))
    with pytest.raises(ValueError) as info:
        obs.set_context(env_config_path=str(path))
    text = str(info.value)
    for word in ("profiler.steps", "profiler.span_budget", "profiler.protocol", "profiler.endpoint",
                 'did you mean "options"'):
        assert word in text
    assert profiling.session() is None


def test_a_session_records_and_its_exporter_writes_the_files_when_it_ends(tmp_path):
    out = tmp_path / "prof"
    obs.set_context(enable_profiling=True, profiling_options=json.dumps({"output": str(out), "task_trace": "on"}))
    live = profiling.session()
    assert live is not None and os.path.exists(live.ring_path)
    from obs.runtime.torch import adapter

    assert adapter.installed["phases"] and adapter.installed["modules"]
    train(6)
    obs.reset_context()
    status = profiling.last_status()
    assert status is not None and status["done"] and status["steps"] == 6 and status["dropped"] == {}
    assert not os.path.exists(live.ring_path)
    assert sorted(os.listdir(out / "rank_0")) == sorted(["trace.json", "traces.otlp.jsonl",
                                                         f"status_{os.getpid()}.json"])
    assert status["summary"]["steps"] == 6 and {p["name"] for p in status["summary"]["phases"]} == {
        "data", "forward", "backward", "optimizer"}
    assert not adapter.installed["phases"]
    written = [p for kind, p in obs._core.outputs.written() if kind == "trace"]
    assert str(out / "rank_0" / "trace.json") in written


def test_without_a_subprocess_the_exporter_runs_on_a_thread_and_says_so_once(tmp_path, monkeypatch, caplog):
    import obs.features.profiling.profile_session as ps

    def refuse(*args, **kwargs):
        raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(ps.subprocess, "Popen", refuse)
    monkeypatch.setattr(ps, "_fallback_said", False)
    with caplog.at_level(logging.WARNING, logger="obs"):
        for n in (1, 2):
            obs.set_context(enable_profiling=True, profiling_options=json.dumps({"output": str(tmp_path / str(n))}))
            train(3)
            obs.reset_context()
            assert profiling.last_status()["steps"] == 3
    said = [r for r in caplog.records if "no exporter process" in r.getMessage()]
    assert len(said) == 1 and "GIL" in said[0].getMessage()


@pytest.mark.slow
def test_hot_reload_turns_profiling_off_and_on_at_step_boundaries(tmp_path):
    config = tmp_path / "obs.json"
    config.write_text(json.dumps({"profiler": {"enable": True}}))
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}, "PYTHONPATH": ROOT}
    proc = subprocess.Popen([sys.executable, SCRIPT, json.dumps({"steps": 16, "config": str(config), "pause_at": 5})],
                            cwd=tmp_path, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "paused 5"
        config.write_text(json.dumps({"profiler": {"enable": False}}))
        time.sleep(1.5)  # the watcher stages it; the end of step 5 applies it
        proc.stdin.write("\n")
        proc.stdin.flush()
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    from exporters.trace_reader import read_folder

    steps = sorted(s.attributes["ml.step"] for f in read_folder(str(tmp_path / "obs_profile")).files
                   for s in f.spans if s.kind == "step")
    assert steps == [1, 2, 3, 4, 5]


def test_hot_reload_turns_profiling_on_and_changes_levels(tmp_path):
    config = tmp_path / "obs.json"
    config.write_text(json.dumps({"profiler": {"enable": False}}))
    obs.set_context(env_config_path=str(config))
    from obs.features.env_config import feature as env_feature

    train(2)
    assert profiling.session() is None
    config.write_text(json.dumps({"profiler": {"enable": True, "output": str(tmp_path / "p"),
                                               "options": "training_trace:task_trace"}}))
    assert env_feature.wait_staged(lambda cfg: cfg.values["profiler"]["enable"], 10) is not None
    train(1)  # the boundary before its step applies the reload: this step is recorded
    live = profiling.session()
    assert live is not None and live.request.levels == ("training_trace", "task_trace")
    train(3)
    obs.reset_context()
    from exporters.trace_reader import read_folder

    spans = [s for f in read_folder(str(tmp_path / "p")).files for s in f.spans]
    assert sum(s.kind == "step" for s in spans) == 4 and any(s.kind == "module" for s in spans)


@pytest.mark.slow
def test_obs_run_prints_the_summary_and_obs_trace_export_resends_the_files(tmp_path):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}, "PYTHONPATH": ROOT}
    script = tmp_path / "train.py"
    script.write_text("import json, runpy, sys\nsys.argv = ['x', json.dumps({'steps': 8})]\n"
                      f"runpy.run_path({SCRIPT!r}, run_name='__main__')\n")
    out = subprocess.run([sys.executable, "-m", "obs", "run", "--set", "enable_profiling=true", str(script)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert "obs: profile" in out.stderr and "8 steps" in out.stderr and "ui.perfetto.dev" in out.stderr
    assert "wrote trace" in out.stderr
    receiver = Receiver()
    url = receiver.start_http()
    try:
        assert main(["trace", "export", str(tmp_path / "obs_profile"), "--endpoint", url]) == 0
    finally:
        receiver.stop()
    spans = receiver.spans()
    assert sum(s["name"] == "step" for s in spans) == 8 and spans[0]["resource"]["ml.rank"] == 0
