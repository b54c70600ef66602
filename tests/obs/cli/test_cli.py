"""The obs command, run as real subprocesses: options, config check, run, demo, python -m obs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from obs.settings.context_options import CONTEXT_OPTIONS


def obs_cli(*args, cwd=None, env=None):
    full_env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "120", **(env or {})}
    return subprocess.run([sys.executable, "-m", "obs", *args], capture_output=True, text=True, cwd=cwd,
                          env=full_env, timeout=300)


def test_options_json_lists_every_key_with_default():
    result = obs_cli("options", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert [row["name"] for row in data["context"]] == list(CONTEXT_OPTIONS)
    assert {"auto_parallel", "ps", "env_config.rdr", "env_config.sys"} <= set(data)
    mode = next(row for row in data["context"] if row["name"] == "mode")
    assert mode["default"] == 1 and "GRAPH_MODE" in mode["type"]


def test_options_table_renders():
    result = obs_cli("options", "--table", "context")
    assert result.returncode == 0
    assert "max_device_memory" in result.stdout and "Deprecated" in result.stdout


def test_config_check_valid_file(tmp_path):
    path = tmp_path / "obs.json"
    path.write_text(json.dumps({"rdr": {"enable": True, "mode": 2, "path": str(tmp_path)}}))
    result = obs_cli("config", "check", str(path), "--json")
    assert result.returncode == 0
    data = json.loads(result.stdout)
    assert data["valid"] and data["settings"]["rdr"]["mode"] == 2
    assert "Running Data Recorder ON" in data["turns_on"][0]
    human = obs_cli("config", "check", str(path))
    assert "Running Data Recorder ON" in human.stdout


def test_config_check_invalid_file_exits_1_without_traceback(tmp_path):
    path = tmp_path / "obs.json"
    path.write_text('{"rdr": {"path": "relative"}}')
    result = obs_cli("config", "check", str(path))
    assert result.returncode == 1
    assert "'rdr.path' must be an absolute path" in result.stderr and "Traceback" not in result.stderr


SCRIPT = textwrap.dedent("""
    import sys, obs
    print("argv", sys.argv[1:])
    print("save_graphs", obs.get_context("save_graphs"))
    print("rdr", obs.env_config()["rdr"]["enable"])
    sys.exit(int(sys.argv[1]))
""")


def test_run_applies_settings_and_preserves_exit_code(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    config = tmp_path / "obs.json"
    config.write_text('{"rdr": {"enable": true}}')
    result = obs_cli("run", "--config", str(config), "--set", "save_graphs=2", str(script), "3", "--flag")
    assert result.returncode == 3, result.stderr
    assert "argv ['3', '--flag']" in result.stdout
    assert "save_graphs 2" in result.stdout and "rdr True" in result.stdout


def test_run_reads_obs_config_from_the_environment(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    config = tmp_path / "obs.json"
    config.write_text('{"rdr": {"enable": true}}')
    result = obs_cli("run", str(script), "0", env={"OBS_CONFIG": str(config)})
    assert result.returncode == 0 and "rdr True" in result.stdout


def test_run_script_exception_exits_1_with_its_traceback(tmp_path):
    script = tmp_path / "boom.py"
    script.write_text("raise RuntimeError('boom in training')\n")
    result = obs_cli("run", str(script))
    assert result.returncode == 1 and "RuntimeError: boom in training" in result.stderr


def test_bad_setting_is_an_error_without_traceback(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    result = obs_cli("run", "--set", "deterministic=on", str(script))
    assert result.returncode == 2
    assert "'deterministic' must be one of ['ON', 'OFF']" in result.stderr and "Traceback" not in result.stderr
    assert "Traceback" in obs_cli("--traceback", "run", "--set", "deterministic=on", str(script)).stderr


def test_missing_script_is_exit_2():
    result = obs_cli("run", "no_such_script.py")
    assert result.returncode == 2 and "does not exist" in result.stderr


@pytest.mark.slow
def test_demo_trains_and_reports(tmp_path):
    result = obs_cli("demo", "--steps", "30", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["steps"] == 30 and data["events"]["step_end"] == 30
    assert data["events"]["module_enter"] == 30 * 5 and data["device"] == "cpu"  # Sequential + 4 layers
    assert data["last_loss"] < data["first_loss"]


@pytest.mark.slow
def test_demo_human_output_names_the_next_command(tmp_path):
    result = obs_cli("demo", "--steps", "3", "--set", "mode=0", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "obs demo" in result.stdout and "Next:" in result.stdout and "mode=0" in result.stdout
