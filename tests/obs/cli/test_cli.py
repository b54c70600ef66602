"""The obs command: its views called in this process (``obs_cli``), and as a real process (``obs_process``) where
the process is the point: ``obs run``, ``obs demo``, ``python -m obs``, a closed pipe."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import textwrap
import traceback

import pytest

from obs.cli import main
from obs.settings.context_options import CONTEXT_OPTIONS


def obs_process(*args, cwd=None, env=None):
    """``python -m obs ARGS`` as a real process (output piped, so never wrapped)."""
    full_env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "120", **(env or {})}
    return subprocess.run([sys.executable, "-m", "obs", *args], capture_output=True, text=True, cwd=cwd,
                          env=full_env, timeout=300)


def obs_cli(*args, cwd=None, env=None):
    """``obs ARGS`` in this process: ``main()`` with stdout and stderr captured as a pipe would (off a terminal, so
    rich never wraps), ``cwd`` and ``env`` set for the call; returns what ``obs_process`` returns.  An exception that
    escapes ``main`` (``--traceback``) is shown and exits 1, as ``python -m obs`` does.  ``obs run`` and ``obs demo``
    start work that belongs in its own process (atexit handlers, settings): use ``obs_process``."""
    assert args[:1] not in (("run",), ("demo",)), "obs run / obs demo: use obs_process"
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        for name, value in {"NO_COLOR": "1", "COLUMNS": "120", **(env or {})}.items():
            patch.setenv(name, value)
        if cwd is not None:
            patch.chdir(cwd)
        try:
            code = main([str(a) for a in args])
        except SystemExit as exc:  # argparse: usage errors, --help, --version
            code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        except Exception:  # noqa: BLE001 - what python -m obs does with an exception that escapes main
            traceback.print_exc()
            code = 1
    return subprocess.CompletedProcess(["obs", *args], code, out.getvalue(), err.getvalue())


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


def test_config_check_lists_every_problem_in_json_words(tmp_path):
    path = tmp_path / "obs.json"
    path.write_text('{"rdr": {"enable": "yes", "mode": 3}, "sys": {"bogus": true}}')
    human = obs_cli("config", "check", str(path))
    assert human.returncode == 1
    assert f"{path} is invalid (3 problems)" in human.stderr
    assert "'rdr.enable' must be true or false (got \"yes\" of type string)" in human.stderr
    assert "'rdr.mode' must be one of [1, 2] (got 3)" in human.stderr and 'no key "bogus"' in human.stderr
    machine = obs_cli("config", "check", str(path), "--json")
    assert machine.returncode == 1
    assert [p["key"] for p in json.loads(machine.stdout)["problems"]] == ["rdr.enable", "rdr.mode", "sys.bogus"]


@pytest.mark.parametrize("args", [("config", "check", "/nonexistent/obs.json"), ("print", "/nonexistent/print.pb"),
                                  ("run", "/nonexistent/train.py")])
def test_a_missing_input_file_is_exit_2_for_every_command(args):
    result = (obs_process if args[0] == "run" else obs_cli)(*args)
    assert result.returncode == 2, result.stderr
    assert "/nonexistent/" in result.stderr and "Errno" not in result.stderr and "Traceback" not in result.stderr


def test_no_command_shows_the_commands_and_version_is_there():
    result = obs_cli()
    assert result.returncode == 0 and "options" in result.stdout and "rdr" in result.stdout
    assert "error" not in result.stderr
    version = obs_cli("--version")
    assert version.returncode == 0 and version.stdout.startswith("obs 0.")


@pytest.mark.parametrize("args", [("options", "--table", "context"), ("config", "check", "/nonexistent/obs.json"),
                                  ("rdr", "bogus")], ids=["output", "error", "usage"])
def test_in_this_process_a_view_writes_what_python_m_obs_writes(args):
    """What lets the tests of views call main() here (obs_cli) instead of starting python -m obs for each."""
    here, real = obs_cli(*args), obs_process(*args)
    assert (here.returncode, here.stdout, here.stderr) == (real.returncode, real.stdout, real.stderr)


def test_traceback_is_accepted_after_the_subcommand():
    result = obs_cli("config", "check", "/nonexistent/obs.json", "--traceback")
    assert result.returncode != 0 and "Traceback (most recent call last)" in result.stderr


def test_run_without_a_script_names_what_is_missing():
    result = obs_process("run")
    assert result.returncode == 2
    assert "a script to run is required" in result.stderr and "args" not in result.stderr.split("error:")[1]


def test_options_piped_is_one_plain_line_per_option():
    result = obs_cli("options", "--table", "context", env={"COLUMNS": "80"})
    assert result.returncode == 0
    lines = result.stdout.splitlines()
    assert lines[0].split("\t") == ["table", "name", "type", "default", "devices", "meaning"]
    assert len(lines) == 1 + len(CONTEXT_OPTIONS)
    row = next(line for line in lines if "\tmax_device_memory\t" in line).split("\t")
    assert row[:4] == ["context", "max_device_memory", "size str like '3.5GB' | float GB", "1024.0"]


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
    config.write_text(json.dumps({"rdr": {"enable": True, "path": str(tmp_path / "rdr")}}))
    result = obs_process("run", "--config", str(config), "--set", "save_graphs=2", str(script), "3", "--flag",
                         cwd=tmp_path)
    assert result.returncode == 3, result.stderr
    assert "argv ['3', '--flag']" in result.stdout
    assert "save_graphs 2" in result.stdout and "rdr True" in result.stdout


def test_run_reads_obs_config_from_the_environment(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    config = tmp_path / "obs.json"
    config.write_text(json.dumps({"rdr": {"enable": True, "path": str(tmp_path / "rdr")}}))
    result = obs_process("run", str(script), "0", env={"OBS_CONFIG": str(config)}, cwd=tmp_path)
    assert result.returncode == 0 and "rdr True" in result.stdout


def test_run_gives_the_script_an_absolute_file_as_python_does(tmp_path):
    (tmp_path / "show.py").write_text("print(__file__)\n")
    result = obs_process("run", "show.py", cwd=tmp_path)
    plain = subprocess.run([sys.executable, "show.py"], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == plain.stdout == f"{tmp_path / 'show.py'}\n"


def test_run_script_exception_exits_1_with_its_traceback_as_python_shows_it(tmp_path):
    script = tmp_path / "boom.py"
    script.write_text("def train():\n    raise RuntimeError('boom in training')\n\ntrain()\n")
    result = obs_process("run", str(script))
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    assert result.returncode == 1 and "RuntimeError: boom in training" in result.stderr
    assert result.stderr == plain.stderr  # from the script's first frame: no obs or runpy frames above it


def test_bad_setting_is_an_error_without_traceback(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    result = obs_process("run", "--set", "deterministic=on", str(script))
    assert result.returncode == 2
    assert "'deterministic' must be one of ['ON', 'OFF']" in result.stderr and "Traceback" not in result.stderr
    assert "Traceback" in obs_process("--traceback", "run", "--set", "deterministic=on", str(script)).stderr


def test_missing_script_is_exit_2():
    result = obs_process("run", "no_such_script.py")
    assert result.returncode == 2 and "does not exist" in result.stderr


@pytest.mark.slow
def test_demo_trains_and_reports(tmp_path):
    # With a setting the demo trains as before (eager); with none it compiles and writes ./obs_demo/ (test_demo.py).
    result = obs_process("demo", "--steps", "30", "--json", "--set", "mode=1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["steps"] == 30 and data["events"]["step_end"] == 30
    assert data["events"]["module_enter"] == 30 * 5 and data["device"] == "cpu"  # Sequential + 4 layers
    assert data["last_loss"] < data["first_loss"]


@pytest.fixture(scope="module", name="demo_with_settings")
def _demo_with_settings(tmp_path_factory):
    """``obs demo`` with settings, as a user reads it (human output): compiled (mode=0) and profiled, without the
    caller's OTEL_* (the trace goes to ./obs_profile); the folder it ran in and its result."""
    folder = tmp_path_factory.mktemp("demo")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(NO_COLOR="1", COLUMNS="120")
    result = subprocess.run([sys.executable, "-m", "obs", "demo", "--steps", "12", "--set", "mode=0", "--set",
                             "enable_profiling=true", "--set", "profiling_options=training_trace:task_trace"],
                            capture_output=True, text=True, cwd=folder, env=env, timeout=300)
    return folder, result


