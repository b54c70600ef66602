"""The monitor's collectives (msprobe's ``cc_distribution``): per call statistics before and after each collective,
msprobe's ``other`` file, async calls at their wait, cc_codeline, cc_log_only, msprobe's example configs, the
originals back at a hot reload off, the same losses, and a spike of a collective explained in its causal place.
In-process, on a single-rank gloo group (world size 1: every collective runs for real on the CPU)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

import obs
from obs.features.env_config import feature as env_feature
from obs.features.monitor.cc_calls import OPS, call_stack
from obs.features.monitor.feature import feature
from obs.features.monitor.reader import read_run
from obs.features.monitor.tensorboard import tag_of
from tests.obs.cli.test_cli import obs_cli
from tests.obs.runtime.test_collectives import _compiled_counters

TIMEOUT = 30.0
OPS_ALL = ["norm", "min", "max", "mean", "zeros", "nans"]
#: msprobe's unittest configs, as they are (monitor/unittest/config_cc_codeline_ranks.json, config_cc_logonly.json)
MSPROBE_CODELINE = {"targets": {"foo": {}}, "module_ranks": [1], "ops": ["max", "min", "norm", "zeros"],
                    "cc_distribution": {"enable": True, "cc_codeline": ["monitor/unittest/test_cc_codeline_ranks.py"
                                                                        "\\[19\\]"]}}
MSPROBE_LOGONLY = {"targets": {"foo": {}}, "cc_distribution": {"enable": True, "cc_log_only": True},
                   "module_ranks": [0, 1], "ops": ["max", "min", "norm", "zeros"]}


@pytest.fixture(scope="module", autouse=True)
def group(tmp_path_factory):
    """One single-rank gloo group for the module's tests, gone after them."""
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _originals():
    return {n: (getattr(dist, n), getattr(c10d, n)) for n in OPS} | {"wait": dist.Work.wait}


