"""NaN/Inf check: a NaN planted at a known layer, in forward or in backward, is found there."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import obs
from obs.features.dump.feature import feature
from obs.features.dump.nan import native_check
from obs.features.dump.nan.check import NonFiniteError

# Every test on the check's C++ module hooks and on its Python path (tests/conftest.py).
pytestmark = [pytest.mark.native("DUMP"), pytest.mark.usefixtures("native_path")]


def arm(tmp_path, **section):
    cfg = {"nan_check": {"enable": True, "path": str(tmp_path), **section}}
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    obs.set_context(env_config_path=str(path))


class Poison(torch.nn.Module):
    """Identity in forward; ``forward_nan`` makes its output NaN, ``backward_nan`` its input's gradient."""

    def __init__(self, forward_nan=False, backward_nan=False):
        super().__init__()
        self.forward_nan, self.backward_nan = forward_nan, backward_nan

    def forward(self, x):
        if self.forward_nan:
            return torch.log(-x.abs() - 1)  # NaN everywhere, made by log
        if self.backward_nan:
            return GradToNan.apply(x)
        return x


class GradToNan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


class Net(torch.nn.Module):
    def __init__(self, **poison):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.poison = Poison(**poison)
        self.fc2 = torch.nn.Linear(8, 8)
        self.fc3 = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(self.poison(self.fc1(x)))))


def fault_folders(tmp_path):
    root = tmp_path / "rank_0" / "nan_check"
    return sorted(root.iterdir()) if root.exists() else []


def the_fault_folder(tmp_path, call, **section):
    """Run ``call`` with the check armed (``section``), then the one fault folder and its meta.json."""
    arm(tmp_path, **section)
    try:
        call()
    finally:
        obs.reset_context()
    [folder] = fault_folders(tmp_path)
    return folder, json.loads((folder / "meta.json").read_text())


def train_step(net, opt=None):
    opt = opt or torch.optim.SGD(net.parameters(), lr=0.1)
    loss = net(torch.randn(3, 4)).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()


def test_forward_nan_is_found_at_the_module_that_made_it(tmp_path):
    arm(tmp_path)
    train_step(Net(forward_nan=True))
    [folder] = fault_folders(tmp_path)
    meta = json.loads((folder / "meta.json").read_text())
    assert (meta["phase"], meta["scope"], meta["nan"], meta["step"]) == \
        ("forward", "Default/net-Net/poison-Poison", 24, 1)
    assert np.isnan(np.load(folder / "outputs.0.npy")).all()
    assert np.isfinite(np.load(folder / "inputs.0.npy")).all()  # what went in was fine


def test_backward_nan_is_found_at_the_first_gradient_that_holds_it(tmp_path):
    arm(tmp_path)
    train_step(Net(backward_nan=True))
    [folder] = fault_folders(tmp_path)
    meta = json.loads((folder / "meta.json").read_text())
    # The gradient reaching fc1's output is the first to hold NaN: Poison's backward made it.
    assert (meta["phase"], meta["scope"], meta["where"]) == ("backward", "Default/net-Net/fc1-Linear",
                                                             "gradient of the output")
    assert meta["nan"] == 24 and np.isnan(np.load(folder / "gradients.0.npy")).all()


def test_raise_action_stops_training_where_the_nan_appeared(tmp_path):
    arm(tmp_path, action="raise")
    with pytest.raises(FloatingPointError, match="poison-Poison") as info:
        train_step(Net(forward_nan=True))
    assert isinstance(info.value, NonFiniteError) and info.value.folder == str(fault_folders(tmp_path)[0])
    assert info.value.capture == info.value.folder  # the former name, kept


def test_op_granularity_names_the_aten_op(tmp_path):
    arm(tmp_path, granularity="op")
    train_step(Net(forward_nan=True))
    [folder] = fault_folders(tmp_path)
    meta = json.loads((folder / "meta.json").read_text())
    assert (meta["kind"], meta["op"], meta["scope"], meta["phase"]) == \
        ("op", "log.default", "Default/net-Net/poison-Poison", "forward")


def test_op_granularity_in_backward(tmp_path):
    arm(tmp_path, granularity="op")
    train_step(Net(backward_nan=True))
    [folder] = fault_folders(tmp_path)
    meta = json.loads((folder / "meta.json").read_text())
    assert (meta["op"], meta["phase"]) == ("mul.Tensor", "backward")


def test_a_clean_run_reports_nothing_and_the_rdr_records_the_place(tmp_path):
    arm(tmp_path)
    net = Net()
    for _ in range(3):
        train_step(net)
    assert fault_folders(tmp_path) == []
    faults = []
    obs.subscribe(obs.Event.FAULT, lambda kind, detail, error: faults.append((kind, detail)))
    train_step(Net(forward_nan=True))
    assert faults == [("nan_inf", "Default/net-Net/poison-Poison")]