@pytest.mark.slow
def test_demo_human_output_names_the_next_command(demo_with_settings):
    _, result = demo_with_settings
    assert result.returncode == 0, result.stderr
    assert "obs demo" in result.stdout and "Next:" in result.stdout and "mode=0" in result.stdout


def test_obs_demo_with_profiling_says_where_the_trace_went(demo_with_settings):
    """(The profiler's, tests/obs/features/profiling/test_feature.py: here, to share the demo's run.)"""
    folder, result = demo_with_settings
    assert result.returncode == 0, result.stderr
    assert "12 steps" in result.stderr and "trace.json" in result.stderr
    assert (folder / "obs_profile" / "rank_0" / "trace.json").exists()


def test_a_closed_pipe_ends_rich_output_quietly(tmp_path):
    path = tmp_path / "obs.json"
    path.write_text(json.dumps({"rdr": {"enable": True, "path": str(tmp_path)}}))
    code = (f"import sys, os; r, w = os.pipe(); os.close(r); os.dup2(w, 1); from obs.cli import main; "
            f"sys.exit(main(['config', 'check', {str(path)!r}]))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stderr == ""


@pytest.fixture(scope="module", name="raised")
def _raised(tmp_path_factory):
    """``obs run`` with the recorder on and a print file, of a script that prints, ends a step and raises; the
    folder it ran in and its result."""
    folder = tmp_path_factory.mktemp("raised")
    config = folder / "obs.json"
    config.write_text(json.dumps({"rdr": {"enable": True, "path": str(folder / "rdr")}}))
    (folder / "boom.py").write_text("import obs\nobs.Print('hello')\nwith obs.step():\n    pass\n"
                                    "raise KeyError('missing shard 7')\n")
    return folder, obs_process("run", "--config", str(config), "--set", f"print_file_path={folder / 'p.pb'}",
                               "boom.py", cwd=folder)


def test_run_says_on_stderr_which_files_obs_wrote(raised):
    tmp_path, result = raised
    assert result.returncode == 1
    assert f"obs: wrote print file: {tmp_path / 'p.pb'}" in result.stderr
    bundle = next(line for line in result.stderr.splitlines() if line.startswith("obs: wrote RDR bundle: "))
    assert os.path.isfile(os.path.join(bundle.split(": ", 2)[2], "manifest.json"))
    assert f"obs: wrote RDR marker: {tmp_path / 'rdr' / 'rank_0' / 'rdr' / 'marker.json'}" in result.stderr


def test_obs_run_hands_uncaught_exceptions_to_the_recorder(raised):
    """(An ``obs rdr`` test, tests/obs/cli/test_rdr_cli.py: here, to share the run.)"""
    tmp_path, result = raised
    assert result.returncode == 1 and "KeyError: 'missing shard 7'" in result.stderr
    data = json.loads(obs_cli("rdr", "show", str(tmp_path / "rdr"), "--json").stdout)["manifest"]
    assert data["reason"] == "exception" and data["exception"]["type"] == "KeyError" and data["step"] == 1


def test_run_names_the_bundle_and_marker_of_a_recorder_started_by_the_environment(tmp_path):
    """MS_RDR_ENABLE=1 starts the recorder at ``import obs``, before ``obs run`` sets up what it says at exit."""
    (tmp_path / "ok.py").write_text("import obs\nwith obs.step():\n    pass\n")
    env = {"MS_RDR_ENABLE": "1", "MS_RDR_MODE": "2", "MS_RDR_PATH": str(tmp_path / "rdr")}
    result = obs_process("run", "ok.py", cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    folder = tmp_path / "rdr" / "rank_0" / "rdr"
    (bundle,) = [p for p in folder.iterdir() if p.name.endswith("_normal_end")]
    assert f"obs: wrote RDR bundle: {bundle}" in result.stderr
    assert f"obs: wrote RDR marker: {folder / 'marker.json'}" in result.stderr
