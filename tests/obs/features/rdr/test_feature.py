"""The recorder wired to the settings, in process: start/stop, manual dumps, bundle content, config errors."""

from __future__ import annotations

import functools
import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import obs
from obs.cli import main
from obs.features.env_config import feature as env_feature
from recorder.bundle_reader import list_bundles, load_bundle
from tests.training import mlp, train


def enable(tmp_path, **rdr):
    path = tmp_path / "obs.json"
    path.write_text(json.dumps({"rdr": {"enable": True, "path": str(tmp_path / "out"), **rdr}}))
    obs.set_context(env_config_path=str(path))
    return path


def rank_dir(tmp_path):
    return tmp_path / "out" / "rank_0" / "rdr"


def test_dump_when_off_says_how_to_turn_it_on():
    assert obs.rdr.recorder() is None
    with pytest.raises(obs.ObsError, match="MS_RDR_ENABLE=1"):
        obs.rdr.dump("manual")


def test_start_and_clean_stop(tmp_path):
    enable(tmp_path)
    live = obs.rdr.recorder()
    ring = rank_dir(tmp_path) / f"ring_{os.getpid()}.obsring"
    assert live is not None and ring.exists() and stat.S_IMODE(ring.stat().st_mode) == 0o600
    assert stat.S_IMODE(rank_dir(tmp_path).stat().st_mode) == 0o700
    assert json.loads((rank_dir(tmp_path) / "marker.json").read_text())["state"] == "running"
    obs.reset_context()
    assert obs.rdr.recorder() is None and not ring.exists()
    assert not (tmp_path / "out").exists()  # nothing to report: no ring, no marker, no folder obs made


def test_manual_dump_holds_a_complete_private_bundle(tmp_path):
    enable(tmp_path)
    train(3, marked=False)
    obs.Print("note", torch.tensor([1.0, 2.0]))
    path = obs.rdr.dump("checkpoint")
    assert os.path.basename(path).endswith(f"_{os.getpid()}_checkpoint")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    assert all(stat.S_IMODE(os.stat(os.path.join(path, f)).st_mode) == 0o600 for f in os.listdir(path))
    b = load_bundle(path)
    m = b.manifest
    assert m["schema_version"] == 1 and m["reason"] == "checkpoint" and m["pid"] == os.getpid()
    assert (m["rank"], m["world_size"], m["step"]) == (0, 1, 3) and m["host"] and m["run_id"]
    assert m["versions"]["torch"] == torch.__version__ and m["versions"]["obs"] == obs.__version__
    assert m["settings"]["env_config"]["rdr"]["enable"] is True and set(m["dropped"]) >= {"module", "op", "blob"}
    kinds = [e["kind"] for e in b.iter_events()]
    assert kinds.count("step_end") == 3 and "memory" in kinds and "settings" in kinds
    assert kinds.count("module_enter") == kinds.count("module_exit") == 3 * 4
    assert b.events({"print"})[0]["values"] == ["note", "Float32[2] [1., 2.]"]
    assert b.events({"memory"})[0]["used_bytes"] > 0 and b.stacks[0]["main"]


def test_hostile_reasons_stay_inside_the_rdr_folder(tmp_path):
    enable(tmp_path)
    path = obs.rdr.dump("../../etc/passwd\x00;rm -rf")
    assert os.path.dirname(path) == str(rank_dir(tmp_path)) and "/" not in os.path.basename(path)


def test_small_capacity_wraps_and_counts_what_was_overwritten(tmp_path):
    enable(tmp_path, capacity={"module": 16})
    train(5, marked=False)
    b = load_bundle(obs.rdr.dump("manual"))
    assert b.manifest["dropped"]["module"] == 5 * 8 - 16
    assert len(b.events({"module_enter", "module_exit"})) == 16


def test_graphs_compiled_through_obs_compile_are_in_the_bundle(tmp_path):
    enable(tmp_path)
    obs.set_context(mode=obs.GRAPH_MODE)
    fn = obs.compile(lambda x: torch.sin(x) * 2, backend="eager")
    fn(torch.ones(3))
    b = load_bundle(obs.rdr.dump("manual"))
    assert len(b.graphs) == 1 and b.graphs[0].endswith(".ir")
    assert "sin" in Path(b.graphs[0]).read_text()
    assert [e["kind"] for e in b.events({"graph"})] == ["graph"]


def test_collectives_land_in_collectives_jsonl(tmp_path):
    import torch.distributed as dist

    enable(tmp_path, granularity="step")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        dist.all_reduce(torch.ones(5))
        path = obs.rdr.dump("manual")
    finally:
        dist.destroy_process_group()
    lines = [json.loads(x) for x in Path(path, "collectives.jsonl").read_text().splitlines()]
    assert [(x["group_seq"], x["state"]) for x in lines] == [(1, "started"), (1, "completed")]
    assert "all_reduce" in lines[0]["desc"] and "[[5]]" in lines[0]["desc"]


