"""The data dump's iterations and the steps of obs's other records (NaN check, exception dump, STEP_BEGIN): iteration N
is step N + 1 - initial_iteration; the reader and `obs dump ls` show both where they meet."""

from __future__ import annotations

import json

import pytest
import torch

import obs
from obs.features.dump import DumpReader
from obs.runtime.steps import tracker
from tests.obs.cli.test_cli import obs_cli
from tests.obs.features.dump.nan.test_check import Net

COMMON = {"dump_mode": 0, "net_name": "Net", "iteration": "all", "saved_data": "statistic", "input_output": 0,
          "kernels": [], "support_device": [0], "statistic_category": ["max", "nan count"]}


def train_poisoned_at(steps, poisoned_step):
    """``steps`` training steps; the Poison module makes NaN in step ``poisoned_step`` (counted from 1).  Returns
    the numbers STEP_BEGIN announced."""
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)  # ends each step; the net keeps its weights
    began = []
    with obs.subscribe(obs.Event.STEP_BEGIN, began.append):
        for n in range(1, steps + 1):
            net.poison.forward_nan = n == poisoned_step
            net(torch.randn(3, 4))
            opt.step()
    obs.reset_context()
    tracker.reset()
    return began


def nan_rows(reader, iteration):
    return [r.op_name for r in reader.statistics(iteration) if r.stats["nan count"]]


def test_iteration_n_is_step_n_plus_1_and_ls_shows_both(tmp_path):
    root = tmp_path / "dump"
    cfg = {"dump": {"common_dump_settings": {**COMMON, "path": str(root)}},
           "nan_check": {"enable": True, "path": str(root), "backward": False}}
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    obs.set_context(env_config_path=str(tmp_path / "cfg.json"))
    assert train_poisoned_at(3, poisoned_step=2) == [1, 2, 3]
    reader = DumpReader(str(root))
    assert [(s.iteration, s.training_step) for s in reader.steps()] == [(0, 1), (1, 2), (2, 3)]
    [fault] = reader.fault_folders()
    assert (fault.kind, fault.meta["step"], fault.iteration) == ("nan_check", 2, 1)
    # the NaN the check found in step 2 is in the data dump's iteration 1, and in no other
    assert nan_rows(reader, 0) == [] and nan_rows(reader, 2) == []
    assert nan_rows(reader, 1)[0].startswith("Default_net-Net_poison-Poison_Log")
    result = obs_cli("dump", "ls", str(root), "--json")
    assert result.returncode == 0, result.stderr
    listing = json.loads(result.stdout)
    assert [(s["iteration"], s["step"]) for s in listing["steps"]] == [(0, 1), (1, 2), (2, 3)]
    assert [(c["step"], c["iteration"]) for c in listing["fault_folders"]] == [(2, 1)]
    assert listing["captures"] == listing["fault_folders"]  # the former name, kept
    result = obs_cli("dump", "ls", str(root))
    assert result.returncode == 0, result.stderr
    assert "iteration N is step N + 1 - initial_iteration" in " ".join(result.stdout.split())


def test_initial_iteration_shifts_the_iterations_not_the_steps(tmp_path, monkeypatch):
    root = tmp_path / "dump"
    (tmp_path / "dump.json").write_text(json.dumps({"common_dump_settings": {**COMMON, "path": str(root),
                                                                             "initial_iteration": 5}}))
    monkeypatch.setenv("MINDSPORE_DUMP_CONFIG", str(tmp_path / "dump.json"))
    (tmp_path / "cfg.json").write_text(json.dumps({"nan_check": {"enable": True, "path": str(root),
                                                                 "backward": False}}))
    obs.set_context(env_config_path=str(tmp_path / "cfg.json"))
    assert train_poisoned_at(2, poisoned_step=2) == [1, 2]
    reader = DumpReader(str(root))
    assert [(s.iteration, s.training_step) for s in reader.steps()] == [(5, 1), (6, 2)]
    assert [(c.meta["step"], c.iteration) for c in reader.fault_folders()] == [(2, 6)]
    assert nan_rows(reader, 5) == [] and nan_rows(reader, 6)
    # one iteration folder read alone knows its step too
    assert [s.training_step for s in DumpReader(reader.steps()[1].path).steps()] == [2]


def test_fault_folders_without_a_data_dump_beside_them_name_no_iteration(tmp_path):
    (tmp_path / "cfg.json").write_text(json.dumps({"nan_check": {"enable": True, "path": str(tmp_path)}}))
    obs.set_context(env_config_path=str(tmp_path / "cfg.json"))
    train_poisoned_at(1, poisoned_step=1)
    reader = DumpReader(str(tmp_path))
    [fault] = reader.fault_folders()
    assert fault.meta["step"] == 1 and fault.iteration is None
    assert reader.captures() == [fault]  # the former name, kept
    result = obs_cli("dump", "ls", str(tmp_path))
    [header] = [line for line in result.stdout.splitlines() if "kind" in line]
    assert result.returncode == 0 and "step" in header and "iteration" not in header


@pytest.mark.parametrize("metadata", [None, "{not json", '{"common_dump_settings": {"initial_iteration": true}}'])
def test_without_readable_metadata_the_step_is_unknown(tmp_path, metadata):
    step_dir = tmp_path / "rank_0" / "Net" / "0" / "3"
    step_dir.mkdir(parents=True)
    (step_dir / "statistic.csv").write_text("Op Type,Op Name,Task ID,Stream ID,Timestamp,IO,Slot,Data Size,"
                                            "Data Type,Shape\n")
    if metadata is not None:
        (tmp_path / "rank_0" / ".dump_metadata").mkdir()
        (tmp_path / "rank_0" / ".dump_metadata" / "data_dump.json").write_text(metadata)
    [step] = DumpReader(str(tmp_path)).steps()
    assert (step.iteration, step.training_step) == (3, None)
    result = obs_cli("dump", "ls", str(tmp_path), "--json")
    assert json.loads(result.stdout)["steps"][0]["step"] is None