def _train(steps, spike=None):
    """A small model; each step an in-place all_reduce of the gradients (sync), the loss's all_reduce (async, waited)
    and an all_gather; the gathered value ×1e3 at step ``spike`` (it does not touch the model).  The losses."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for s in range(steps):
        with obs.step():
            loss = model(torch.randn(4, 8)).pow(2).mean()
            loss.backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
            mean = loss.detach().clone()
            dist.all_reduce(mean, async_op=True).wait()
            gathered = [torch.empty(3)]
            value = torch.tensor([1.0, 2.0, 3.0 + s % 3]) * (1e3 if s == spike else 1.0)
            dist.all_gather(gathered, value) if s % 2 else dist.all_gather(tensor=value, tensor_list=gathered)
            opt.step()
            opt.zero_grad()
            losses.append(mean.item())
    return losses


def _config(tmp_path, name="obs.json", **monitor):
    path = tmp_path / name
    path.write_text(json.dumps({"monitor": {"path": str(tmp_path / "out"), **monitor}}))
    return path


def _run():
    assert feature.monitor is not None and feature.monitor.flush(TIMEOUT)
    return read_run(feature.monitor.folder)


def _reference(t, ops):
    t = t.detach().float()
    table = {"norm": torch.linalg.vector_norm(t), "min": t.min(), "max": t.max(), "mean": t.mean(),
             "zeros": (t.abs() < 1e-8).float().mean(), "nans": t.isnan().sum().float()}
    return [float(table[op]) for op in ops]


def test_per_call_statistics_in_msprobes_other_file_and_the_same_losses(tmp_path):
    """Every call of a step: pre and post rows of each tensor argument (no pre row of all_gather's output list: it is
    not written yet), named by the argument's place in the signature whether given by position or keyword, the call
    within the step as micro_step, the async all_reduce's post taken at its wait; the values are those of the
    tensors; the losses are those without the monitor, bit for bit."""
    plain = _train(3)
    obs.set_context(env_config_path=str(_config(tmp_path, enable=True, ops=OPS_ALL,
                                                 cc_distribution={"enable": True, "cc_pre_hook": True})))
    watched = _train(3)
    assert watched == plain
    run = _run()
    cc = [s for s in run.series if s.prefix == "other"]
    assert {(s.kind, s.stage) for s in cc} == {("cc", "communication")}
    keys = {(s.name, s.micro) for s in cc}
    assert keys == {(f"all_reduce/{side}_0", call) for side in ("pre", "post") for call in range(5)} | {
        ("all_gather/pre_1", 0), ("all_gather/post_0", 0), ("all_gather/post_1", 0)}
    assert all(s.steps == (0, 1, 2) for s in cc)
    with open(feature.monitor.folder + "/other_0-99.csv") as fh:
        lines = fh.read().splitlines()
    assert lines[0] == "vpp_stage,name,step,micro_step," + ",".join(OPS_ALL) + ",shape,dtype"
    # step 2's all_gather: its input (argument 1) and its output list (argument 0, one tensor of 3), after the call
    by = {(s.name, s.micro, s.stat): dict(zip(s.steps, s.values)) for s in cc}
    for step, last in ((1, 4.0), (2, 5.0)):  # by position, by keyword
        want = _reference(torch.tensor([1.0, 2.0, last]), OPS_ALL)
        for row in ("all_gather/post_0", "all_gather/post_1", "all_gather/pre_1"):
            assert [by[(row, 0, op)][step] for op in OPS_ALL] == pytest.approx(want, rel=1e-5)
    assert any('all_gather/post_0,2,0,' in line and '"[1, 3]",torch.float32' in line for line in lines)
    # the loss's async all_reduce (call 4 of the step) after its wait: the loss itself (world size 1)
    assert [by[("all_reduce/post_0", 4, "max")][s] for s in range(3)] == pytest.approx(plain, rel=1e-6)


def test_off_patches_nothing_and_a_hot_reload_off_restores_the_originals(tmp_path):
    """cc_distribution off: torch.distributed's functions and Work.wait are its own; on: wrapped under both names;
    a hot reload off puts the very same objects back."""
    before = _originals()
    path = _config(tmp_path, enable=True)
    obs.set_context(env_config_path=str(path))
    _train(1)
    assert _originals() == before and feature.monitor.cc is None
    path.write_text(json.dumps({"monitor": {"enable": True, "path": str(tmp_path / "out"),
                                            "cc_distribution": {"enable": True}}}))
    assert env_feature.wait_staged(lambda cfg: cfg.values["monitor"].get("cc_distribution", {}).get("enable"),
                                   TIMEOUT)
    _train(2)
    assert feature.monitor.cc is not None
    wrapped = _originals()
    assert all(wrapped[n][0] is not before[n][0] and wrapped[n][0] is wrapped[n][1] for n in OPS)
    assert wrapped["wait"] is not before["wait"]
    assert {s.name for s in _run().series if s.prefix == "other"} == {"all_reduce/post_0", "all_gather/post_0",
                                                                        "all_gather/post_1"}
    path.write_text(json.dumps({"monitor": {"enable": False}}))
    assert env_feature.wait_staged(lambda cfg: not cfg.values["monitor"]["enable"], TIMEOUT)
    _train(1)
    assert feature.monitor is None
    after = _originals()
    assert all(after[n][0] is before[n][0] and after[n][1] is before[n][1] for n in OPS)
    assert after["wait"] is before["wait"]


def test_cc_codeline_keeps_the_calls_of_matching_call_sites(tmp_path):
    """A regex of the call stack (msprobe's ``path[line]   function`` lines, ';'-joined): only the all_gather's line.
    Targets that match no parameter (msprobe's example "foo"): the collectives' rows still come, in their own
    packet."""
    with open(__file__) as fh:
        line = next(i for i, text in enumerate(fh.read().splitlines(), 1) if "dist.all_gather(gathered" in text)
    obs.set_context(env_config_path=str(_config(tmp_path, enable=True, targets={"foo": {}}, cc_distribution={
        "enable": True, "cc_codeline": [rf"test_collectives\.py\[{line}\]"]})))
    _train(2)
    run = _run()
    assert {s.name for s in run.series if s.prefix == "other"} == {"all_gather/post_0", "all_gather/post_1"}
    assert run.steps == [0, 1] and not [s for s in run.series if s.prefix == "grad_reduced"]
    stack = call_stack()
    assert stack[0].endswith("test_cc_codeline_keeps_the_calls_of_matching_call_sites")
    assert "test_collectives.py[" in stack[0]


def test_msprobes_example_configs_are_accepted(tmp_path, caplog, capsys):
    """msprobe's cc unittest configs as config_file: module_ranks [1] leaves rank 0 alone; cc_log_only writes
    msprobe's list of each collective's call sites (dtypes, the group's ranks, the stack) once, no statistics, and
    training goes on."""
    msprobe = tmp_path / "config_cc_codeline_ranks.json"
    msprobe.write_text(json.dumps(MSPROBE_CODELINE))
    before = _originals()
    obs.set_context(env_config_path=str(_config(tmp_path, enable=True, config_file=str(msprobe))))
    _train(1)
    assert feature.monitor is None and _originals() == before  # rank 0 is not one of module_ranks
    msprobe = tmp_path / "config_cc_logonly.json"
    msprobe.write_text(json.dumps(MSPROBE_LOGONLY))
    from obs.cli import main

    assert main(["config", "check", str(_config(tmp_path, "logonly.json", enable=True, config_file=str(msprobe)))]) == 0
    assert "loss + the call sites of collectives (cc_log_only);" in capsys.readouterr().out
    obs.set_context(env_config_path=str(_config(tmp_path, "logonly.json", enable=True, config_file=str(msprobe))))
    caplog.set_level("INFO", logger="obs")
    losses = _train(3)
    assert len(losses) == 3
    run = _run()
    assert not [s for s in run.series if s.prefix == "other"]
    with open(feature.monitor.folder + "/cc_log.json") as fh:
        logged = json.load(fh)
    assert sorted(logged) == ["all_gather", "all_reduce"]
    gather = logged["all_gather"]
    assert len(gather) == 1 and gather[0][:2] == ["torch.float32|", "0"]  # step 0's by keyword: tensor, tensor_list
    assert "test_collectives.py[" in gather[0][2] and gather[0][2].endswith("   _train")
    assert {e[0] for e in logged["all_reduce"]} == {"torch.float32", "torch.float32|"}  # sync; async (async_op)
    assert "cc_log_only: 2 collective(s) at 3 call site(s)" in caplog.text


def test_a_collectives_spike_is_explained_after_backward_and_before_the_optimizer(tmp_path):
    """The all_gather's value ×1e3 at step 24: the first anomaly is kind cc, stage communication, at 24 in explain
    --json, of the run and of an RDR bundle (the recorder on, its own collective wrappers with the monitor's); show
    names it; the plot has its collectives heatmap; the TensorBoard tag is msprobe's; at the end torch's own
    functions are back."""
    from obs.features.monitor.explain import _STAGE
    from recorder.bundle_reader import load_bundle

    before = _originals()
    path = tmp_path / "obs.json"
    path.write_text(json.dumps({"monitor": {"enable": True, "path": str(tmp_path / "out"),
                                            "cc_distribution": {"enable": True}},
                                "rdr": {"enable": True, "path": str(tmp_path / "rdr"), "granularity": "step"}}))
    obs.set_context(env_config_path=str(path))
    losses = _train(30, spike=24)
    folder = feature.monitor.folder
    assert feature.monitor.flush(TIMEOUT)
    bundle = obs.rdr.dump("check")
    obs.reset_context()
    assert _originals() == before
    assert losses == _train(30, spike=24)
    markers = [e for e in load_bundle(bundle).events({"marker"}) if e.get("marker") == "anomaly"]
    assert markers and (markers[0]["monitor_step"], markers[0]["monitor_kind"]) == (24, "cc")
    result = obs_cli("monitor", "explain", bundle, "--json")
    assert result.returncode == 1, result.stderr
    assert json.loads(result.stdout)["first"]["kind"] == "cc"
    result = obs_cli("monitor", "explain", folder, "--json")
    assert result.returncode == 1, result.stderr
    doc = json.loads(result.stdout)
    first = doc["first"]
    assert (first["step"], first["kind"], first["stage"], first["name"]) == (24, "cc", "communication",
                                                                             "all_gather/post_0")
    assert math.isfinite(first["value"]) and first["value"] > 100 * first["baseline"]
    assert _STAGE["backward"] < _STAGE["communication"] < _STAGE["optimizer"]
    result = obs_cli("monitor", "show", folder, "--json", "--top", "2")
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    top = shown["series"][0]
    assert (top["kind"], top["peak_step"], top["micro_step"]) == ("cc", 24, 0)
    from obs.features.monitor.explain import explain
    from obs.features.monitor.plot import build_plot

    run = read_run(folder)
    plot = build_plot(run, explain(run))
    assert any(h.prefix == "other" and h.title.startswith("collectives") for h in plot.heatmaps)
    assert tag_of("other", "all_reduce/post_0", 0, "norm", 3) == "all_reduce/rank3/post_0_norm"
    assert tag_of("other", "all_reduce/pre_1", 2, "max", None) == "all_reduce.call2/pre_1_max"


def test_a_compiled_collective_compiles_as_without_the_monitor(tmp_path):
    """A collective traced by Dynamo is torch's own: the same graphs, no graph break, with cc on."""
    plain = _compiled_counters()
    obs.set_context(env_config_path=str(_config(tmp_path, enable=True, cc_distribution={"enable": True,
                                                                                         "cc_pre_hook": True})))
    assert _compiled_counters() == plain
    assert plain["stats"]["unique_graphs"] == 1 and not plain["graph_break"]
