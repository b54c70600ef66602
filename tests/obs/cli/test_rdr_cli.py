"""``obs rdr``: ls, show, events and recover (in this process) on bundles made by real failing runs."""

from __future__ import annotations

import json
import os

import pytest

from tests.obs.cli.test_cli import obs_cli, obs_process
from tests.recorder.test_triggers import run


@pytest.fixture(scope="module", name="crashed")
def _crashed(tmp_path_factory):
    """One run that raised in forward (a bundle) and one that was SIGKILLed (a ring to recover)."""
    root = tmp_path_factory.mktemp("rdr-cli")
    assert run(root, "forward").returncode == 1
    (root / "killed").mkdir()
    assert run(root / "killed", "sigkill").returncode == -9
    return root


def test_ls_lists_bundles_and_rings_to_recover(crashed):
    result = obs_cli("rdr", "ls", str(crashed), "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert [(b["reason"], b["step"], b["rank"]) for b in data["bundles"]] == [("module_error", 3, 0)]
    assert len(data["rings_to_recover"]) == 1 and "killed" in data["rings_to_recover"][0]
    pretty = obs_cli("rdr", "ls", str(crashed))
    assert "module_error" in pretty.stdout and "obs rdr recover" in pretty.stdout


def test_show_tells_what_happened(crashed):
    result = obs_cli("rdr", "show", str(crashed / "rdr" / "rank_0" / "rdr" / "latest"), "--last", "5")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for text in ("module_error", "ValueError: boom in forward at step 3", "step reached", "Default/net-Net/act-ReLU",
                 "last 5 events", "stacks of all threads", "train_script.py"):
        assert text in out, text
    data = json.loads(obs_cli("rdr", "show", str(crashed / "rdr"), "--json").stdout)
    assert data["manifest"]["exception"]["type"] == "ValueError" and len(data["last_events"]) == 30
    assert data["last_events"][-1]["kind"] == "fault"


def test_events_filters_by_kind_and_count(crashed):
    bundle = str(crashed / "rdr")
    data = [json.loads(line) for line in obs_cli("rdr", "events", bundle, "--kind", "module_enter,step_begin",
                                                 "--last", "4", "--json").stdout.splitlines()]
    assert [e["kind"] for e in data] == ["step_begin", "module_enter", "module_enter", "module_enter"]
    assert data[-1]["scope"] == "Default/net-Net/act-ReLU"
    pretty = obs_cli("rdr", "events", bundle, "--kind", "print")
    assert pretty.returncode == 0 and "loss Float32[]" in pretty.stdout


def test_recover_then_show(crashed):
    result = obs_cli("rdr", "recover", str(crashed / "killed"), "--json")
    assert result.returncode == 0, result.stderr
    (bundle,) = json.loads(result.stdout)["recovered"]
    shown = json.loads(obs_cli("rdr", "show", bundle, "--json").stdout)
    assert shown["manifest"]["reason"] == "recovered" and shown["manifest"]["step"] == 3
    again = obs_cli("rdr", "recover", str(crashed / "killed"))
    assert again.returncode == 0 and "nothing to recover" in again.stdout


def test_errors_are_clear_and_exit_2(tmp_path):
    result = obs_cli("rdr", "show", str(tmp_path))
    assert result.returncode == 2 and "no RDR bundle under" in result.stderr and "Traceback" not in result.stderr
    result = obs_cli("rdr", "ls", str(tmp_path / "missing"))
    assert result.returncode == 2 and "no such folder" in result.stderr
    result = obs_cli("rdr", "recover", str(tmp_path / "missing"))
    assert result.returncode == 2 and "no such rdr folder or ring file" in result.stderr


def test_demo_fail_at_leaves_a_bundle_to_show(tmp_path):
    config = tmp_path / "obs_config.json"
    config.write_text(json.dumps({"rdr": {"enable": True, "path": str(tmp_path / "rdr")}}))
    result = obs_process("demo", "--config", str(config), "--fail-at", "7", "--json")
    assert result.returncode == 1
    data = json.loads(result.stdout)
    assert "injected failure at step 7" in data["failed"]
    shown = json.loads(obs_cli("rdr", "show", data["bundle"], "--json").stdout)["manifest"]
    assert shown["step"] == 7 and shown["fault"]["where"] == "Default/net-Sequential/2-Fault"
    assert shown["versions"]["torch"].startswith("2.")


# -- issue 9 / 10: conventions of `obs rdr` ---------------------------------------------------------
@pytest.fixture(scope="module", name="op_run")
def _op_run(tmp_path_factory):
    """A run at op granularity whose step 3 calls fc2 with the wrong width twice (torch's linear.py raises)."""
    root = tmp_path_factory.mktemp("rdr-op")
    assert run(root, "caught_twice", granularity="op").returncode == 0
    return root


def _lines(result):
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


def test_events_json_is_json_lines_and_show_json_one_document(crashed):
    bundle = str(crashed / "rdr")
    result = obs_cli("rdr", "events", bundle, "--json")
    events = _lines(result)
    assert len(events) > 10 and all(isinstance(e, dict) for e in events)
    assert isinstance(json.loads(obs_cli("rdr", "show", bundle, "--json").stdout), dict)
    assert "JSON lines" in obs_cli("rdr", "events", "--help").stdout


def test_every_event_has_a_step_and_step_filters_at_op_granularity(op_run):
    bundle = str(op_run / "rdr")
    events = _lines(obs_cli("rdr", "events", bundle, "--json"))
    ops = [e for e in events if e["kind"] == "op"]
    assert ops and all("step" in e for e in events)
    assert {e["step"] for e in ops} >= {1, 2, 3}
    step2 = _lines(obs_cli("rdr", "events", bundle, "--step", "2", "--kind", "op", "--json"))
    assert step2 and {e["step"] for e in step2} == {2} and len(step2) == sum(e["step"] == 2 for e in ops)
    begins = [e["seq"] for e in events if e["kind"] == "step_begin" and e["step"] == 2]
    ends = [e["seq"] for e in events if e["kind"] == "step_end" and e["step"] == 2]
    assert all(begins[0] < e["seq"] < ends[0] for e in step2)
    pretty = obs_cli("rdr", "events", bundle, "--step", "3", "--kind", "op")
    assert pretty.returncode == 0 and "in step 3" in pretty.stdout and "raised" in pretty.stdout


def test_raised_at_names_the_users_frame_beside_the_library_frame(op_run):
    data = json.loads(obs_cli("rdr", "show", str(op_run / "rdr"), "--json").stdout)
    exc = data["manifest"]["exception"]
    assert exc["where"]["file"].endswith("train_script.py") and exc["where"]["function"] == "fault"
    assert exc["raised_in"]["file"].endswith("linear.py")
    shown = obs_cli("rdr", "show", str(op_run / "rdr"))
    line = next(li for li in shown.stdout.splitlines() if "raised at" in li)
    assert "train_script.py" in line and "in fault" in line and "linear.py" in line


def test_the_exception_runs_from_the_users_outermost_frame(crashed):
    data = json.loads(obs_cli("rdr", "show", str(crashed / "rdr"), "--json").stdout)
    text = data["exception"]["traceback"]
    assert "in <module>" in text and "out = net(x, step)" in text  # the frames outside the module wrapper
    assert "fault(self, h)" in text and 'raise ValueError("boom in forward at step 3")' in text
    assert "_modules.py" not in text and "obs_module_call" not in text
    frames = [f["function"] for f in data["exception"]["frames"]]
    assert frames[0] == "<module>" and frames[-1] == "fault"
    assert data["manifest"]["exception"]["where"]["function"] == "fault"
    assert data["manifest"]["exception"]["raised_in"] is None  # the user's own frame raised


def test_show_names_the_bundle_and_marks_the_module_that_raised(crashed):
    result = obs_cli("rdr", "show", str(crashed / "rdr"), "--last", "40")
    assert result.returncode == 0, result.stderr
    first = result.stdout.splitlines()[0]
    assert first.startswith("bundle: ") and first.endswith("_module_error") and str(crashed) in first
    assert "module_exit (raised)" in result.stdout and "Default/net-Net/act-ReLU raised" not in result.stdout
    assert "Default/net-Net raised" in result.stdout


def test_show_collapses_obs_threads(crashed):
    default = obs_cli("rdr", "show", str(crashed / "rdr"))
    data = json.loads(obs_cli("rdr", "show", str(crashed / "rdr"), "--json").stdout)
    ours = [s["thread"] for s in data["stacks"] if s["thread"].startswith("obs-")]
    assert ours, [s["thread"] for s in data["stacks"]]
    assert "--all-threads shows them" in default.stdout
    assert not any(line.strip() in ours for line in default.stdout.splitlines())
    everything = obs_cli("rdr", "show", str(crashed / "rdr"), "--all-threads")
    assert all(name in everything.stdout for name in ours) and "hidden" not in everything.stdout


def test_unknown_kind_is_bad_input(crashed):
    result = obs_cli("rdr", "events", str(crashed / "rdr"), "--kind", "op,bogus")
    assert result.returncode == 2 and "unknown event kind 'bogus'" in result.stderr
    assert "step_begin" in result.stderr and "marker" in result.stderr and "Traceback" not in result.stderr


def test_no_op_events_says_why(crashed):
    result = obs_cli("rdr", "events", str(crashed / "rdr"), "--kind", "op")
    assert result.returncode == 0 and "0 events of kind op" in result.stdout
    assert "module granularity" in result.stdout and '"granularity": "op"' in result.stdout


def _dead_ring(folder, pid):
    from recorder.layout import DEFAULT_CAPACITY, Kind
    from recorder.ring import RingWriter

    writer = RingWriter(str(folder / f"ring_{pid}.obsring"), {**DEFAULT_CAPACITY, "op": 8, "module": 8}, pid=pid,
                        rank=0, world_size=1, meta={"run_id": "r", "granularity": "module"})
    writer.appender("step")(Kind.STEP_BEGIN, 0, 0, 2, 0, 0)
    writer.close(remove=False)


def test_recover_defaults_like_ls_and_never_wraps_paths(tmp_path):
    deep = tmp_path / ("a-long-folder-name-" * 8) / "rank_0" / "rdr"
    deep.mkdir(parents=True)
    _dead_ring(deep, 4321)
    listed = obs_cli("rdr", "ls", env={"MS_RDR_PATH": str(tmp_path)})
    assert f"obs rdr recover {deep}" in listed.stdout.splitlines()[-1]
    result = obs_cli("rdr", "recover", env={"MS_RDR_PATH": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    (see,) = [line for line in result.stdout.splitlines() if "see it with" in line]
    assert see.strip().startswith(f"see it with: obs rdr show {deep}/") and see.endswith("_recovered")
    listed = obs_cli("rdr", "ls", cwd=str(tmp_path))  # no path, no MS_RDR_PATH: the current folder
    rows = [line for line in listed.stdout.splitlines() if "_4321_" in line]
    assert len(rows) == 1 and rows[0].split()[2] == "recovered" and "recovered (recovered)" not in listed.stdout


def test_text_from_a_bundle_cannot_drive_the_terminal(tmp_path):
    from recorder.bundle import write_bundle

    bundle = write_bundle(str(tmp_path), "b", {"schema_version": 1, "reason": "x\x1b[2Jy", "created_ns": 1,
                                               "last_module": "m\x1b]0;pwned\x07"},
                          {"events.jsonl": ['{"seq":1,"t":1,"kind":"print","values":["\\u001b[31mred"]}']},
                          fsync=False)
    os.rename(bundle, bundle + "[bold]x")  # rich markup in a folder name is text, never markup
    bundle += "[bold]x"
    for argv in (("show", bundle), ("events", bundle), ("ls", str(tmp_path))):
        result = obs_cli("rdr", *argv)
        assert result.returncode == 0, result.stderr
        assert "\x1b" not in result.stdout and "\\x1b" in result.stdout, argv
        assert "b[bold]x" in result.stdout, argv


# -- a NaN under `obs run`: the bundle, what show says of it, and no obs frame anywhere ---------------------------
NAN_SCRIPT = """import torch
import obs


class MakesNan(torch.nn.Module):
    def forward(self, x):
        return torch.log(-x.abs() - 1)


net = torch.nn.Sequential(torch.nn.Linear(4, 4), MakesNan(), torch.nn.Linear(4, 1))
for _ in range(3):
    with obs.step():
        net(torch.randn(2, 4)).sum()
"""


def _run_nan(tmp_path, *, mode, action):
    config = tmp_path / "obs.json"
    config.write_text(json.dumps({"rdr": {"enable": True, "mode": mode, "path": str(tmp_path / "rdr")},
                                  "nan_check": {"enable": True, "action": action, "path": str(tmp_path / "dump")}}))
    (tmp_path / "train.py").write_text(NAN_SCRIPT)
    return obs_process("run", "--config", str(config), "train.py", cwd=tmp_path)


@pytest.mark.parametrize("mode", [1, 2])
def test_a_nan_the_run_went_on_after_is_kept_and_shown(tmp_path, mode):
    result = _run_nan(tmp_path, mode=mode, action="continue")
    assert result.returncode == 0, result.stderr
    (info,) = json.loads(obs_cli("rdr", "ls", str(tmp_path / "rdr"), "--json").stdout)["bundles"]
    assert info["reason"] == "nan_inf" and info["step"] == 3
    shown = obs_cli("rdr", "show", info["path"], "--last", "40").stdout
    fault_row = next(line for line in shown.splitlines() if line.strip().startswith("fault "))
    assert "nan_inf: Default/net-Sequential/1-MakesNan" in fault_row
    event = next(line for line in shown.splitlines() if "nan_inf at " in line)
    assert not event.rstrip(" │").endswith(":"), event  # nothing said: no dangling colon


def _ours(path):
    """A frame of obs's packages or runpy's: computed from the packages' own files, as obs does."""
    import exporters
    import obs
    import printsink
    import recorder

    roots = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (obs, recorder, printsink, exporters))
    return path == "<frozen runpy>" or path.startswith(roots)


def test_under_obs_run_no_obs_frame_is_shown_and_raised_at_is_the_users(tmp_path):
    result = _run_nan(tmp_path, mode=1, action="raise")
    assert result.returncode == 1
    data = json.loads(obs_cli("rdr", "show", str(tmp_path / "rdr"), "--json").stdout)
    where = data["manifest"]["exception"]["where"]
    assert (where["file"], where["function"]) == (str(tmp_path / "train.py"), "<module>")
    assert not _ours(data["manifest"]["exception"]["raised_in"]["file"])
    assert not [f["file"] for f in data["exception"]["frames"] if _ours(f["file"])]
    main_thread = next(s for s in data["stacks"] if s["main"])
    assert main_thread["frames"][0]["file"] == str(tmp_path / "train.py")
    assert not [f["file"] for f in main_thread["frames"] if _ours(f["file"])]
    shown = obs_cli("rdr", "show", str(tmp_path / "rdr")).stdout
    raised = next(line for line in shown.splitlines() if "raised at" in line)
    assert f"{tmp_path / 'train.py'}:13 in <module>" in raised and "nan_check.py" not in raised
    assert "runpy" not in shown and "_run.py" not in shown and "nan_check.py" not in shown


def test_events_of_a_step_cut_by_last_say_how_many_the_step_holds(crashed):
    bundle = str(crashed / "rdr")
    held = len(_lines(obs_cli("rdr", "events", bundle, "--step", "2", "--json")))
    assert held > 3
    cut = obs_cli("rdr", "events", bundle, "--step", "2", "--last", "3")
    assert f"last 3 of {held} events in step 2" in cut.stdout
    whole = obs_cli("rdr", "events", bundle, "--step", "2", "--last", str(held + 5))
    assert f": {held} events in step 2" in whole.stdout and "last" not in whole.stdout.splitlines()[1]
