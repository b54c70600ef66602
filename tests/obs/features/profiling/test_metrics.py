"""The profiler's metrics through the public API: their settings and the standard variables, with clear errors;
``obs.scalar`` (a no-op while metrics are off); a session whose exporter process serves Prometheus."""

from __future__ import annotations

import json
import re
import socket
import time
import urllib.request

import pytest
import torch

import obs
from obs import profiling
from obs._core.events import Event, bus
from obs.settings.profiler_options import metrics_exporters, prometheus_address, request
from tests.recorder._jobs import free_port
from tests.training import train

DEFAULTS = {"enable": True, "options": "training_trace", "output": "", "endpoint": "", "protocol": "", "steps": "",
            "span_budget": 50, "module_depth": 3, "max_file_mb": 100, "metrics": "", "prometheus_host": "",
            "prometheus_port": 0, "batch_size": 0, "tokens_per_step": 0}


def resolve(environ, **section):
    values = {**DEFAULTS, **section}
    origins = {key: "file" if key in section or key == "enable" else "default" for key in values}
    return request({}, values, origins, environ)


def test_metrics_are_off_unless_asked_for_and_the_standard_variables_fill_what_the_settings_leave_empty():
    assert resolve({}).metrics == ()
    asked = resolve({"OTEL_METRICS_EXPORTER": "prometheus", "OTEL_EXPORTER_PROMETHEUS_HOST": "0.0.0.0",
                     "OTEL_EXPORTER_PROMETHEUS_PORT": "9500", "LOCAL_RANK": "3"})
    assert asked.metrics == ("prometheus",) and asked.prometheus == ("0.0.0.0", 9503)
    assert resolve({}, metrics="prometheus").prometheus == ("localhost", 9464)
    mine = resolve({"OTEL_METRICS_EXPORTER": "otlp", "OTEL_EXPORTER_PROMETHEUS_PORT": "9500", "LOCAL_RANK": "1"},
                   metrics="otlp,prometheus", prometheus_host="10.0.0.2", prometheus_port=9600, batch_size=8)
    assert mine.metrics == ("otlp", "prometheus") and mine.prometheus == ("10.0.0.2", 9601) and mine.batch_size == 8
    assert resolve({"OTEL_METRICS_EXPORTER": "prometheus"}, metrics="off").metrics == ()
    assert metrics_exporters("", {"OTEL_METRICS_EXPORTER": "none"}) == ()
    assert metrics_exporters("", {"OTEL_METRICS_EXPORTER": " Prometheus , otlp "}) == ("otlp", "prometheus")


@pytest.mark.parametrize("environ, words", [
    ({"OTEL_METRICS_EXPORTER": "prometheus,consol"}, ["OTEL_METRICS_EXPORTER", "otlp, prometheus, none",
                                                      "'prometheus,consol'", "profiler.metrics"]),
    ({"OTEL_METRICS_EXPORTER": "prometheus", "OTEL_EXPORTER_PROMETHEUS_PORT": "http"},
     ["OTEL_EXPORTER_PROMETHEUS_PORT", "integer", "'http'"]),
    ({"OTEL_METRICS_EXPORTER": "prometheus", "OTEL_EXPORTER_PROMETHEUS_PORT": "70000"},
     ["OTEL_EXPORTER_PROMETHEUS_PORT", "[1, 65535]", "70000"]),
    ({"OTEL_METRICS_EXPORTER": "prometheus", "OTEL_EXPORTER_PROMETHEUS_PORT": "65535", "LOCAL_RANK": "1"},
     ["65535 + LOCAL_RANK 1", "profiler.prometheus_port"]),
])
def test_a_bad_standard_variable_is_an_error_naming_it(environ, words):
    with pytest.raises(obs.ObsConfigError) as info:
        resolve(environ)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_a_bad_variable_fails_set_context_and_turns_nothing_on(monkeypatch):
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "prometheous")
    with pytest.raises(obs.ObsConfigError, match="OTEL_METRICS_EXPORTER"):
        obs.set_context(enable_profiling=True)
    assert profiling.session() is None


def test_bad_metrics_keys_in_the_profiler_section_are_listed_together(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"profiler": {"enable": True, "metrics": "prometeus", "prometheus_port": 70000,
                                             "prometheus_host": "a b", "batch_size": -1, "tokens_per_step": "4k"}}))
    with pytest.raises(ValueError) as info:
        obs.set_context(env_config_path=str(path))
    text = str(info.value)
    for word in ("profiler.metrics", 'did you mean "prometheus"', "profiler.prometheus_port", "[0, 65535]",
                 "profiler.prometheus_host", "profiler.batch_size", ">= 0", "profiler.tokens_per_step"):
        assert word in text, text
    assert prometheus_address("", 0, {}) == ("localhost", 9464)


