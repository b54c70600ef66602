"""The NaN/Inf check and the data dump on CUDA add no host synchronisation to a step (issue 31).

The steps run under ``torch.cuda.set_sync_debug_mode("error")``: any ``.item()``, blocking copy to the host,
``nonzero`` or stream/device synchronisation made during them raises.  What the features read back is read after
the step, by their poller thread, from pinned memory once an event says the copy is done; the tests then wait for
it (``flush``, ``reset_context``) outside the checked region.  Skipped without CUDA (tests/gpu/conftest.py); their
CPU counterparts are tests/obs/features/dump/nan/test_device_flags.py and test_device_stats.py.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math

import numpy as np
import pytest
import torch

import obs
from obs.features.dump.feature import feature
from obs.features.dump.nan.check import NonFiniteError
from tests.obs.features.dump.nan.test_check import GradToNan

CUDA = torch.device("cuda", 0)


class Poison(torch.nn.Module):
    """Identity, or NaN everywhere (made on the device by log) while ``bad``."""

    def __init__(self) -> None:
        super().__init__()
        self.bad = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(-x.abs() - 1) if self.bad else x


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 32)
        self.poison = Poison()
        self.fc2 = torch.nn.Linear(32, 32)
        self.fc3 = torch.nn.Linear(32, 4)
        self.grad_nan = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.poison(self.fc1(x))
        if self.grad_nan:
            h = GradToNan.apply(h)
        return self.fc3(torch.relu(self.fc2(h)))


@contextlib.contextmanager
def no_host_sync():
    """Any host synchronisation inside raises (set_sync_debug_mode "error"), on every thread while it is set."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def arm(tmp_path, sections: dict) -> None:
    path = tmp_path / "env.json"
    path.write_text(json.dumps(sections))
    obs.set_context(env_config_path=str(path))


def steps(net: Net, n: int, bad_step: int = 0, grad_nan: bool = False) -> None:
    """``n`` training steps of ``net`` under no_host_sync; step ``bad_step`` (from 1) makes a NaN, and its gradients
    are not applied (the weights stay finite for the steps after it)."""
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    inputs = [torch.randn(16, 8, device=CUDA) for _ in range(n)]
    with no_host_sync():
        for i, x in enumerate(inputs, 1):
            net.poison.bad = i == bad_step and not grad_nan
            net.grad_nan = i == bad_step and grad_nan
            with obs.step():
                net(x).square().mean().backward()
                if i != bad_step:
                    opt.step()
                opt.zero_grad(set_to_none=True)
    net.poison.bad = net.grad_nan = False


def nan_findings(tmp_path) -> list[dict]:
    root = tmp_path / "rank_0" / "nan_check"
    return [json.loads((d / "meta.json").read_text()) for d in sorted(root.iterdir())] if root.exists() else []


def model() -> Net:
    torch.manual_seed(0)
    return Net().to(CUDA)


def test_the_nan_check_adds_no_host_sync_and_names_the_module(tmp_path):
    arm(tmp_path, {"nan_check": {"enable": True, "path": str(tmp_path)}})
    steps(model(), 4, bad_step=4)
    check = feature.nan
    assert check.flags is not None and check.flags.checks > 0
    assert check.flush(60)
    assert check.flags.reads == 4  # one read of the gates per step
    obs.reset_context()
    [found] = nan_findings(tmp_path)
    assert (found["phase"], found["scope"], found["step"], found["where"]) == \
        ("forward", "Default/net-Net/poison-Poison", 4, "output")
    assert found["found"] == ["NaN"] and found["counted"] is False


def test_a_gradient_nan_is_found_in_backward_without_a_host_sync(tmp_path):
    arm(tmp_path, {"nan_check": {"enable": True, "path": str(tmp_path)}})
    steps(model(), 3, bad_step=2, grad_nan=True)
    obs.reset_context()  # waits for what is in flight
    [found] = nan_findings(tmp_path)
    assert (found["phase"], found["scope"], found["step"]) == ("backward", "Default/net-Net/fc1-Linear", 2)


def test_op_granularity_adds_no_host_sync(tmp_path):
    arm(tmp_path, {"nan_check": {"enable": True, "path": str(tmp_path), "granularity": "op"}})
    steps(model(), 3, bad_step=2)
    obs.reset_context()
    [found] = nan_findings(tmp_path)
    assert (found["kind"], found["op"], found["step"]) == ("op", "log.default", 2)


def test_raise_comes_at_the_next_check_on_the_training_thread(tmp_path):
    arm(tmp_path, {"nan_check": {"enable": True, "path": str(tmp_path), "action": "raise"}})
    net = model()
    steps(net, 2, bad_step=2)
    assert feature.nan.flush(60)  # the finding is made; its error waits for this thread
    with pytest.raises(NonFiniteError, match=r"poison-Poison \(step 2, output\)"):
        with no_host_sync():
            net(torch.zeros(16, 8, device=CUDA))
    obs.reset_context()


