"""Data dump: iteration ranges, kernels, input_output and saved_data give exactly the expected files."""

from __future__ import annotations

import csv
import json
import os
import re

import numpy as np
import pytest
import torch

import obs
from obs.runtime.steps import tracker
from obs.settings.dump_config import DumpConfigError

# Every test with statistic.csv rows from the C++ recorder and from Python (tests/conftest.py).
pytestmark = [pytest.mark.native("DUMP"), pytest.mark.usefixtures("native_path")]


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.fc2 = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def settings(tmp_path, **common):
    body = {"dump_mode": 0, "path": str(tmp_path / "dump"), "net_name": "Net", "iteration": "all",
            "saved_data": "tensor", "input_output": 0, "kernels": [], "support_device": [0], **common}
    return {"common_dump_settings": body, "e2e_dump_settings": {"enable": True}}


def run(tmp_path, steps=1, via="env", **common):
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = settings(tmp_path, **common)
    if via == "env":
        path = tmp_path / "dump.json"
        path.write_text(json.dumps(cfg))
        os.environ["OBS_DUMP_CONFIG"] = str(path)
        try:
            obs.set_context(op_timeout=300)
        finally:
            del os.environ["OBS_DUMP_CONFIG"]
    else:
        path = tmp_path / "env.json"
        path.write_text(json.dumps({"dump": cfg}))
        obs.set_context(env_config_path=str(path))
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(steps):
        net(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    obs.reset_context()
    tracker.reset()
    return tmp_path / "dump" / "rank_0"


def files(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".npy"))


def parse(name):
    """(op type, escaped full name, io, slot) of a tensor file name."""
    m = re.fullmatch(r"(\w+)\.([\w\-+=()]+)\.0\.0\.(\d+)\.(input|output)\.(\d+)\.DefaultFormat\.(\w+)\.npy", name)
    assert m, name
    return m.group(1), m.group(2), m.group(4), int(m.group(5))


def test_iteration_ranges_select_the_steps(tmp_path):
    rank = run(tmp_path, steps=5, iteration="0|2-3")
    assert sorted(p.name for p in (rank / "Net" / "0").iterdir()) == ["0", "2", "3"]
    order = rank / "execution_order"
    assert (order / "ms_global_execution_order_graph_0.csv").read_text() == "0\n2\n3\n"
    lines = (order / "ms_execution_order_graph_0.csv").read_text().splitlines()
    assert lines[0] == "NodeExecutionOrder-FullNameWithScope"
    assert lines[1:3] == ["Default/net-Net/fc1-Linear/T-op0", "Default/net-Net/fc1-Linear/Addmm-op1"]
    assert "Gradients/Default/net-Net/fc2-Linear/Mm-op10" in lines
    meta = rank / ".dump_metadata"
    assert json.loads((meta / "data_dump.json").read_text()) == settings(tmp_path, iteration="0|2-3")
    assert json.loads((meta / "config.json").read_text())["device_target"] == "CPU"


def test_initial_iteration_numbers_the_folders(tmp_path):
    rank = run(tmp_path, steps=3, initial_iteration=10)
    assert sorted(p.name for p in (rank / "Net" / "0").iterdir()) == ["10", "11", "12"]


def test_tensor_files_have_the_original_names_and_values(tmp_path):
    rank = run(tmp_path)
    folder = rank / "Net" / "0" / "0"
    names = files(folder)
    addmm = [n for n in names if n.startswith("Addmm.Default_net-Net_fc1-Linear_Addmm-op1.")]
    assert [parse(n)[2:] for n in addmm] == [("input", 0), ("input", 1), ("input", 2), ("output", 0)]
    assert all(n.endswith(".DefaultFormat.Float32.npy") for n in addmm)
    raw = (folder / addmm[1]).read_bytes()
    header_len = int.from_bytes(raw[8:10], "little")
    assert raw[:8] == b"\x93NUMPY\x01\x00" and (10 + header_len) % 64 == 0
    assert b"'shape': (3,4,), }" in raw[:10 + header_len]
    torch.manual_seed(0)
    Net()
    x = torch.randn(3, 4)
    np.testing.assert_array_equal(np.load(folder / addmm[1]), x.numpy())
    assert not any(n.startswith("RecordFunction") for n in names)