def test_dump_config_overflow_mode_turns_it_on(tmp_path, monkeypatch):
    cfg = {"common_dump_settings": {"dump_mode": 0, "path": str(tmp_path / "d"), "net_name": "Net",
                                    "iteration": "all", "input_output": 0, "kernels": [], "support_device": [0],
                                    "op_debug_mode": 3, "overflow_number": 2}}
    (tmp_path / "dump.json").write_text(json.dumps(cfg))
    monkeypatch.setenv("MINDSPORE_DUMP_CONFIG", str(tmp_path / "dump.json"))
    obs.set_context(op_timeout=600)  # the first set_context call reads the variable, whatever its keys
    net = Net(forward_nan=True)
    for _ in range(3):
        train_step(net)
    found = [json.loads((f / "meta.json").read_text()) for f in fault_folders(tmp_path / "d")]
    # as the original's overflow mode: op by op, the first of each step, overflow_number of them
    assert [(m["op"], m["step"]) for m in found] == [("log.default", 1), ("log.default", 2)]


def test_a_relu_or_maxpool_output_is_not_read_again_when_its_inputs_were_finite(tmp_path, native_path):
    arm(tmp_path, backward=False)
    try:
        check = feature.nan
        assert (check._native is not None) is (native_path == "native"), native_check.unavailable_reason()
        net = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.ReLU(), torch.nn.MaxPool2d(2), torch.nn.Flatten(),
                                  torch.nn.Linear(18, 2), torch.nn.Sigmoid())
        net(torch.randn(3, 1, 8, 8)).sum().backward()
    finally:
        obs.reset_context()
    assert check.outputs_read == 2  # the conv's and the linear's outputs; ReLU, MaxPool, Sigmoid derive
    assert fault_folders(tmp_path) == []


def test_a_nan_that_enters_from_outside_any_module_is_found_at_the_first_relu(tmp_path):
    arm(tmp_path, backward=False)
    try:
        net = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(4, 2))
        x = torch.randn(3, 4)
        x[1, 2] = float("nan")  # made by the user's code, not by a module: never checked
        net(x).sum().backward()
    finally:
        obs.reset_context()
    [folder] = fault_folders(tmp_path)
    meta = json.loads((folder / "meta.json").read_text())
    assert (meta["phase"], meta["scope"], meta["nan"]) == ("forward", "Default/net-Sequential/0-ReLU", 1)


def test_an_input_changed_in_place_after_its_check_is_read_again(tmp_path):
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.act = torch.nn.Linear(4, 4), torch.nn.ReLU()

        def forward(self, x):
            h = self.fc(x)
            with torch.no_grad():
                h[0, 0] = float("inf")  # after its check: its version moves on
            return self.act(h)

    arm(tmp_path, backward=False)
    try:
        Net()(torch.randn(2, 4))
    finally:
        obs.reset_context()
    [folder] = fault_folders(tmp_path)
    assert json.loads((folder / "meta.json").read_text())["scope"] == "Default/net-Net/act-ReLU"


class Pair(torch.nn.Module):
    """Returns (its input, NaN): the second output is the bad one."""

    def forward(self, x):
        return x, torch.log(-x.abs() - 1)


def test_an_output_is_labelled_as_an_output_and_inputs_as_arguments(tmp_path):
    _, meta = the_fault_folder(tmp_path, lambda: Poison(forward_nan=True)(torch.randn(3, 4)), backward=False)
    assert meta["where"] == "output" and "output)" in meta["message"]
    assert [o["arg"] for o in meta["outputs"]] == ["output"] and [i["arg"] for i in meta["inputs"]] == ["args[0]"]


def test_the_bad_element_of_a_tuple_output_is_named_by_its_index(tmp_path):
    folder, meta = the_fault_folder(tmp_path, lambda: Pair()(torch.randn(3, 4)), backward=False)
    assert meta["where"] == "output[1]" and [o["arg"] for o in meta["outputs"]] == ["output[1]"]
    assert np.isnan(np.load(folder / "outputs.0.npy")).all()


def test_op_granularity_labels_the_op_output_as_an_output(tmp_path):
    _, meta = the_fault_folder(tmp_path, lambda: Poison(forward_nan=True)(torch.randn(3, 4)), granularity="op",
                          backward=False)
    assert (meta["op"], meta["where"]) == ("log.default", "output")
    assert [o["arg"] for o in meta["outputs"]] == ["output"] and [i["arg"] for i in meta["inputs"]] == ["args[0]"]


def test_a_compiled_model_with_an_output_no_loss_uses_trains_under_the_module_check(tmp_path, native_path):
    """Its backward hands the unused output's gradient hook None (nanoGPT returns logits and loss)."""
    arm(tmp_path)

    class TwoOutputs(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 4)

        def forward(self, x, y):
            logits = self.fc(x)
            return logits, torch.nn.functional.cross_entropy(logits, y)

    torch._dynamo.reset()
    model = torch.compile(TwoOutputs(), backend="aot_eager")
    for _ in range(2):
        _, loss = model(torch.randn(16, 8), torch.randint(0, 4, (16,)))
        loss.backward()
    assert not (tmp_path / "rank_0").exists()  # nothing found, nothing raised