def test_granularity_step_records_no_modules(tmp_path):
    enable(tmp_path, granularity="step")
    train(3, marked=False)
    kinds = {e["kind"] for e in load_bundle(obs.rdr.dump("manual")).iter_events()}
    assert "step_end" in kinds and not kinds & {"module_enter", "op"}


def test_hot_reload_turns_the_recorder_on_and_off(tmp_path):
    path = tmp_path / "obs.json"
    path.write_text(json.dumps({"rdr": {"enable": False, "path": str(tmp_path / "out")}}))
    env_feature.debounce_s = 0.05
    try:
        obs.set_context(env_config_path=str(path))
        assert obs.rdr.recorder() is None
        for enabled in (True, False):
            path.write_text(json.dumps({"rdr": {"enable": enabled, "path": str(tmp_path / "out")}}))
            assert env_feature.wait_staged(lambda cfg: cfg.values["rdr"]["enable"] is enabled, 10)  # noqa: B023 - waited on here
            assert (obs.rdr.recorder() is None) is enabled  # staged: applied at the next step boundary
            with obs.step():
                pass
            assert (obs.rdr.recorder() is not None) is enabled
    finally:
        env_feature.debounce_s = 0.2


@pytest.mark.parametrize("rdr,fragment", [
    ({"path": "relative/dir"}, "'rdr.path' must be an absolute path"),
    ({"granularity": "ops"}, "'rdr.granularity' must be one of .* did you mean .op."),
    ({"capacity": {"modules": 10}}, "has no key .modules..*did you mean .module."),
    ({"capacity": {"op": 1}}, r"'rdr.capacity.op' must be an int in \[16, 16777216\] \(got 1\)"),
    ({"hang_action": "kill"}, r"'rdr.hang_action' must be one of \[.dump., .abort.\]"),
])
def test_bad_rdr_configs_name_file_key_and_value(tmp_path, rdr, fragment):
    path = tmp_path / "obs.json"
    path.write_text(json.dumps({"rdr": {"enable": True, **rdr}}))
    with pytest.raises(ValueError, match=f"{path}.*{fragment}"):
        obs.set_context(env_config_path=str(path))
    assert obs.rdr.recorder() is None


def test_environment_variables_alone_turn_it_on(tmp_path):
    code = "import obs; r = obs.rdr.recorder(); print(r is not None and r.dir)"
    env = {**os.environ, "MS_RDR_ENABLE": "1", "MS_RDR_PATH": str(tmp_path), "MS_RDR_MODE": "2"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == str(tmp_path / "rank_0" / "rdr")
    assert [b.reason for b in list_bundles(str(tmp_path)).bundles] == ["normal_end"]


def test_bad_environment_variable_warns_instead_of_breaking_import():
    code = "import obs; print(obs.rdr.recorder())"
    env = {**os.environ, "MS_RDR_ENABLE": "yes"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "None"
    assert "MS_RDR_ENABLE must be 1 or 0" in out.stderr


def _child_prints_then_is_terminated():
    obs.Print("from a forked worker")
    os.kill(os.getpid(), signal.SIGTERM)


def test_forked_workers_leave_the_parents_record_alone(tmp_path):
    import multiprocessing

    enable(tmp_path)
    ring = rank_dir(tmp_path) / f"ring_{os.getpid()}.obsring"
    before = (rank_dir(tmp_path) / "marker.json").read_text()
    child = multiprocessing.get_context("fork").Process(target=_child_prints_then_is_terminated)
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGTERM
    assert ring.exists() and (rank_dir(tmp_path) / "marker.json").read_text() == before
    assert not list_bundles(str(tmp_path / "out")).bundles  # the child's SIGTERM did not dump
    train(1, marked=False)
    assert load_bundle(obs.rdr.dump("manual")).manifest["step"] == 1


def test_faulthandler_is_given_back_even_when_sys_stderr_has_no_file_descriptor(tmp_path, monkeypatch):
    import faulthandler
    import io

    was = faulthandler.is_enabled()
    faulthandler.enable()
    try:
        enable(tmp_path)
        monkeypatch.setattr(sys, "stderr", io.StringIO())  # pytest's capsys, a notebook: no fileno()
        obs.reset_context()  # gives faulthandler back: it used to raise io.UnsupportedOperation here
        assert faulthandler.is_enabled()
    finally:
        monkeypatch.undo()
        if not was:
            faulthandler.disable()


# -- the bundle a recording owes when it ends -----------------------------------------------------------------------
class _MakesNan(torch.nn.Module):
    def forward(self, x):
        return torch.log(-x.abs() - 1)  # NaN everywhere


def enable_with_nan_check(tmp_path, mode):
    path = tmp_path / "obs.json"
    path.write_text(json.dumps({"rdr": {"enable": True, "mode": mode, "path": str(tmp_path / "out")},
                                "nan_check": {"enable": True, "action": "continue", "path": str(tmp_path / "dump")}}))
    obs.set_context(env_config_path=str(path))


@pytest.mark.parametrize("mode", [1, 2])
def test_a_nan_found_with_action_continue_leaves_a_bundle_named_for_it_in_every_mode(tmp_path, mode):
    enable_with_nan_check(tmp_path, mode)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), _MakesNan(), torch.nn.Linear(4, 1))
    for _ in range(3):
        with obs.step():
            net(torch.randn(2, 4)).sum()
    assert not list_bundles(str(tmp_path / "out")).bundles  # training went on: nothing written yet
    obs.reset_context()
    (info,) = list_bundles(str(tmp_path / "out")).bundles  # one bundle: the fault's (mode 2: instead of normal_end)
    b = load_bundle(info.path)
    assert info.reason == "nan_inf" and b.manifest["fault"] == {
        "kind": "nan_inf", "where": "Default/net-Sequential/1-_MakesNan",
        "error": "NonFiniteError: first NaN/Inf in forward at Default/net-Sequential/1-_MakesNan (step 1, output): "
                 "8 NaN, 0 +Inf, 0 -Inf"}
    assert [e["fault"] for e in b.events({"fault"})] == ["nan_inf"] and info.step == 3
    assert json.loads((rank_dir(tmp_path) / "marker.json").read_text())["dumps"] == [os.path.basename(info.path)]
    assert not list(rank_dir(tmp_path).glob("ring_*"))  # the ring goes once its bundle is on disk