@pytest.mark.parametrize("io, kinds", [(0, {"input", "output"}), (1, {"input"}), (2, {"output"})])
def test_input_output(tmp_path, io, kinds):
    folder = run(tmp_path, input_output=io) / "Net" / "0" / "0"
    assert {parse(n)[2] for n in files(folder)} == kinds


@pytest.mark.parametrize("saved, npy, csv", [("tensor", True, False), ("statistic", False, True),
                                             ("full", True, True)])
def test_saved_data(tmp_path, saved, npy, csv):
    folder = run(tmp_path, saved_data=saved) / "Net" / "0" / "0"
    assert bool(files(folder)) is npy
    assert (folder / "statistic.csv").exists() is csv


def test_statistic_csv_header_is_byte_exact_and_in_the_users_order(tmp_path):
    folder = run(tmp_path, saved_data="statistic") / "Net" / "0" / "0"
    assert (folder / "statistic.csv").read_bytes().split(b"\n", 1)[0] == \
        b"Op Type,Op Name,Task ID,Stream ID,Timestamp,IO,Slot,Data Size,Data Type,Shape,Max Value,Min Value," \
        b"L2Norm Value"
    folder = run(tmp_path / "b", saved_data="statistic",
                 statistic_category=["l2norm", "nan count", "max", "negative zero count", "md5"]) / "Net" / "0" / "0"
    text = (folder / "statistic.csv").read_text().splitlines()
    assert text[0].endswith(",Shape,L2Norm Value,NaN Count,Max Value,Negative Zero Count,MD5")
    row = next(line for line in text if line.startswith("Addmm,Default_net-Net_fc1-Linear_Addmm-op1,") and
               ",input,1," in line)
    fields = row.split(",")
    assert fields[7:10] == ["48", "float32", '"(3']  # the quoted shape "(3,4)" holds a comma
    torch.manual_seed(0)
    Net()
    x = torch.randn(3, 4)
    assert float(fields[11]) == pytest.approx(float(torch.linalg.vector_norm(x)))
    assert float(fields[13]) == pytest.approx(float(x.max()))


def test_uninitialised_outputs_are_not_dumped_but_what_fills_them_is(tmp_path):
    """empty_like's output is whatever the allocator held (it differs between two identical runs)."""
    class Fill(torch.nn.Module):
        def forward(self, x):
            return torch.empty_like(x).fill_(2.0) * x

    path = tmp_path / "env.json"
    path.write_text(json.dumps({"dump": settings(tmp_path, saved_data="full")}))
    obs.set_context(env_config_path=str(path))
    try:
        Fill()(torch.randn(3, 4))
        tracker.end()
    finally:
        obs.reset_context()
        tracker.reset()
    folder = tmp_path / "dump" / "rank_0" / "Net" / "0" / "0"
    rows = [line.split(",")[:7] for line in (folder / "statistic.csv").read_text().splitlines()[1:]]
    kinds = {(r[0], r[5]) for r in rows}
    assert ("EmptyLike", "input") in kinds and ("EmptyLike", "output") not in kinds
    assert ("Fill", "output") in kinds
    assert not [f for f in files(folder) if f.startswith("EmptyLike.") and ".output." in f]
    fill = next(f for f in files(folder) if f.startswith("Fill.") and ".output." in f)
    assert (np.load(folder / fill) == 2.0).all()


def test_kernels_by_full_name_type_and_regex(tmp_path):
    names = {parse(n)[1] for n in files(run(tmp_path / "a", dump_mode=1,
                                            kernels=["Default/net-Net/fc1-Linear/Addmm-op1"]) / "Net" / "0" / "0")}
    assert names == {"Default_net-Net_fc1-Linear_Addmm-op1"}
    types = {parse(n)[0] for n in files(run(tmp_path / "b", dump_mode=1, kernels=["relu"]) / "Net" / "0" / "0")}
    assert types == {"Relu"}
    regex = {parse(n)[1] for n in files(run(tmp_path / "c", dump_mode=1, kernels=["name-regex(^Default/net-Net/fc2)"])
                                        / "Net" / "0" / "0")}
    assert regex == {"Default_net-Net_fc2-Linear_T-op4", "Default_net-Net_fc2-Linear_Addmm-op5"}
    every = files(run(tmp_path / "d", dump_mode=0, kernels=["relu"]) / "Net" / "0" / "0")
    assert {parse(n)[0] for n in every} > {"Relu", "Addmm"}  # dump_mode 0 ignores kernels


