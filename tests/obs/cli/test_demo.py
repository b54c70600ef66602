"""``obs demo`` as a new user meets it: with no options, every feature writes into ./obs_demo/ and the command that
opens each file is printed (and works); with --set/--config, only what the settings ask for.  Progress on a
terminal, steady-state step time, pasteable commands.  No timing is asserted (the machines are shared)."""

from __future__ import annotations

import atexit
import json
import os
import shlex
import subprocess
import sys
import time

import pytest

import obs
from obs._core.outputs import written
from obs.cli import main
from obs.cli._demo import WARMUP_STEPS, split_warmup
from obs.cli._demo_folder import DEMO_FOLDER, MARKER, SCRIPT, prepare_folder
from obs.cli._run import say_what_obs_wrote
from obs.cli._trace_view import print_exit_summary

pytestmark = pytest.mark.slow

#: The variables that would send the demo's files elsewhere (or its spans to a collector).
_ELSEWHERE = ("OBS_CONFIG", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SDK_DISABLED",
              "MS_RDR_ENABLE", "MS_RDR_PATH", "MS_RDR_MODE", "MINDSPORE_DUMP_CONFIG", "OBS_DUMP_CONFIG")


@pytest.fixture
def here(tmp_path, monkeypatch):
    """An empty current folder under tmp_path, a clean environment and a fresh Dynamo cache (in-process runs)."""
    import torch

    folder = tmp_path / "here"
    folder.mkdir()
    monkeypatch.chdir(folder)
    for name in _ELSEWHERE:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NO_COLOR", "1")
    torch._dynamo.reset()
    yield folder
    torch._dynamo.reset()
    # What `obs demo --set/--config` registers for the end of its process: not this one's (pytest's) end.
    atexit.unregister(say_what_obs_wrote)
    listeners = obs.profiling.feature.exit_listeners
    listeners[:] = [f for f in listeners if f is not print_exit_summary]


def demo(*args, cwd, env=None, stderr_tty=False):
    """Run ``obs demo ARGS`` in a child process in ``cwd``; with ``stderr_tty`` its stderr is a pseudo-terminal."""
    full_env = {**os.environ, "NO_COLOR": "1", **(env or {})}
    full_env.pop("COLUMNS", None)
    for name in _ELSEWHERE:
        full_env.pop(name, None)
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


def next_commands(stdout: str) -> list[str]:
    lines = stdout.splitlines()
    after = lines[lines.index("Next:") + 1:]
    assert after and all(line.startswith("  obs ") for line in after), stdout
    return [line.strip() for line in after]


# -- no options: the tour into ./obs_demo/ ----------------------------------------------------------------------