def test_a_fault_already_in_a_bundle_is_not_written_again_at_the_end(tmp_path):
    enable(tmp_path)
    obs.bus.emit(obs.Event.FAULT, "nan_inf", "Default/net-Net/fc1-Linear", "4 NaN, 0 +Inf, 0 -Inf")
    obs.rdr.dump("manual")
    obs.reset_context()
    assert [b.reason for b in list_bundles(str(tmp_path / "out")).bundles] == ["manual"]


def test_what_a_fault_without_an_exception_says_is_its_error(tmp_path):
    enable(tmp_path)
    obs.bus.emit(obs.Event.FAULT, "nan_inf", "Default/net-Net/fc1-Linear", "4 NaN, 0 +Inf, 0 -Inf")
    obs.reset_context()
    (info,) = list_bundles(str(tmp_path / "out")).bundles
    b = load_bundle(info.path)
    assert b.manifest["fault"]["error"] == "4 NaN, 0 +Inf, 0 -Inf"
    assert b.events({"fault"})[0]["error"] == "4 NaN, 0 +Inf, 0 -Inf"


@pytest.mark.parametrize("mode,reasons", [(1, []), (2, ["normal_end"])])
def test_reset_context_ends_the_recording_as_the_process_end_would(tmp_path, mode, reasons):
    enable(tmp_path, mode=mode)
    train(3, marked=False)
    obs.reset_context()  # torchrun and mp.spawn scripts clean up this way
    assert [b.reason for b in list_bundles(str(tmp_path)).bundles] == reasons
    if reasons:
        assert load_bundle(str(rank_dir(tmp_path))).manifest["step"] == 3


def test_the_env_config_file_turning_a_mode_2_recorder_off_keeps_its_normal_end_bundle(tmp_path, monkeypatch):
    monkeypatch.setattr(env_feature, "debounce_s", 0.05)
    path = enable(tmp_path, mode=2)
    train(3, marked=False)
    path.write_text(json.dumps({"rdr": {"enable": False, "path": str(tmp_path / "out")}}))
    assert env_feature.wait_staged(lambda cfg: cfg.values["rdr"]["enable"] is False, 10)
    with obs.step():  # the reload is applied at a step boundary
        pass
    assert obs.rdr.recorder() is None
    assert [b.reason for b in list_bundles(str(tmp_path)).bundles] == ["normal_end"]


def test_last_module_is_the_steps_and_none_before_the_step_calls_one(tmp_path, capsys):
    enable(tmp_path)
    net = mlp(4, 8, 1)
    train(2, net, marked=False)
    ended = load_bundle(obs.rdr.dump("exception"))
    assert (ended.manifest["step"], ended.manifest["last_module"]) == (2, "Default/net-Sequential/2-Linear")
    opt = torch.optim.SGD(net.parameters(), lr=0.1)

    def training_step(call_first):  # Lightning's closure: optimizer.step has begun step 3 when it raises
        if call_first:
            net[0](torch.randn(2, 4))
        raise ValueError("boom in training_step")

    bundles = []
    for call_first in (False, True):
        with pytest.raises(ValueError):
            opt.step(functools.partial(training_step, call_first))
        bundles.append(load_bundle(obs.rdr.dump("exception")))
    opened, called = bundles
    assert (opened.manifest["step"], opened.manifest["last_module"]) == (3, None)
    assert main(["rdr", "show", opened.info.path]) == 0
    assert "none in step 3" in capsys.readouterr().out
    assert (called.manifest["step"], called.manifest["last_module"]) == (3, "Default/net-Sequential/0-Linear")
