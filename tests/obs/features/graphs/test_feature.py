"""save_graphs settings and environment, the eager trace graph, obs.dump_graph, graphs in RDR bundles."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

import obs
from obs.features.graphs import read_ir
from obs.features.graphs.feature import feature, parse_env
from obs.runtime.torch import adapter
from recorder.bundle_reader import load_bundle
from tests.obs.features.graphs.nets import Net


# -- settings ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, error", [("1", TypeError), (1.0, TypeError), (4, ValueError), (-1, ValueError),
                                          ([1], TypeError)])
def test_bad_levels_are_refused_with_key_and_value(value, error):
    with pytest.raises(error, match="save_graphs") as info:
        obs.set_context(save_graphs=value)
    assert repr(value) in str(info.value)
    assert obs.get_context("save_graphs") == 0


def test_bad_paths_are_refused_and_nothing_changes(tmp_path):
    (tmp_path / "file").write_text("x")
    for value, error in (("", ValueError), (3, TypeError)):
        with pytest.raises(error, match="save_graphs_path"):
            obs.set_context(save_graphs=1, save_graphs_path=value)
    with pytest.raises(ValueError, match=r"save_graphs_path .*file"):
        obs.set_context(save_graphs=1, save_graphs_path=str(tmp_path / "file" / "sub"))
    assert obs.get_context("save_graphs") == 0 and not (tmp_path / "file").is_dir()


def test_the_folder_is_created_0700_when_the_level_is_set(tmp_path):
    folder = tmp_path / "a" / "b"
    obs.set_context(save_graphs_path=str(folder))
    assert not folder.exists()  # level 0: nothing made
    obs.set_context(save_graphs=1)
    assert folder.is_dir() and (folder.stat().st_mode & 0o777) == 0o700


@pytest.mark.parametrize("env, message", [({"MS_DEV_SAVE_GRAPHS": "4"}, "MS_DEV_SAVE_GRAPHS must be 0, 1, 2 or 3"),
                                          ({"MS_DEV_SAVE_GRAPHS": "yes"}, "got 'yes'"),
                                          ({"MS_DEV_SAVE_GRAPHS_PATH": "a\0b"}, "NUL")])
def test_bad_environment_variables_are_clear_errors(env, message):
    with pytest.raises(ValueError, match=message):
        parse_env(env)


def test_environment_variables_read_at_import(tmp_path):
    code = ("import obs; from obs.features.graphs import feature; print(feature.level, feature.path, "
            "obs.get_context('save_graphs'))")
    env = {**os.environ, "MS_DEV_SAVE_GRAPHS": "2", "MS_DEV_SAVE_GRAPHS_PATH": str(tmp_path / "g")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.stdout.split() == ["2", str(tmp_path / "g"), "0"]  # as the original: get_context stays 0
    assert (tmp_path / "g").is_dir()
    env["MS_DEV_SAVE_GRAPHS"] = "7"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and done.stdout.split()[0] == "0"
    assert "graph dumps stay off" in done.stderr and "MS_DEV_SAVE_GRAPHS must be 0, 1, 2 or 3 (got '7')" in done.stderr


def test_set_context_wins_over_the_environment(tmp_path):
    try:
        feature.from_environment({"MS_DEV_SAVE_GRAPHS": "3", "MS_DEV_SAVE_GRAPHS_PATH": str(tmp_path)})
        assert (feature.level, feature.path) == (3, str(tmp_path))
        obs.set_context(save_graphs=1)
        assert (feature.level, feature.path) == (1, str(tmp_path))
    finally:
        obs.reset_context()
        feature.from_environment({})
    assert feature.level == 0


# -- eager trace ------------------------------------------------------------------------------------
def test_eager_model_yields_its_trace_graph_and_later_steps_run_bare(tmp_path):
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    obs.set_context(save_graphs=1, save_graphs_path=str(tmp_path))
    assert adapter.installed["modules"] and adapter.installed["steps"]  # armed: scopes and steps tracked
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(3):
        loss = net(torch.randn(8, 4)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert _get_current_dispatch_mode() is None
    # only step detection (graphs name their step) and the compile log (nothing while nothing compiles) stay
    assert [k for k, on in adapter.installed.items() if on] == ["steps", "compiles"], adapter.installed
    (name,) = [f for f in os.listdir(tmp_path) if f.endswith(".ir")]
    assert name.endswith("_trace_Net_step1.ir")
    ir = read_ir(str(tmp_path / name))
    ops = [n.op for n in ir.main.nodes]
    assert ops.count("aten.addmm") == 2 and "aten.threshold_backward" in ops and "aten.mm" in ops
    scopes = {n.op: n.scope for n in ir.main.nodes}
    assert scopes["aten.threshold_backward"].startswith("Gradients/Default/net-Net/")
    assert [n.scope for n in ir.main.nodes if n.op == "aten.addmm"] == [
        "Default/net-Net/fc1-Linear/addmm-op0", "Default/net-Net/fc2-Linear/addmm-op1"]
    assert {p.name for p in ir.main.params} >= {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "input1"}
    forward_file = Net.forward.__code__.co_filename  # the user's frame: where the model's forward is
    assert all(n.frames and n.frames[-1].startswith(forward_file) for n in ir.main.nodes if n.op == "aten.addmm")
    assert ir.attrs["step"] == "1" and ir.attrs["stage"] == "trace"


def test_graph_mode_arms_no_trace(tmp_path):
    obs.set_context(mode=obs.GRAPH_MODE, save_graphs=1, save_graphs_path=str(tmp_path))
    assert not adapter.installed["modules"]


# -- obs.dump_graph ---------------------------------------------------------------------------------
def test_dump_graph_of_an_exported_program(tmp_path):
    obs.set_context(save_graphs_path=str(tmp_path))
    program = torch.export.export(Net(), (torch.randn(2, 4),))
    (path,) = obs.dump_graph(program, "net")
    assert path.startswith(str(tmp_path)) and path.endswith("_export_net.ir")
    ir = read_ir(path)
    params = {p.name: p for p in ir.main.params}
    assert {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"} <= set(params) and params["fc1.weight"].has_default
    assert [n.scope for n in ir.main.nodes if n.op.startswith("aten.linear")] == [
        "Default/net-Net/fc1-Linear/linear-op0", "Default/net-Net/fc2-Linear/linear-op1"]


def test_dump_graph_of_an_fx_module_follows_the_level(tmp_path):
    obs.set_context(save_graphs=3, save_graphs_path=str(tmp_path))
    written = obs.dump_graph(torch.fx.symbolic_trace(Net()), "traced")
    assert [os.path.relpath(p, tmp_path)[4:] for p in written if "verbose" not in p] == ["_fx_traced.ir",
                                                                                      "_fx_traced.dot"]
    with pytest.raises(TypeError, match=r"GraphModule or a torch\.export\.ExportedProgram"):
        obs.dump_graph(Net(), "x")


# -- RDR --------------------------------------------------------------------------------------------
def _enable_rdr(tmp_path):
    config = tmp_path / "rdr.json"
    config.write_text(json.dumps({"rdr": {"enable": True, "path": str(tmp_path / "rdr")}}))
    obs.set_context(env_config_path=str(config))


def test_bundles_hold_graphs_in_the_ir_grammar_at_level_0(tmp_path):
    _enable_rdr(tmp_path)
    obs.set_context(mode=obs.GRAPH_MODE)
    torch._dynamo.reset()
    obs.compile(Net(), backend="eager")(torch.randn(2, 4))
    bundle = load_bundle(obs.rdr.dump("manual"))
    assert len(bundle.graphs) == 1, bundle.graphs
    (graph,) = bundle.graphs
    ir = read_ir(graph)
    assert ir.attrs["stage"] == "dynamo_capture" and ir.main.nodes[0].scope == "Default/net-Net/fc1-Linear/linear-op0"
    assert not any(os.path.exists(os.path.join(tmp_path, f)) for f in ("0000_dynamo_capture_Net_0.ir",))


RDR_SCRIPT = """
import json, os, signal, sys, torch, obs
root = sys.argv[1]
with open(os.path.join(root, "rdr.json"), "w") as fh:
    json.dump({"rdr": {"enable": True, "path": os.path.join(root, "rdr")}}, fh)