def test_the_tour_writes_each_file_and_each_printed_command_opens_it(here, capfd):
    assert main(["demo", "--steps", "12"]) == 0
    out, err = capfd.readouterr()
    assert "Traceback" not in err and "\x1b" not in err and "training" not in err  # piped: no progress bar
    assert sorted(os.listdir(here)) == [DEMO_FOLDER]
    root = here / DEMO_FOLDER
    assert json.loads((root / MARKER).read_text())["written_by"] == "obs demo"
    assert "The fault injected at the end was expected (DemoFailure: " in out
    assert f"median in steady state (steps {WARMUP_STEPS + 1}–12); the first {WARMUP_STEPS}:" in out

    commands = next_commands(out)
    opened = {}
    for line in commands:
        command = line.partition("   # ")[0]
        words = shlex.split(command)
        if words[1] == "run":  # the user's own script: a placeholder
            continue
        capfd.readouterr()
        assert main(words[1:]) == 0, command
        shown, problems = capfd.readouterr()
        assert shown.strip() and "error" not in problems, (command, problems)
        at = next((i for i, w in enumerate(words) if w.startswith(DEMO_FOLDER)), len(words))
        opened[" ".join(words[1:at])] = words[at] if at < len(words) else ""  # "graph ls" -> "obs_demo/graphs"

    bundle = opened["rdr show"]
    assert bundle.startswith(f"{DEMO_FOLDER}/rdr/rank_0/rdr/") and (here / bundle / "manifest.json").is_file()
    manifest = json.loads((here / bundle / "manifest.json").read_text())
    assert manifest["reason"] == "module_error" and manifest["step"] == 12
    # Raised in the training script the tour wrote, as a user's would be: "raised at" names it, not obs's package.
    where = manifest["exception"]["where"]
    assert (where["file"], where["function"]) == (str(root / SCRIPT), "forward")
    assert f"obs_demo/{SCRIPT} (training script: the injected fault is raised in it)" in out
    trace_files = {line.partition("   # ")[0].split()[-1] for line in commands if line.startswith("obs trace summary")}
    profile = f"{DEMO_FOLDER}/profile/rank_0"
    assert trace_files == {f"{profile}/trace.json", f"{profile}/traces.otlp.jsonl"}
    events = json.loads((root / "profile/rank_0/trace.json").read_text())  # complete: closed before the report
    assert any(e.get("name") == "step" for e in events)
    spans = [json.loads(line) for line in (root / "profile/rank_0/traces.otlp.jsonl").read_text().splitlines()]
    assert spans and all("resourceSpans" in s for s in spans)
    assert opened["print"] == f"{DEMO_FOLDER}/print.pb"
    assert obs.parse_print(str(root / "print.pb"))[0] == "step 1 loss:"
    assert opened["graph ls"] == f"{DEMO_FOLDER}/graphs"
    stages = {g["stage"] for g in json.loads((root / "graphs/index.json").read_text())["graphs"]}
    assert {"dynamo_capture", "aot_forward", "aot_backward"} <= stages
    assert opened["dump ls"] == opened["dump stats"] == f"{DEMO_FOLDER}/dump"
    assert (root / "dump/rank_0/Demo/0/11/statistic.csv").is_file()  # iteration 11: the 12th, last step
    assert sorted(os.listdir(root / "dump/rank_0/Demo/0")) == ["11"]
    assert opened["config check"] == f"{DEMO_FOLDER}/obs_config_with_dump.json"
    for kind in ("RDR bundle", "print file", "data dump", "graph dumps", "trace"):
        assert f"obs: wrote {kind}: {root}" in err, err


def test_the_tour_replaces_its_own_folder_and_lists_the_paths_in_json(here, capfd):
    previous = prepare_folder()  # what an earlier run left, and a file in it
    (here / DEMO_FOLDER / "stale.txt").write_text("from an earlier run")
    assert main(["demo", "--steps", "3", "--json"]) == 0
    data = json.loads(capfd.readouterr().out)
    root = str(here / DEMO_FOLDER)
    assert previous == root and not os.path.exists(os.path.join(root, "stale.txt"))
    outputs = data["outputs"]
    assert {"folder", "script", "env_config", "rdr_bundle", "perfetto_trace", "otlp_json_lines", "print_file",
            "graphs", "data_dump"} <= set(outputs)
    assert outputs["folder"] == root
    assert all(path.startswith(root + os.sep) and os.path.exists(path) for k, path in outputs.items() if k != "folder")
    assert data["fault"].startswith("DemoFailure: ")
    assert len(data["produced"]) >= 6 and any(c.startswith("obs rdr show ") for c in data["next_commands"])
    assert data["steps"] == 3 and len(data["first_steps_ms"]) == 2 and data["step_ms"] > 0
    assert all(ms > 0 for ms in data["first_steps_ms"])
    assert {"mode", "print_file_path", "env_config_path"} <= set(data["settings"])
    assert data["env_config"]["rdr"]["enable"] is True


@pytest.mark.parametrize("what", ["folder", "file", "symlink", "foreign marker"])
def test_the_tour_never_removes_what_it_did_not_make(here, capfd, what):
    target = here / DEMO_FOLDER
    if what == "file":
        target.write_text("mine")
    elif what == "symlink":
        (here / "real").mkdir()
        (here / "real" / "keep.txt").write_text("mine")
        target.symlink_to(here / "real")
    else:
        target.mkdir()
        (target / "keep.txt").write_text("mine")
        if what == "foreign marker":
            (target / MARKER).write_text(json.dumps({"written_by": "someone else"}))
    before = sorted(p.name for p in here.rglob("*"))
    assert main(["demo"]) == 2
    _, err = capfd.readouterr()
    assert f"obs: error: ./{DEMO_FOLDER} exists and is not a folder obs demo made" in err
    assert "Traceback" not in err
    assert sorted(p.name for p in here.rglob("*")) == before


