"""``obs demo`` as a new user meets it: progress on a terminal, steady-state step time, pasteable next
commands, and no file in the current folder unless asked for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from obs.cli._demo import WARMUP_STEPS, split_warmup

pytestmark = pytest.mark.slow


def demo(*args, cwd, env=None, stderr_tty=False):
    """Run ``obs demo ARGS`` in ``cwd``; with ``stderr_tty`` its stderr is a pseudo-terminal."""
    full_env = {**os.environ, "NO_COLOR": "1", **(env or {})}
    full_env.pop("COLUMNS", None)
    command = [sys.executable, "-m", "obs", "demo", *args]
    if not stderr_tty:
        return subprocess.run(command, capture_output=True, text=True, cwd=cwd, env={**full_env, **(env or {})},
                              timeout=300)
    master, slave = os.openpty()
    try:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=slave, cwd=cwd, env=full_env)
    finally:
        os.close(slave)
    chunks = []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed its end
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    stdout = proc.stdout.read().decode()
    proc.stdout.close()
    proc.wait(timeout=60)
    return subprocess.CompletedProcess(command, proc.returncode, stdout, b"".join(chunks).decode(errors="replace"))


def test_progress_bar_on_a_terminal_only(tmp_path):
    """Issue 9: obs demo was silent for 7-12 s."""
    on_tty = demo("--steps", "60", cwd=tmp_path, stderr_tty=True)
    assert on_tty.returncode == 0, on_tty.stderr
    assert "obs demo: training" in on_tty.stderr and "60/60" in on_tty.stderr
    assert "obs demo" in on_tty.stdout and "Traceback" not in on_tty.stderr
    piped = demo("--steps", "3", cwd=tmp_path)
    assert piped.returncode == 0, piped.stderr
    assert "training" not in piped.stderr and "\x1b" not in piped.stderr


def test_step_time_is_steady_state_and_the_first_steps_are_said_apart(tmp_path):
    """Issue 9: the median step mixed in compilation and warm-up (0.66-107 ms while steps took 0.6 ms)."""
    result = demo("--steps", "30", "--set", "mode=0", "--json", cwd=tmp_path)  # GRAPH_MODE: obs.compile
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    first, steady = data["first_steps_ms"], data["step_ms"]
    assert len(first) == WARMUP_STEPS and steady > 0
    assert first[0] > 5 * steady  # the first step compiles
    human = demo("--steps", "12", cwd=tmp_path)
    assert f"median in steady state (steps {WARMUP_STEPS + 1}–12); the first {WARMUP_STEPS}:" in human.stdout


def test_split_warmup_keeps_one_step_for_the_median():
    assert split_warmup([]) == ([], 0.0)
    assert split_warmup([3_000_000]) == ([], 3.0)
    assert split_warmup([9_000_000, 1_000_000, 2_000_000]) == ([9.0, 1.0], 2.0)
    first, steady = split_warmup([100_000_000] + [1_000_000] * 4 + [500_000] * 10)
    assert first == [100.0, 1.0, 1.0, 1.0, 1.0] and steady == 0.5


def test_next_commands_one_per_line_never_wrapped(tmp_path):
    """Issue 9: the Next: line wrapped in the middle of a command."""
    deep = tmp_path / ("a-rather-long-folder-name-" * 3) / "print.pb"
    result = demo("--steps", "3", "--set", f"print_file_path={deep}", cwd=tmp_path, env={"COLUMNS": "40"})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    nxt = lines.index("Next:")
    commands = [line.strip() for line in lines[nxt + 1:]]
    assert commands[0] == f"obs print {deep}"
    assert "obs demo --config obs_config.json --fail-at 20   # with rdr.enable true in the file" in commands
    assert all(line.startswith("  obs ") for line in lines[nxt + 1:])


def test_demo_writes_nothing_in_the_current_folder_unless_asked(tmp_path):
    here = tmp_path / "here"
    here.mkdir()
    plain = demo("--steps", "3", cwd=here)
    assert plain.returncode == 0, plain.stderr
    assert list(here.iterdir()) == [] and "wrote" not in plain.stderr
    elsewhere = tmp_path / "out" / "print.pb"
    with_print = demo("--steps", "3", "--set", f"print_file_path={elsewhere}", cwd=here)
    assert with_print.returncode == 0, with_print.stderr
    assert list(here.iterdir()) == [] and elsewhere.is_file()
    said = [line for line in with_print.stderr.splitlines() if line.startswith("obs: wrote ")]
    assert said and all(line.endswith(f": {elsewhere}") for line in said), with_print.stderr


def test_failure_names_the_bundle_on_stdout_and_stderr(tmp_path):
    config = tmp_path / "obs.json"
    config.write_text(json.dumps({"rdr": {"enable": True, "path": str(tmp_path / "rdr")}}))
    result = demo("--steps", "10", "--fail-at", "4", "--config", str(config), cwd=tmp_path, env={"COLUMNS": "40"})
    assert result.returncode == 1
    bundle = next(line.split("RDR wrote ", 1)[1] for line in result.stdout.splitlines() if "RDR wrote " in line)
    assert os.path.isdir(bundle) and f"  obs rdr show {bundle}" in result.stdout.splitlines()
    assert bundle in result.stderr and "injected failure at step 4" in result.stderr