def dump_settings(tmp_path, saved_data: str, categories: list[str]) -> dict:
    return {"dump": {"common_dump_settings": {
        "dump_mode": 0, "path": str(tmp_path / "dump"), "net_name": "Net", "iteration": "all",
        "saved_data": saved_data, "input_output": 0, "kernels": [], "support_device": [0],
        "statistic_category": categories}}}


def statistic_rows(tmp_path, iteration: int) -> list[dict[str, str]]:
    with open(tmp_path / "dump" / "rank_0" / "Net" / "0" / str(iteration) / "statistic.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_the_statistic_dump_adds_no_host_sync(tmp_path):
    categories = ["max", "min", "avg", "l2norm", "nan count", "positive inf count", "zero count"]
    arm(tmp_path, dump_settings(tmp_path, "statistic", categories))
    net = model()
    w = net.fc1.weight.detach().cpu().double()  # as iteration 0 dumps it: before its update
    steps(net, 3, bad_step=2)
    assert feature.data.flush(60)
    obs.reset_context()
    clean, bad = statistic_rows(tmp_path, 0), statistic_rows(tmp_path, 1)
    assert len(clean) > 20 and all(r["Max Value"] not in ("", "null") for r in clean if r["Op Type"] == "Addmm")
    assert all(r["NaN Count"] == "0" for r in clean)
    logs = [r for r in bad if r["Op Type"] == "Log" and r["IO"] == "output"]
    assert logs and logs[0]["NaN Count"] == str(16 * 32) and logs[0]["Max Value"] == "null"
    # the values are those of the same tensors read on the host
    weight = next(r for r in clean if r["Op Name"] == "fc1_weight")
    assert float(weight["Max Value"]) == pytest.approx(w.max().item())
    assert float(weight["L2Norm Value"]) == pytest.approx(w.norm().item(), rel=1e-5)
    assert not math.isnan(float(weight["Avg Value"]))


def test_the_tensor_dump_copies_through_pinned_memory_without_a_host_sync(tmp_path):
    arm(tmp_path, dump_settings(tmp_path, "full", ["max", "min"]))
    net = model()
    w = net.fc1.weight.detach().cpu().numpy().copy()  # as iteration 0 dumps it: before its update
    steps(net, 2)
    obs.reset_context()
    folder = tmp_path / "dump" / "rank_0" / "Net" / "0" / "0"
    [weight] = folder.glob("Parameter.fc1_weight.*.output.0.*.npy")
    assert np.array_equal(np.load(weight), w)
    assert len(list(folder.glob("*.npy"))) > 20


def compiled_steps(net: Net, inputs: list[torch.Tensor]) -> None:
    """Steps of ``torch.compile(net)`` (Inductor): the first input compiles it outside the checked region, the
    others run under no_host_sync."""
    compiled = torch.compile(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)

    def step(x: torch.Tensor) -> None:
        with obs.step():
            compiled(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    step(inputs[0])
    with no_host_sync():
        for x in inputs[1:]:
            step(x)


@pytest.fixture
def inductor():
    pytest.importorskip("triton")  # Inductor's CUDA kernels
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_the_statistics_of_a_compiled_graph_add_no_host_sync(tmp_path, inductor):
    arm(tmp_path, dump_settings(tmp_path, "statistic", ["max", "min", "avg", "l2norm", "nan count"]))
    bad = torch.full((16, 8), float("nan"), device=CUDA)
    compiled_steps(model(), [torch.randn(16, 8, device=CUDA), torch.randn(16, 8, device=CUDA), bad])
    assert feature.data.flush(60)
    obs.reset_context()
    clean, nan = statistic_rows(tmp_path, 1), statistic_rows(tmp_path, 2)
    relu = [r for r in clean if r["Op Type"] == "Relu" and r["IO"] == "output"]  # a node of the compiled graph
    assert relu and float(relu[0]["Min Value"]) == 0.0 and float(relu[0]["Max Value"]) > 0
    assert relu[0]["NaN Count"] == "0" and relu[0]["Shape"] == "(16,32)"
    assert any(r["Op Name"].startswith("Gradients_") for r in clean)  # the backward graph's rows
    addmm = [r for r in nan if r["Op Type"] == "Addmm" and r["Shape"] == "(16,32)"]
    assert addmm and addmm[0]["NaN Count"] == str(16 * 32) and addmm[0]["Max Value"] == "null"


def test_the_nan_check_of_a_compiled_graph_adds_no_host_sync(tmp_path, inductor):
    arm(tmp_path, {"nan_check": {"enable": True, "path": str(tmp_path)}})
    bad = torch.full((16, 8), float("nan"), device=CUDA)
    compiled_steps(model(), [torch.randn(16, 8, device=CUDA), torch.randn(16, 8, device=CUDA), bad])
    obs.reset_context()  # waits for what is in flight
    [found] = nan_findings(tmp_path)
    assert (found["phase"], found["step"]) == ("forward", 3) and found["op"] in ("Addmm", "Mm")  # fc1's node
    assert "fc1" in found["scope"] and found["nan"] == 16 * 32  # the graph counted them: exact counts
