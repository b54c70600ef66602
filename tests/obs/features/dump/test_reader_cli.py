"""DumpReader, statistic.csv reader, and `obs dump ls / stats / diff` on real dumps (the CLI in this process; `obs run`
as a real one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import obs
from obs._core.errors import DamagedFileError, NotOurFileError
from obs.features.dump import DumpReader
from obs.features.dump.diff import diff_dumps
from obs.features.dump.reader import read_statistic_csv
from obs.runtime.steps import tracker
from tests.obs.cli.test_cli import obs_cli
from tests.obs.features.dump.test_data_dump import Net


def dump_config(root, saved):
    """An env config beside ``root`` whose data dump (every iteration, ``saved``: statistic, tensor or full) goes
    to ``root``; its path."""
    cfg = {"dump": {"common_dump_settings": {
        "dump_mode": 0, "path": str(root), "net_name": "Net", "iteration": "all", "saved_data": saved,
        "input_output": 0, "kernels": [], "support_device": [0],
        "statistic_category": ["max", "min", "avg", "nan count", "l2norm"]}}}
    root.parent.mkdir(parents=True, exist_ok=True)
    path = root.parent / f"{root.name}.json"
    path.write_text(json.dumps(cfg))
    return path


def dump_run(root, *, saved="full", steps=2, plant=None, seed=0):
    path = dump_config(root, saved)
    torch.manual_seed(seed)
    net = Net()
    if plant is not None:
        with torch.no_grad():
            plant(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    data = [torch.randn(3, 4) for _ in range(steps)]
    obs.set_context(env_config_path=str(path))
    for x in data:
        net(x).sum().backward()
        opt.step()
        opt.zero_grad()
    obs.reset_context()
    tracker.reset()
    return root


class _without_parameters:  # noqa: N801 - a reader view for the test
    """A DumpReader whose statistics skip the Parameter rows."""

    def __init__(self, reader):
        self._reader = reader

    def steps(self):
        return self._reader.steps()

    def statistics(self, step=None):
        return (r for r in self._reader.statistics(step) if r.op_type != "Parameter")

    def tensors(self, step=None):
        return (t for t in self._reader.tensors(step) if t.op_type != "Parameter")


def test_reader_iterates_steps_ops_tensors_and_statistics(tmp_path):
    root = dump_run(tmp_path / "a")
    reader = DumpReader(str(root))
    assert [(s.rank, s.net, s.graph, s.iteration) for s in reader.steps()] == [(0, "Net", 0, 0), (0, "Net", 0, 1)]
    first = reader.steps()[0]
    tensors = list(reader.tensors(first))
    rows = list(reader.statistics(first))
    assert len(tensors) == len(rows) > 20
    assert [(t.op_name, t.io, t.slot) for t in tensors] == [(r.op_name, r.io, r.slot) for r in rows]
    addmm_out = next(t for t in tensors if t.op_name == "Default_net-Net_fc1-Linear_Addmm-op1" and t.io == "output")
    row = next(r for r in rows if (r.op_name, r.io) == (addmm_out.op_name, "output"))
    array = addmm_out.load()
    assert row.shape == array.shape == (3, 8) and row.data_type == "float32" and row.data_size == 96
    assert row.stats["max"] == pytest.approx(float(array.max())) and row.stats["nan count"] == 0
    assert row.stats["l2norm"] == pytest.approx(float(np.linalg.norm(array)), rel=1e-5)
    assert reader.select("fc2.*Addmm", io="output", iterations=[1])[0].step.iteration == 1
    assert reader.execution_order()[1] == "Default/net-Net/fc1-Linear/Addmm-op1"
    # an iteration folder alone is a dump too
    assert [s.iteration for s in DumpReader(first.path).steps()] == [0]


def test_reader_errors(tmp_path):
    with pytest.raises(NotOurFileError, match="no data dump here"):
        DumpReader(str(tmp_path))
    bad = tmp_path / "statistic.csv"
    head, good = ("Op Type,Op Name,Task ID,Stream ID,Timestamp,IO,Slot,Data Size,Data Type,Shape,Max Value\n",
                  "Relu,x,0,0,1,input,0,4,float32,\"(1)\",1.5\n")
    bad.write_text(head + good + "Relu,x,0,0,1,sideways,0,4,float32,\"(1)\",1.5\n")
    offset = len(head) + len(good)
    with pytest.raises(DamagedFileError, match=f"bad row at byte offset {offset}: IO 'sideways'") as info:
        read_statistic_csv(str(bad))
    assert info.value.offset == offset and info.value.path == str(bad)
    bad.write_text("a,b\n")
    with pytest.raises(NotOurFileError, match=r"not a statistic\.csv"):
        read_statistic_csv(str(bad))


def test_diff_finds_a_planted_divergence_and_none_between_equal_runs(tmp_path):
    a = dump_run(tmp_path / "a")
    b = dump_run(tmp_path / "b")
    c = dump_run(tmp_path / "c", plant=lambda net: net.fc2.weight.mul_(1.01))
    same = diff_dumps(DumpReader(str(a)), DumpReader(str(b)))
    # both runs dumped tensors (saved_data "full"): compared value by value, not by their statistics
    assert same.first is None and same.mode == "tensors" and same.compared > 50
    found = diff_dumps(DumpReader(str(a)), DumpReader(str(c))).first
    # the planted weight itself (its Parameter row), then the first op that reads it
    assert (found.iteration, found.op_type, found.op_name, found.what) == (0, "Parameter", "fc2_weight", "values")
    statistics = diff_dumps(DumpReader(str(dump_run(tmp_path / "sa", saved="statistic"))),
                            DumpReader(str(dump_run(tmp_path / "sc", saved="statistic",
                                                    plant=lambda net: net.fc2.weight.mul_(1.01)))))
    assert statistics.mode == "statistics" and (statistics.first.op_name, statistics.first.what) == ("fc2_weight",
                                                                                                     "max")
    rows_without_parameters = diff_dumps(*(_without_parameters(DumpReader(str(p))) for p in (a, c))).first
    assert (rows_without_parameters.op_name, rows_without_parameters.io) == ("Default_net-Net_fc2-Linear_T-op4",
                                                                             "input")
    # tensors only: compared value by value
    ta, tc = dump_run(tmp_path / "ta", saved="tensor"), dump_run(tmp_path / "tc", saved="tensor",
                                                                   plant=lambda net: net.fc2.bias.add_(1e-3))
    found = diff_dumps(DumpReader(str(ta)), DumpReader(str(tc)))
    assert found.mode == "tensors" and (found.first.op_type, found.first.op_name) == ("Parameter", "fc2_bias")
    assert (found.first.io, found.first.slot, found.first.what) == ("output", 0, "values")
    found = diff_dumps(_without_parameters(DumpReader(str(ta))), _without_parameters(DumpReader(str(tc)))).first
    assert (found.op_name, found.io, found.slot) == ("Default_net-Net_fc2-Linear_Addmm-op5", "input", 0)


def test_cli_ls_stats_diff(tmp_path):
    a = dump_run(tmp_path / "a")
    c = dump_run(tmp_path / "c", plant=lambda net: net.fc1.bias.add_(0.5))
    result = obs_cli("dump", "ls", str(a), "--json")
    assert result.returncode == 0, result.stderr
    listing = json.loads(result.stdout)
    assert [s["iteration"] for s in listing["steps"]] == [0, 1] and all(s["statistic_csv"] for s in listing["steps"])
    result = obs_cli("dump", "stats", str(a), "--op", "Relu", "--iteration", "1", "--json")
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert result.returncode == 0 and {r["op_type"] for r in lines} == {"Relu"}
    assert {r["iteration"] for r in lines} == {1}
    result = obs_cli("dump", "stats", str(a), "--op", "Relu")
    assert result.returncode == 0 and "Default_net-Net_fc1-Linear" not in result.stdout and "Relu" in result.stdout
    result = obs_cli("dump", "diff", str(a), str(c))
    assert result.returncode == 1 and "first divergence" in result.stdout
    assert "fc1_bias" in result.stdout and "Parameter" in result.stdout
    result = obs_cli("dump", "diff", str(a), str(a), "--json")
    assert result.returncode == 0 and json.loads(result.stdout)["diverged"] is False
    result = obs_cli("dump", "ls", str(tmp_path / "nothing-here"))
    assert result.returncode == 2 and "no such folder" in result.stderr
    result = obs_cli("dump", "stats", str(a), "--op", "(")
    assert result.returncode == 2


def test_cli_ls_lists_exception_fault_folders(tmp_path):
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"exception_dump": {"enable": True, "path": str(tmp_path)}}))
    obs.set_context(env_config_path=str(cfg))
    with pytest.raises(RuntimeError):
        Net()(torch.randn(2, 5))
    result = obs_cli("dump", "ls", str(tmp_path), "--json")
    assert result.returncode == 0, result.stderr
    [fault] = json.loads(result.stdout)["fault_folders"]
    assert fault["kind"] == "exception_dump" and fault["scope"] == "Default/net-Net/fc1-Linear"


def test_config_check_validates_a_dump_config(tmp_path):
    good = tmp_path / "dump.json"
    good.write_text(json.dumps({"common_dump_settings": {
        "dump_mode": 1, "path": str(tmp_path), "net_name": "Net", "iteration": "0|5-8", "input_output": 0,
        "kernels": ["relu"], "support_device": [0]}}))
    result = obs_cli("config", "check", str(good), "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["kind"] == "dump" and data["valid"] and "iterations 0|5-8" in data["turns_on"][0]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"common_dump_settings": {"dump_mode": 0, "path": str(tmp_path), "net_name": "N",
                                                        "iteration": "5-2", "input_output": 7, "kernels": [],
                                                        "support_device": [0]}}))
    result = obs_cli("config", "check", str(bad))
    assert result.returncode == 1
    assert "the part \"5-2\" is reversed" in result.stderr and "'common_dump_settings.input_output'" in result.stderr


def test_obs_run_reads_the_dump_config_variable(tmp_path):
    cfg = tmp_path / "dump.json"
    cfg.write_text(json.dumps({"common_dump_settings": {
        "dump_mode": 0, "path": str(tmp_path / "out"), "net_name": "Tiny", "iteration": "1", "saved_data": "statistic",
        "input_output": 2, "kernels": [], "support_device": [0]}}))
    script = tmp_path / "train.py"
    script.write_text("import torch\nnet = torch.nn.Linear(3, 1)\nopt = torch.optim.SGD(net.parameters(), lr=0.1)\n"
                      "for _ in range(3):\n    net(torch.randn(2, 3)).sum().backward(); opt.step(); opt.zero_grad()\n")
    env = {**os.environ, "MINDSPORE_DUMP_CONFIG": str(cfg)}
    result = subprocess.run([sys.executable, "-m", "obs", "run", str(script)], capture_output=True, text=True,
                            env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "wrote data dump" in result.stderr
    reader = DumpReader(str(tmp_path / "out"))
    assert [s.iteration for s in reader.steps()] == [1]
    assert {r.io for r in reader.statistics()} == {"output"}


def test_reader_takes_an_iteration_number_where_it_takes_a_step(tmp_path):
    reader = DumpReader(str(dump_run(tmp_path / "a")))
    second = reader.steps()[1]
    assert [t.path for t in reader.tensors(1)] == [t.path for t in reader.tensors(second)]
    assert list(reader.statistics(1)) == list(reader.statistics(second)) != []
    assert [t.path for t in reader.tensors(np.int64(0))] == [t.path for t in reader.tensors(reader.steps()[0])]
    with pytest.raises(ValueError, match=r"no iteration 7 in .*: its iterations are \[0, 1\]"):
        reader.tensors(7)  # at the call, not at the first next()
    with pytest.raises(ValueError, match=r"no iteration 7 .*\[0, 1\]"):
        reader.statistics(7)
    with pytest.raises(TypeError, match="an iteration number"):
        reader.tensors("1")
    with pytest.raises(TypeError, match="an iteration number"):
        reader.tensors(True)
