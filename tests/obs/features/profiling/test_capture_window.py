"""Capture windows: the env config's ``profiler.window`` (hot-reloaded) and ``obs trace capture`` against a running
job give module (and op) spans for exactly the window's steps, in the session in force; the always-on level's bytes
per step; the validation of windows and capture requests."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import threading

import pytest
import torch

import obs
from obs import profiling
from obs._core.errors import ObsConfigError
from obs._core.events import Event, bus
from obs.cli import main
from obs.features.profiling.window import Windows, deeper
from obs.settings.profiler_options import CaptureWindow, capture_params, parse_window
from recorder.requests import make_request
from tests.obs.features.profiling.traces import steps_with_spans

ROOT = str(pathlib.Path(__file__).resolve().parents[4])  # the repository
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "capture_script.py")


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _write(path, section) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"profiler": section}))
    os.replace(tmp, path)  # as editors save: the watcher sees one complete file


# -- the done-when: a window edited into the env config mid-run ----------------------------------------------------

def test_a_window_edited_into_the_env_config_mid_run_gives_module_spans_for_exactly_those_steps(tmp_path):
    from obs.features.env_config import feature as env_feature

    config, out = tmp_path / "obs.json", tmp_path / "prof"
    _write(config, {"enable": True, "output": str(out)})
    obs.set_context(env_config_path=str(config))
    session = profiling.session()
    assert session is not None and session.detail is None
    model, opt = _model()
    subscribed = {}
    for step, x in enumerate(obs.steps([torch.randn(4, 8) for _ in range(12)]), start=1):
        subscribed[step] = bus.has_subscribers(Event.MODULE_ENTER)
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        if step == 3:
            _write(config, {"enable": True, "output": str(out), "window": {"start": 6, "steps": 3}})
            assert env_feature.wait_staged(lambda cfg: cfg.values["profiler"]["window"], 10) is not None
    assert profiling.session() is session  # the same session throughout: no restart, no second exporter
    obs.reset_context()
    assert [s for s, on in subscribed.items() if on] == [6, 7, 8]  # no module event published outside the window
    found = steps_with_spans(out)
    assert found["step"] == set(range(1, 13))
    assert found["module"] == {6, 7, 8}
    assert [n for n in os.listdir(out / "rank_0") if n.startswith("status_")] == [f"status_{os.getpid()}.json"]


def test_an_op_trace_window_installs_the_op_interceptor_only_for_its_steps(tmp_path):
    from obs.runtime.torch import adapter

    out = tmp_path / "prof"
    config = tmp_path / "obs.json"
    _write(config, {"enable": True, "output": str(out), "window": {"start": 3, "steps": 2, "level": "op_trace"}})
    obs.set_context(env_config_path=str(config))
    model, opt = _model()
    ops_installed = {}
    for step, x in enumerate(obs.steps([torch.randn(4, 8) for _ in range(6)]), start=1):
        ops_installed[step] = adapter.installed["ops"]
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    obs.reset_context()
    assert [s for s, on in ops_installed.items() if on] == [3, 4]
    found = steps_with_spans(out)
    assert found["module"] == {3, 4} and found["op"] == {3, 4}


def test_the_always_on_level_writes_at_most_2_kib_per_step_in_each_trace_file(tmp_path):
    out = tmp_path / "prof"
    obs.set_context(enable_profiling=True, profiling_options=json.dumps({"output": str(out)}))
    model, opt = _model()
    steps = 60
    for x in obs.steps([torch.randn(4, 8) for _ in range(steps)]):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    obs.reset_context()
    sizes = {name: os.path.getsize(out / "rank_0" / name) for name in ("trace.json", "traces.otlp.jsonl")}
    per_step = {name: size / steps for name, size in sizes.items()}
    print("bytes per step at training_trace:", per_step)
    assert all(b <= 2048 for b in per_step.values()), per_step


# -- obs trace capture against a running process ----------------------------------------------------------------

def test_obs_trace_capture_reaches_a_running_job_with_the_rdr_on(tmp_path, capsys):
    out, rdr = tmp_path / "prof", tmp_path / "rdr"
    config = tmp_path / "obs.json"
    config.write_text(json.dumps({"rdr": {"enable": True, "path": str(rdr)},
                                  "profiler": {"enable": True, "output": str(out)}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MS_", "OBS_", "OTEL_")) or
           k.startswith("OBS_NATIVE")}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, SCRIPT, str(config)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        capsys.readouterr()
        status = main(["trace", "capture", str(out), "--steps", "3", "--json"])
        answer = json.loads(capsys.readouterr().out)
        (tmp_path / "stop").write_text("")
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert status == 0 and answer["complete"], answer
    (row,) = answer["ranks"]
    first, last = row["steps"]
    assert last - first == 2 and first > 2
    found = steps_with_spans(out)
    assert found["module"] == {first, first + 1, first + 2}
    assert not os.path.exists(out / "requests")  # the CLI removed its request, its answers and the folder


def test_obs_trace_capture_says_when_no_profiler_runs_under_the_path(tmp_path, capsys):
    (tmp_path / "rank_0").mkdir()
    assert main(["trace", "capture", str(tmp_path), "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert "no running profiler" in err and "is the profiler on?" in err


def test_obs_trace_capture_rejects_a_bad_step_count(tmp_path, capsys):
    assert main(["trace", "capture", str(tmp_path), "--steps", "0"]) == 2
    err = capsys.readouterr().err
    assert "--steps/--level.steps" in err and "[1, 100000]" in err and "(got 0)" in err


# -- validation ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("window, words", [
    ({"start": 0, "steps": 5}, ["'profiler.window.start'", ">= 1", "got 0"]),
    ({"start": 5}, ["'profiler.window'", '"steps"']),
    ({"start": 5, "steps": 0}, ["'profiler.window.steps'", "[1, 100000]", "got 0"]),
    ({"start": 5, "steps": 2, "level": "task_trac"}, ["'profiler.window.level'", "task_trace, op_trace",
                                                      "did you mean"]),
    ({"start": 5, "steps": 2, "levle": "op_trace"}, ["'profiler.window'", "start, steps and level", "levle"]),
    ({"start": "5", "steps": 2}, ["'profiler.window.start'", "step number", '"5"']),
    ([5, 2], ["'profiler.window'", "an object", "[5, 2]"]),
])
def test_a_bad_window_in_the_env_config_names_the_key_the_expectation_and_the_value(tmp_path, window, words):
    config = tmp_path / "obs.json"
    _write(config, {"enable": True, "output": str(tmp_path / "p"), "window": window})
    with pytest.raises((ValueError, TypeError)) as info:
        obs.set_context(env_config_path=str(config))
    assert all(w in str(info.value) for w in words), str(info.value)
    assert profiling.session() is None


def test_windows_parse_and_empty_means_none():
    assert parse_window({}, "w") is None and parse_window(None, "w") is None
    assert parse_window({"start": 20, "steps": 5}, "w") == CaptureWindow(20, 5, "task_trace")
    assert parse_window({"start": 1, "steps": 1, "level": "op_trace"}, "w").last == 1


@pytest.mark.parametrize("params, words", [
    ({}, ['"steps"']),
    ({"steps": True}, ["capture.steps", "True"]),
    ({"steps": 2, "level": "training_trace"}, ["capture.level", "task_trace, op_trace", "training_trace"]),
    ({"steps": 2, "stpes": 3}, ["capture", "steps and level", "stpes"]),
])
def test_capture_params_are_checked_and_a_bad_request_is_answered_with_the_error(params, words):
    with pytest.raises((ValueError, TypeError)) as info:
        capture_params(params, "capture")
    assert all(w in str(info.value) for w in words), str(info.value)
    answer = Windows().handle(make_request("capture", asked_by="cli", params=params), step=4, wait_s=0.01)
    assert all(w in answer["error"] for w in words), answer


def test_windows_overlap_to_the_deeper_level_and_captures_begin_at_the_next_boundary():
    windows = Windows(CaptureWindow(5, 3, "task_trace"))
    assert [windows.level(s) for s in (4, 5, 7, 8)] == [None, "task_trace", "task_trace", None]
    windows.ask(2, "op_trace")
    windows.place(6)
    assert [windows.level(s) for s in (5, 6, 7, 8, 9)] == ["task_trace", "op_trace", "op_trace", None, None]
    assert windows.captures == []  # over: forgotten
    assert deeper(None, "task_trace") == "task_trace" and deeper("op_trace", "task_trace") == "op_trace"
    windows.configure(None)
    assert windows.level(6) is None


def test_a_capture_answer_says_queued_without_a_boundary_and_an_error_once_the_session_ends():
    windows = Windows()
    request = make_request("capture", asked_by="cli", params={"steps": 4})
    answers = []  # on a thread of its own, as on the request watcher's: it must answer before any boundary comes
    asker = threading.Thread(target=lambda: answers.append(windows.handle(request, step=9, wait_s=0.05)), daemon=True)
    asker.start()
    asker.join(60)  # a guard, not a timing: a handle that waited for a boundary would still be waiting here
    assert not asker.is_alive(), "no answer without a step boundary"
    (answer,) = answers
    assert answer["queued"] and answer["after_step"] == 9 and answer["count"] == 4
    windows.place(10)  # the queued one begins at the boundary, though its answer went out
    assert windows.level(10) == "task_trace" and windows.level(13) == "task_trace" and windows.level(14) is None
    windows.close()
    assert "ended" in windows.handle(request, step=9, wait_s=5)["error"]


def test_the_window_is_left_out_of_the_request_comparison():
    from obs.settings.profiler_options import request

    section = {"enable": True, "output": "/x", "endpoint": "", "protocol": "", "steps": "", "span_budget": 50,
               "module_depth": 3, "max_file_mb": 100, "window": {}}
    origins = {"enable": "file"}
    a = request({}, section, origins, environ={})
    b = request({}, {**section, "window": {"start": 2, "steps": 1, "level": "task_trace"}}, origins, environ={})
    assert a == b and a is not None and b is not None and a.window is None
    assert b.window == CaptureWindow(2, 1)
    with pytest.raises(ObsConfigError):
        request({}, {**section, "window": {"start": -1, "steps": 1}}, origins, environ={})