def test_env_config_dump_section(tmp_path):
    rank = run(tmp_path, via="section", iteration="1", steps=2)
    assert [p.name for p in (rank / "Net" / "0").iterdir()] == ["1"]


def test_files_are_private_and_hostile_module_names_stay_inside(tmp_path):
    class Evil(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.add_module("a/\\b c\n", torch.nn.Linear(4, 2))

        def forward(self, x):
            return getattr(self, "a/\\b c\n")(x)

    Evil.__name__ = "E/../../../x"
    cfg = tmp_path / "dump.json"
    cfg.write_text(json.dumps(settings(tmp_path, saved_data="full")))
    os.environ["MINDSPORE_DUMP_CONFIG"] = str(cfg)
    try:
        obs.set_context(op_timeout=300)
    finally:
        del os.environ["MINDSPORE_DUMP_CONFIG"]
    with obs.step():
        Evil()(torch.randn(3, 4))
    obs.reset_context()
    root = tmp_path / "dump"
    for folder, _dirs, names in os.walk(root):
        assert os.stat(folder).st_mode & 0o777 == 0o700
        for name in names:
            assert os.stat(os.path.join(folder, name)).st_mode & 0o777 == 0o600
            assert "/" not in name and "\n" not in name
    [folder] = (root / "rank_0" / "Net" / "0").iterdir()
    addmm = [n for n in files(folder) if n.startswith("Addmm.")]
    assert addmm and all(re.fullmatch(r"Default_net-E_+x_a__b_c_-Linear_Addmm-op6", parse(n)[1]) for n in addmm)
    order = (root / "rank_0" / "execution_order" / "ms_execution_order_graph_0.csv").read_text().splitlines()
    assert order[-1] == "Default/net-E/../../../x/a/\\b c_-Linear/Addmm-op6"  # one line per op, even here


BAD = [
    ({"dump_mode": 3}, "'common_dump_settings.dump_mode' must be one of [0, 1, 2] (got 3)"),
    ({"dump_mode": "0"}, "'common_dump_settings.dump_mode' must be one of [0, 1, 2] (got \"0\" of type string)"),
    ({"dump_mode": 2}, "dump_mode' 2 (cells marked by set_dump) is only supported by Ascend"),
    ({"path": "relative/dir"}, "'common_dump_settings.path' must be an absolute path"),
    ({"path": "/tmp/a b"}, "letters, digits, '-', '_' and '/' only"),
    ({"path": "/tmp/../etc"}, "letters, digits, '-', '_' and '/' only"),
    ({"net_name": "a/b"}, "'common_dump_settings.net_name' must be letters, digits, '-' and '_' (got \"a/b\")"),
    ({"iteration": "1-"}, "the part \"1-\" is neither"),
    ({"iteration": "2-0"}, "the part \"2-0\" is reversed"),
    ({"iteration": "0 | 2"}, "the part \"0 \" is neither"),
    ({"iteration": "ALL"}, "the part \"ALL\" is neither"),
    ({"iteration": 3}, "'common_dump_settings.iteration' must be a string"),
    ({"saved_data": "both"}, "'common_dump_settings.saved_data' must be one of [\"statistic\", \"tensor\", \"full\"]"),
    ({"input_output": 3}, "'common_dump_settings.input_output' must be one of [0, 1, 2] (got 3)"),
    ({"kernels": "relu"}, "'common_dump_settings.kernels' must be an array"),
    ({"kernels": ["name-regex(()"]}, "a valid regular expression inside name-regex()"),
    ({"support_device": [-1]}, "'common_dump_settings.support_device[0]' must be an int in [0, 4095] (got -1)"),
    ({"op_debug_mode": 5}, "'common_dump_settings.op_debug_mode' must be one of [0, 1, 2, 3, 4] (got 5)"),
    ({"statistic_category": ["maximum"]}, "did you mean \"max\""),
    ({"file_format": "bin"}, "'common_dump_settings.file_format' must be one of [\"npy\"] (got \"bin\")"),
    ({"overflow_number": 3}, "overflow_number' may only be set with op_debug_mode 3"),
    ({"initial_iteration": -1}, "'common_dump_settings.initial_iteration' must be an int >= 0 (got -1)"),
    ({"kernel": []}, "'common_dump_settings' has no key \"kernel\"; did you mean \"kernels\"?"),
]


@pytest.mark.parametrize("change, fragment", BAD)
def test_every_bad_value_is_rejected_with_its_message(tmp_path, change, fragment):
    from obs.settings.dump_config import parse_dump_config

    cfg = settings(tmp_path, **change)
    with pytest.raises(DumpConfigError) as info:
        parse_dump_config(cfg, source="dump.json")
    assert fragment in str(info.value)
    assert str(info.value).startswith("dump config dump.json: ")


def test_missing_required_keys_and_bad_e2e_are_all_listed(tmp_path):
    from obs.settings.dump_config import parse_dump_config

    cfg = {"common_dump_settings": {"path": str(tmp_path)}, "e2e_dump_settings": {"enable": "yes", "sample_num": 0}}
    with pytest.raises(DumpConfigError) as info:
        parse_dump_config(cfg)
    fields = [field for field, _ in info.value.problems]
    assert fields == ["e2e_dump_settings.enable", "e2e_dump_settings.sample_num", "common_dump_settings.dump_mode",
                      "common_dump_settings.net_name", "common_dump_settings.iteration",
                      "common_dump_settings.input_output", "common_dump_settings.kernels",
                      "common_dump_settings.support_device"] or sorted(fields) == sorted(
        ["common_dump_settings.dump_mode", "common_dump_settings.net_name", "common_dump_settings.iteration",
         "common_dump_settings.input_output", "common_dump_settings.kernels", "common_dump_settings.support_device",
         "e2e_dump_settings.enable", "e2e_dump_settings.sample_num"])


def test_a_bad_file_named_by_the_variable_fails_the_first_set_context(tmp_path, monkeypatch):
    path = tmp_path / "dump.json"
    path.write_text(json.dumps(settings(tmp_path, iteration="3-1")))
    monkeypatch.setenv("MINDSPORE_DUMP_CONFIG", str(path))
    with pytest.raises(DumpConfigError, match="reversed"):
        obs.set_context(op_timeout=300)
    assert obs.get_context("op_timeout") == 900  # nothing was applied


@pytest.mark.parametrize("call", [{}, {"mode": obs.PYNATIVE_MODE}], ids=["set_context()", "a default value"])
def test_the_variable_is_read_by_a_first_set_context_that_changes_nothing(tmp_path, monkeypatch, call):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(settings(tmp_path, iteration="3-1")))
    monkeypatch.setenv("MINDSPORE_DUMP_CONFIG", str(bad))
    obs.reset_context()
    with pytest.raises(DumpConfigError, match="reversed"):
        obs.set_context(**call)
    good = tmp_path / "good.json"
    good.write_text(json.dumps(settings(tmp_path, saved_data="statistic")))
    monkeypatch.setenv("MINDSPORE_DUMP_CONFIG", str(good))
    obs.set_context(**call)  # the failed call did not count as the first
    monkeypatch.setenv("MINDSPORE_DUMP_CONFIG", str(bad))
    obs.set_context(**call)  # read once, as the original: later calls keep the first config
    try:
        with obs.step():
            torch.nn.Linear(4, 2)(torch.randn(3, 4))
    finally:
        obs.reset_context()
    assert list((tmp_path / "dump" / "rank_0" / "Net" / "0" / "0").glob("statistic.csv"))


