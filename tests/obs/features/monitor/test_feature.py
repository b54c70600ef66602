"""The monitor's applier and hooks: hot reload, its folder, msprobe's file and statistics, the loss from obs.scalar,
the step filters, msprobe's print_struct, nothing installed while off.  Small MLPs, a few steps each, in-process."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import threading

import pytest
import torch

import obs
from obs.features.env_config import feature as env_feature
from obs.features.monitor.feature import feature
from obs.features.monitor.reader import read_run
from tests.training import mlp

TIMEOUT = 30.0


def _train(steps, *, model=None, scalar=None):
    torch.manual_seed(0)
    model = model if model is not None else mlp(8, 8, 2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for n in range(steps):
        with obs.step():
            loss = model(torch.randn(4, 8)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            if scalar is not None:
                obs.scalar("loss", scalar(n, loss))
    return model


def _config(tmp_path, **monitor):
    path = tmp_path / "obs.json"
    path.write_text(json.dumps({"monitor": {"path": str(tmp_path / "out"), **monitor}}))
    return path


def _run():
    assert feature.monitor is not None and feature.monitor.flush(TIMEOUT)
    return read_run(feature.monitor.folder)


def test_off_installs_nothing(tmp_path):
    """With the section off there is no monitor, no optimizer hook and no worker thread."""
    from torch.optim import optimizer as torch_optimizer

    obs.set_context(env_config_path=str(_config(tmp_path, enable=False)))
    _train(2)
    assert feature.monitor is None
    hooks = [*torch_optimizer._global_optimizer_pre_hooks.values(),
             *torch_optimizer._global_optimizer_post_hooks.values()]
    assert not [h for h in hooks if getattr(h, "__qualname__", "").startswith("Collector.")]
    assert not any(t.name == "obs-monitor" for t in threading.enumerate())


def test_hot_reload_turns_it_on_at_a_step_boundary_and_off_again(tmp_path):
    path = _config(tmp_path, enable=False)
    obs.set_context(env_config_path=str(path))
    _train(1)
    path.write_text(json.dumps({"monitor": {"enable": True, "path": str(tmp_path / "out")}}))
    assert env_feature.wait_staged(lambda cfg: cfg.values["monitor"]["enable"], TIMEOUT)
    _train(3)
    run = _run()
    assert {s.prefix for s in run.series} == {"grad_reduced", "param_update", "update_ratio", "scalars"}
    assert run.steps == [0, 1, 2]
    worker = feature.monitor.worker._thread
    path.write_text(json.dumps({"monitor": {"enable": False}}))
    assert env_feature.wait_staged(lambda cfg: not cfg.values["monitor"]["enable"], TIMEOUT)
    _train(1)
    assert feature.monitor is None and not worker.is_alive()


def test_monitor_output_dir_wins_over_path(tmp_path, monkeypatch):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "env"))
    obs.set_context(env_config_path=str(_config(tmp_path, enable=True)))
    _train(1)
    assert feature.monitor.folder.startswith(str(tmp_path / "env") + "/")


def test_msprobes_file_statistics_and_moments(tmp_path, caplog):
    """A user's msprobe file: every statistic of ops for gradients, updates and Adam's moments, the shape and dtype
    columns; format tensorboard writes an event file beside the CSV files."""
    msprobe = tmp_path / "monitor_config.json"
    msprobe.write_text(json.dumps({"targets": {"": {}}, "wg_distribution": True, "ur_distribution": True,
                                   "mv_distribution": True, "format": "tensorboard", "ops": ["norm", "max", "nans"],
                                   "alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold":
                                                                                                    0.5}}]}}))
    caplog.set_level(logging.WARNING, logger="obs")
    obs.set_context(env_config_path=str(_config(tmp_path, enable=True, config_file=str(msprobe))))
    _train(3)
    run = _run()
    events = [n for n in os.listdir(feature.monitor.folder) if n.startswith("events.out.tfevents.")]
    if importlib.util.find_spec("tensorboardX") is not None:  # the test extra has it
        assert not caplog.text and events
    prefixes = {s.prefix for s in run.series}
    assert prefixes == {"grad_reduced", "param_update", "update_ratio", "exp_avg", "exp_avg_sq", "scalars"}
    folder = feature.monitor.folder
    for prefix in ("grad_reduced", "param_update", "exp_avg", "exp_avg_sq"):
        with open(f"{folder}/{prefix}_0-99.csv") as fh:
            assert fh.readline().strip() == "vpp_stage,name,step,norm,max,nans,shape,dtype"
    weight = next(s for s in run.series if (s.prefix, s.name, s.stat) == ("grad_reduced", "0.weight", "max"))
    assert len(weight.values) == 3 and all(v > 0 for v in weight.values)
    nans = next(s for s in run.series if (s.prefix, s.stat) == ("exp_avg_sq", "nans"))
    assert nans.values == (0.0, 0.0, 0.0)
    from obs.features.monitor.explain import explain
    from obs.features.monitor.plot import build_plot

    heatmaps = build_plot(run, explain(run)).heatmaps  # obs monitor plot: a heatmap per file, Adam's moments too
    assert [(h.prefix, h.kind, h.stat) for h in heatmaps] == [
        ("grad_reduced", "wg", "norm"), ("param_update", "ur", "norm"), ("update_ratio", "ur", "ratio"),
        ("exp_avg", "mv", "norm"), ("exp_avg_sq", "mv", "norm")]


def test_the_loss_given_to_obs_scalar_replaces_backwards(tmp_path):
    obs.set_context(env_config_path=str(_config(tmp_path, enable=True)))
    _train(3, scalar=lambda n, loss: 100.0 + n)
    loss = next(s for s in _run().series if s.name == "loss")
    assert loss.values == (100.0, 101.0, 102.0)


def test_step_filters_and_activations_of_a_pattern(tmp_path):
    """start_step, step_interval and collect_times as msprobe counts them; activations of the modules a pattern
    names, each call of the step its own micro_step."""
    obs.set_context(env_config_path=str(_config(tmp_path, enable=True, start_step=1, step_interval=2,
                                                collect_times=2, xy_distribution=True, targets={"[02]": {}})))
    _train(7)
    run = _run()
    assert run.steps == [1, 3]
    actv = sorted({s.name for s in run.series if s.prefix == "actv"})
    assert actv == ["0.input", "0.output", "2.input", "2.output"]


def test_format_api_writes_nothing_and_still_judges(tmp_path):
    obs.set_context(env_config_path=str(_config(tmp_path, enable=True, format="api", warmup=0)))
    _train(2)
    assert feature.monitor.folder is None and feature.monitor.flush(TIMEOUT)
    assert not (tmp_path / "out").exists()


def test_module_ranks_leave_other_ranks_alone(tmp_path):
    obs.set_context(env_config_path=str(_config(tmp_path, enable=True, module_ranks=[1])))
    _train(1)
    assert feature.monitor is None


def test_print_struct_writes_the_structure_and_training_goes_on(tmp_path):
    obs.set_context(env_config_path=str(_config(tmp_path, enable=True, print_struct=True)))
    _train(2)
    _run()
    with open(f"{feature.monitor.folder}/module_struct.json") as fh:
        struct = json.load(fh)
    assert struct["0"]["input"] == {"config": "tuple[1]", "0": "size=(4, 8), dtype=torch.float32"}
    assert struct[""]["output"]["config"] == "tensor"


@pytest.mark.parametrize("grads", [False, True])
def test_parameters_without_gradients_are_left_out(tmp_path, grads):
    obs.set_context(env_config_path=str(_config(tmp_path, enable=True)))
    model = mlp(8, 8, 2)
    model[0].weight.requires_grad_(grads)
    _train(2, model=model)
    names = {s.name for s in _run().series if s.prefix == "grad_reduced"}
    assert ("0.weight" in names) is grads and "2.weight" in names


def test_sampled_update_norms_agree_with_exact_ones(tmp_path):
    """A large parameter's update norm from a strided sample of 1,024 of its 8,192 elements, scaled to the whole, and
    its ratio, are within a few percent of the exact ones; small parameters are exact either way."""
    got = {}
    for sample in (0, 1024):
        obs.set_context(env_config_path=str(_config(tmp_path, enable=True, update_sample=sample)))
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 2))
        _train(3, model=model)
        got[sample] = {(s.prefix, s.name): s.values for s in _run().series if s.prefix in ("param_update",
                                                                                             "update_ratio")}
        obs.reset_context()
    exact, sampled = got[0], got[1024]
    assert exact.keys() == sampled.keys()
    for key in exact:
        assert sampled[key] == pytest.approx(exact[key], rel=0.1 if key[1].endswith("weight") else 1e-6), key


def test_an_anomaly_is_a_marker_in_the_rdr_ring(tmp_path):
    """With the recorder on, each reported anomaly is a marker event: a bundle shows it."""
    from recorder.bundle_reader import load_bundle

    path = tmp_path / "obs.json"
    path.write_text(json.dumps({"monitor": {"enable": True, "path": str(tmp_path / "out"), "warmup": 5,
                                            "xy_distribution": True, "targets": {"0": {}}},
                                "rdr": {"enable": True, "path": str(tmp_path / "rdr"), "granularity": "step"}}))
    obs.set_context(env_config_path=str(path))
    torch.manual_seed(0)
    model = mlp(8, 8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for n in range(12):
        model(torch.randn(4, 8) * (1e3 if n == 10 else 1.0)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    assert feature.monitor.flush(TIMEOUT)
    bundle = load_bundle(obs.rdr.dump("check"))
    markers = [e for e in bundle.events({"marker"}) if e.get("marker") == "anomaly"]
    assert markers and markers[0]["monitor_step"] == 10 and markers[0]["monitor_kind"] == "xy"
    assert markers[0]["tensor"] == "0.input"


def test_config_check_says_what_the_monitor_turns_on(tmp_path, capsys):
    from obs.cli import main

    path = _config(tmp_path, enable=True, xy_distribution=True)
    assert main(["config", "check", str(path)]) == 0
    assert f"training-health monitor ON: gradient and update norms, update ratios, loss + activations; CSV files " \
           f"under {tmp_path / 'out'}/" in capsys.readouterr().out


def test_a_bfloat16_models_updates_are_measured_in_float32(tmp_path):
    """The value before the step is kept in float32: the update norm is the exact difference of the bf16 values."""
    obs.set_context(env_config_path=str(_config(tmp_path, enable=True, update_sample=0)))
    torch.manual_seed(0)
    model = mlp(8, 8, 2).to(torch.bfloat16)
    before = model[0].weight.detach().float().clone()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8, dtype=torch.bfloat16)).float().pow(2).mean().backward()
    opt.step()
    exact = float((model[0].weight.detach().float() - before).norm())
    update = next(s for s in _run().series if (s.prefix, s.name) == ("param_update", "0.weight"))
    assert exact > 0 and update.values[0] == pytest.approx(exact, rel=1e-5)