obs.set_context(env_config_path=os.path.join(root, "rdr.json"), mode=obs.GRAPH_MODE)
model = obs.compile(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU()), backend="eager")
model(torch.randn(2, 4))
if sys.argv[2] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.slow
def test_a_recovered_bundle_has_the_graphs_and_a_clean_exit_leaves_none(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(RDR_SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(tmp_path), "kill"], capture_output=True, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr
    rank_dir = tmp_path / "rdr" / "rank_0" / "rdr"
    assert any(name.startswith("graphs_") for name in os.listdir(rank_dir))
    (bundle_path,) = obs.rdr.recover(str(tmp_path / "rdr"))
    (graph,) = load_bundle(bundle_path).graphs
    assert read_ir(graph).main.nodes[0].scope == "Default/net-Sequential/0-Linear/linear-op0"
    clean = tmp_path / "clean"
    clean.mkdir()
    done = subprocess.run([sys.executable, str(script), str(clean), "exit"], capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert not (clean / "rdr").exists(), (list(os.walk(clean)), done.stderr[-2000:])  # nothing to report: no folder


def test_env_config_graphs_section_and_its_hot_reload(tmp_path):
    from obs.features import env_config as env_feature

    config = tmp_path / "obs_config.json"
    config.write_text(json.dumps({"graphs": {"save_graphs": 1, "save_graphs_path": str(tmp_path / "g")}}))
    obs.set_context(env_config_path=str(config), mode=obs.GRAPH_MODE)
    assert (feature.level, feature.path) == (1, str(tmp_path / "g"))
    config.write_text(json.dumps({"graphs": {"save_graphs": 3, "save_graphs_path": str(tmp_path / "h")}}))
    assert env_feature.feature.wait_staged(lambda cfg: cfg.values["graphs"]["save_graphs"] == 3, 10) is not None
    assert feature.level == 1  # staged: applied at the next step boundary, on the training thread
    env_feature.feature.apply_pending()
    assert (feature.level, feature.path) == (3, str(tmp_path / "h")) and (tmp_path / "h").is_dir()
    obs.set_context(save_graphs=2)  # set_context wins over the file (unless it is 0: unset)
    assert feature.level == 2
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"graphs": {"save_graphs": 5}}))
    with pytest.raises(ValueError, match=r"graphs\.save_graphs.*bool or an int in \[0, 3\].*5"):
        obs.set_context(env_config_path=str(bad))


def test_a_loop_without_optimizer_step_is_traced_for_one_forward_and_backward(tmp_path):
    obs.set_context(save_graphs=1, save_graphs_path=str(tmp_path))
    net = Net()
    for _ in range(3):  # the update by hand, as some examples do: no optimizer.step(), no step end
        net.zero_grad()
        loss = torch.nn.MSELoss()(net(torch.randn(8, 4)), torch.zeros(8, 2))  # another top-level module: no end
        loss.backward()
        with torch.no_grad():
            for p in net.parameters():
                p.add_(p.grad, alpha=-0.1)
    # only step detection (graphs name their step) and the compile log (nothing while nothing compiles) stay
    assert [k for k, on in adapter.installed.items() if on] == ["steps", "compiles"], adapter.installed
    (name,) = [f for f in os.listdir(tmp_path) if f.endswith(".ir")]
    ops = [n.op for n in read_ir(str(tmp_path / name)).main.nodes]
    assert ops.count("aten.addmm") == 2 and ops.count("aten.add_.Tensor") == 4  # one forward, backward, update