def test_parameters_are_written_as_the_originals_parameter_files(tmp_path):
    folder = run(tmp_path, saved_data="full", steps=2) / "Net" / "0" / "1"
    params = sorted(n for n in files(folder) if n.startswith("Parameter."))
    assert [parse(n)[1] for n in params] == ["fc1_bias", "fc1_weight", "fc2_bias", "fc2_weight"]
    rows = [line for line in (folder / "statistic.csv").read_text().splitlines() if line.startswith("Parameter,")]
    assert len(rows) == 4 and all(",output,0," in row for row in rows)
    none = run(tmp_path / "b", saved_data="tensor", input_output=1) / "Net" / "0" / "0"
    assert not [n for n in files(none) if n.startswith("Parameter.")]


def test_a_loop_that_never_ends_a_step_is_told_why_nothing_was_dumped(tmp_path):
    """No optimizer (weights updated by hand): no step ends, nothing is written, and the exit says why."""
    import subprocess
    import sys

    config = tmp_path / "dump.json"
    config.write_text(json.dumps(settings(tmp_path, saved_data="statistic")))
    script = (
        "import torch, obs\n"
        "obs.set_context(op_timeout=300)\n"
        "net = torch.nn.Linear(4, 2)\n"
        "for _ in range(3):\n"
        "    net(torch.randn(3, 4)).sum().backward()\n"
        "    with torch.no_grad():\n"
        "        for p in net.parameters():\n"
        "            p.add_(p.grad, alpha=-0.1)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OBS_DUMP_CONFIG": str(config)})
    assert out.returncode == 0, out.stderr
    assert "no training step ended, so the data dump wrote nothing" in out.stderr
    assert "with obs.step():" in out.stderr and str(tmp_path / "dump") in out.stderr
    assert not (tmp_path / "dump" / "rank_0" / "Net").exists()