def test_obs_scalar_costs_nothing_and_checks_nothing_while_metrics_are_off(tmp_path):
    obs.scalar("loss", 1.0)
    obs.scalar("loss", "not a number")  # no session: not even looked at
    obs.set_context(enable_profiling=True, profiling_options=json.dumps({"output": str(tmp_path)}))
    assert profiling.session().scalars is None
    obs.scalar("loss", torch.ones(3))


def train_reporting_scalars(steps, pause_s=0.0):
    """``steps`` steps that report their loss and number through ``obs.scalar``, each held ``pause_s`` more."""
    def scalars(n, loss):
        obs.scalar("loss", loss)
        obs.scalar("step_number", n)
        time.sleep(pause_s)

    return train(steps, seed=0, loss=lambda out: out.pow(2).mean(), after=scalars)


def test_a_session_serves_its_steps_and_scalars_to_prometheus_while_training(tmp_path):
    port = free_port()
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"profiler": {"enable": True, "output": str(tmp_path / "prof"),
                                               "metrics": "prometheus", "prometheus_host": "127.0.0.1",
                                               "prometheus_port": port, "batch_size": 4}}))
    obs.set_context(env_config_path=str(config))
    live = profiling.session()
    assert live is not None and live.request.prometheus == ("127.0.0.1", port)
    with pytest.raises(ValueError, match="one element"):
        obs.scalar("loss", torch.ones(2))
    last = train_reporting_scalars(12, pause_s=0.02)
    bus.emit(Event.FAULT, "nan_inf", "Linear.forward", None)  # what the NaN check emits for a finding
    text, deadline = "", time.monotonic() + 20
    while time.monotonic() < deadline:  # the exporter process finishes the last step once it has settled
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
        except OSError:
            text = ""
        if re.search(r'^obs_step_duration_seconds_count\{[^}]*\} 12\.0$', text, re.M) and \
                re.search(r'^obs_nonfinite_findings_total\{[^}]*\} 1\.0$', text, re.M):
            break
        time.sleep(0.1)
    targets = list((tmp_path / "prof" / "prometheus_sd").glob("*.json"))
    announced = json.loads(targets[0].read_text()) if targets else None
    obs.reset_context()
    assert announced is not None and announced[0]["targets"] == [f"127.0.0.1:{port}"], announced
    labels = announced[0]["labels"]
    assert (labels["rank"], labels["local_rank"], labels["node"]) == ("0", "0", socket.gethostname())
    assert labels["run_id"]
    assert list((tmp_path / "prof" / "prometheus_sd").glob("*.json")) == []  # the session ended: its target went
    assert re.search(r'^obs_step\{[^}]*\} 12\.0$', text, re.M)
    ended = re.search(r'^obs_step_end_time_seconds\{[^}]*\} (\S+)$', text, re.M)
    began = re.search(r'^obs_start_time_seconds\{[^}]*\} (\S+)$', text, re.M)
    assert ended and began and time.time() - 60 < float(began.group(1)) < float(ended.group(1)) <= time.time()
    assert re.search(r'^obs_nonfinite_findings_total\{[^}]*\} 1\.0$', text, re.M), text[-2000:]
    loss = re.search(r'^obs_scalar\{[^}]*name="loss"[^}]*\} (\S+)$', text, re.M)
    assert loss is not None and float(loss.group(1)) == pytest.approx(last, rel=1e-6), text[-2000:]
    assert re.search(r'^obs_scalar\{[^}]*name="step_number"[^}]*\} 12\.0$', text, re.M)
    assert re.search(r'^obs_memory_peak_bytes\{device="cpu",ml_rank="0"[^}]*\} [1-9]', text, re.M)
    assert re.search(r'^obs_samples_per_second\{[^}]*\} [1-9]', text, re.M)
    status = profiling.last_status()
    assert status["metrics"] == {"exporters": ["prometheus"], "prometheus": f"127.0.0.1:{port}", "steps": 12,
                                 "scalars": 24}
    assert status["steps"] == 12 and status["dropped"] == {}


def test_on_the_thread_fallback_the_endpoint_lives_in_the_trainer_and_goes_with_the_session(tmp_path, monkeypatch):
    import obs.features.profiling.profile_session as ps

    def refuse(*args, **kwargs):
        raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(ps.subprocess, "Popen", refuse)
    monkeypatch.setattr(ps, "_fallback_said", True)
    port = free_port()
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"profiler": {"enable": True, "output": str(tmp_path / "prof"),
                                               "metrics": "prometheus", "prometheus_host": "127.0.0.1",
                                               "prometheus_port": port}}))
    obs.set_context(env_config_path=str(config))
    train_reporting_scalars(3)
    text = ""
    for _ in range(100):
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
        except OSError:
            text = ""
        if 'name="loss"' in text:
            break
        time.sleep(0.1)
    obs.reset_context()
    assert 'name="loss"' in text and profiling.last_status()["metrics"]["steps"] == 3
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
