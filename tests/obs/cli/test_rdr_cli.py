"""``obs rdr``: ls, show, events and recover on bundles made by real failing runs."""

from __future__ import annotations

import json

import pytest

from tests.obs.cli.test_cli import obs_cli
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
    result = obs_cli("demo", "--config", str(config), "--fail-at", "7", "--json")
    assert result.returncode == 1
    data = json.loads(result.stdout)
    assert "injected failure at step 7" in data["failed"]
    shown = json.loads(obs_cli("rdr", "show", data["bundle"], "--json").stdout)["manifest"]
    assert shown["step"] == 7 and shown["fault"]["where"] == "Default/net-Sequential/2-Fail"
    assert shown["versions"]["torch"].startswith("2.")


def test_obs_run_hands_uncaught_exceptions_to_the_recorder(tmp_path):
    config = tmp_path / "obs_config.json"
    config.write_text(json.dumps({"rdr": {"enable": True, "path": str(tmp_path / "rdr")}}))
    script = tmp_path / "train.py"
    script.write_text("import obs\nwith obs.step():\n    pass\nraise KeyError('missing shard 7')\n")
    result = obs_cli("run", "--config", str(config), str(script))
    assert result.returncode == 1 and "KeyError: 'missing shard 7'" in result.stderr
    data = json.loads(obs_cli("rdr", "show", str(tmp_path / "rdr"), "--json").stdout)["manifest"]
    assert data["reason"] == "exception" and data["exception"]["type"] == "KeyError" and data["step"] == 1