def test_the_tour_needs_two_steps(here, capfd):
    assert main(["demo", "--steps", "1"]) == 2
    assert "--steps must be at least 2" in capfd.readouterr().err
    assert list(here.iterdir()) == []


# -- with settings: as before ----------------------------------------------------------------------------------

def test_step_time_is_steady_state_and_the_first_steps_are_said_apart(here, capfd):
    """Issue 9: the median step mixed in compilation and warm-up.  Structure only: no timing is asserted."""
    assert main(["demo", "--steps", "30", "--set", "mode=0", "--json"]) == 0  # GRAPH_MODE: obs.compile
    data = json.loads(capfd.readouterr().out)
    first, steady = data["first_steps_ms"], data["step_ms"]
    assert len(first) == WARMUP_STEPS and all(ms > 0 for ms in first) and steady > 0
    assert data["fault"] is None and data["outputs"] == {}
    assert list(here.iterdir()) == []


def test_split_warmup_keeps_one_step_for_the_median():
    assert split_warmup([]) == ([], 0.0)
    assert split_warmup([3_000_000]) == ([], 3.0)
    assert split_warmup([9_000_000, 1_000_000, 2_000_000]) == ([9.0, 1.0], 2.0)
    first, steady = split_warmup([100_000_000] + [1_000_000] * 4 + [500_000] * 10)
    assert first == [100.0, 1.0, 1.0, 1.0, 1.0] and steady == 0.5


def test_with_settings_it_writes_only_what_they_ask_and_commands_stay_whole(here, capfd, monkeypatch, tmp_path):
    """Issue 9: the Next: line wrapped in the middle of a command."""
    monkeypatch.setenv("COLUMNS", "40")
    deep = tmp_path / ("a-rather-long-folder-name-" * 3) / "print.pb"
    assert main(["demo", "--steps", "12", "--set", f"print_file_path={deep}"]) == 0
    out = capfd.readouterr().out
    commands = next_commands(out)
    assert commands[0] == f"obs print {deep}"
    assert "obs demo --config obs_config.json --fail-at 20   # with rdr.enable true in the file" in commands
    assert f"median in steady state (steps {WARMUP_STEPS + 1}–12); the first {WARMUP_STEPS}:" in out
    assert list(here.iterdir()) == [] and deep.is_file()
    assert ("print file", str(deep)) in written()  # what `obs: wrote ...` names at exit


def test_progress_bar_on_a_terminal_only(tmp_path):
    """Issue 9: obs demo was silent for 7-12 s."""
    on_tty = demo("--steps", "20", cwd=tmp_path, stderr_tty=True)
    assert on_tty.returncode == 0, on_tty.stderr
    assert "obs demo: training" in on_tty.stderr and "20/20" in on_tty.stderr
    assert "obs demo" in on_tty.stdout and "Traceback" not in on_tty.stderr
    assert sorted(os.listdir(tmp_path)) == [DEMO_FOLDER]


def test_failure_names_the_bundle_on_stdout_and_stderr(tmp_path):
    config = tmp_path / "obs.json"
    config.write_text(json.dumps({"rdr": {"enable": True, "path": str(tmp_path / "rdr")}}))
    result = demo("--steps", "10", "--fail-at", "4", "--config", str(config), cwd=tmp_path, env={"COLUMNS": "40"})
    assert result.returncode == 1
    bundle = next(line.split("RDR wrote ", 1)[1] for line in result.stdout.splitlines() if "RDR wrote " in line)
    assert os.path.isdir(bundle) and f"  obs rdr show {bundle}" in result.stdout.splitlines()
    assert bundle in result.stderr and "injected failure at step 4" in result.stderr
    assert sorted(os.listdir(tmp_path)) == ["obs.json", "rdr"]