def test_a_run_that_ends_before_its_iterations_is_told_so(tmp_path):
    from obs.features.dump.feature import feature

    path = tmp_path / "env.json"
    path.write_text(json.dumps({"dump": settings(tmp_path, saved_data="statistic", iteration="5-6")}))
    obs.set_context(env_config_path=str(path))
    try:
        net = Net()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        assert feature.data.nothing_dumped() is None  # nothing ran yet: nothing to say
        for _ in range(2):
            net(torch.randn(3, 4)).sum().backward()
            opt.step()
        reason = feature.data.nothing_dumped()
        assert "its 'iteration' is '5-6'" in reason and "ended after iteration 1" in reason
        for _ in range(4):  # iterations 2-5: 5 is dumped when it ends
            net(torch.randn(3, 4)).sum().backward()
            opt.step()
        assert feature.data.nothing_dumped() is None
    finally:
        obs.reset_context()
        tracker.reset()


def test_a_dump_folder_removed_during_the_run_is_made_again(tmp_path):
    """Each iteration folder is one mkdir in the checked graph folder; when that is gone, the full walk remakes it."""
    import shutil

    path = tmp_path / "env.json"
    path.write_text(json.dumps({"dump": settings(tmp_path, saved_data="statistic")}))
    obs.set_context(env_config_path=str(path))
    try:
        net = Net()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for step in range(3):
            if step == 2:
                shutil.rmtree(tmp_path / "dump")
            net(torch.randn(3, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    finally:
        obs.reset_context()
        tracker.reset()
    graph = tmp_path / "dump" / "rank_0" / "Net" / "0"
    assert sorted(p.name for p in graph.iterdir()) == ["2"]
    assert (graph / "2" / "statistic.csv").read_text().startswith("Op Type,Op Name,")
    order = tmp_path / "dump" / "rank_0" / "execution_order"
    assert (order / "ms_global_execution_order_graph_0.csv").read_text() == "2\n"
    assert (order / "ms_execution_order_graph_0.csv").read_text().startswith("NodeExecutionOrder-FullNameWithScope\n")


@pytest.mark.parametrize("input_output", [0, 2])
def test_an_in_place_op_is_dumped_with_its_input_before_and_its_output_after(tmp_path, input_output):
    """A user's run: buf.add_(5.0) on zeros was dumped with output max 0.0, SGD's w.add_ with the old weights."""
    class InPlace(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(4))

        def forward(self):
            buf = torch.zeros(3)
            buf.add_(5.0)
            return (self.w * 2).sum() + buf.sum()

    cfg = settings(tmp_path, saved_data="statistic", input_output=input_output)
    path = tmp_path / "env.json"
    path.write_text(json.dumps({"dump": cfg}))
    obs.set_context(env_config_path=str(path))
    net = InPlace()
    opt = torch.optim.SGD(net.parameters(), lr=0.5, foreach=False)
    net().backward()
    opt.step()
    obs.reset_context()
    with open(tmp_path / "dump" / "rank_0" / "Net" / "0" / "0" / "statistic.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["Op Type"] == "Add"]
    maxima = [(r["Op Name"].rsplit("-", 1)[0], r["IO"], r["Slot"], float(r["Max Value"])) for r in rows]
    buf = [m[1:] for m in maxima if m[0] == "Default_net-InPlace_Add"]
    sgd = [m[1:] for m in maxima if m[0] == "Default_Add"]
    if input_output == 0:
        assert ("input", "0", 0.0) in buf and ("input", "0", 1.0) in sgd
    assert ("output", "0", 5.0) in buf and ("output", "0", 0.0) in sgd  # w = 1 - 0.5 * 2
