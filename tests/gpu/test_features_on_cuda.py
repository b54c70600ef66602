"""Every feature on CUDA tensors, eager and compiled: the checks of the GPU issue that need a device.

Each test mirrors one that runs on CPU elsewhere in the suite; here the model, its inputs and its outputs
live on ``cuda:0``.  They are skipped without CUDA (tests/gpu/conftest.py).
"""

from __future__ import annotations

import csv
import json
import os

import pytest
import torch

import obs
from recorder.bundle_reader import list_bundles, load_bundle

CUDA = torch.device("cuda", 0)


class Net(torch.nn.Module):
    def __init__(self, inner: int = 16) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(inner, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def env_file(tmp_path, sections: dict) -> None:
    path = tmp_path / "env.json"
    path.write_text(json.dumps(sections))
    obs.set_context(env_config_path=str(path))


def train_on_cuda(model: torch.nn.Module, steps: int = 2, compiled: bool = False) -> list[float]:
    torch.manual_seed(0)
    run = torch.compile(model) if compiled else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        loss = run(torch.randn(4, 8, device=CUDA)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def statistic_rows(folder, iteration: int = 0) -> list[dict[str, str]]:
    with open(folder / "rank_0" / "Net" / "0" / str(iteration) / "statistic.csv", newline="") as f:
        return list(csv.DictReader(f))


def dump_settings(tmp_path) -> dict:
    return {"dump": {"common_dump_settings": {
        "dump_mode": 0, "path": str(tmp_path / "dump"), "net_name": "Net", "iteration": "all",
        "saved_data": "statistic", "input_output": 2, "kernels": [], "support_device": [0]}}}


def test_print_of_a_cuda_tensor_reads_back(tmp_path):
    path = tmp_path / "print.pb"
    obs.set_context(print_file_path=str(path))
    value = torch.arange(6, dtype=torch.float32, device=CUDA).reshape(2, 3)
    obs.Print("value", value)
    obs.reset_context()
    text, read = obs.parse_print(str(path))
    assert text == "value" and read.tolist() == value.cpu().tolist()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_statistic_dump_of_a_cuda_model(tmp_path, compiled):
    torch.manual_seed(0)
    plain = train_on_cuda(Net().to(CUDA), compiled=compiled)
    torch._dynamo.reset()
    env_file(tmp_path, dump_settings(tmp_path))
    torch.manual_seed(0)
    with_dump = train_on_cuda(Net().to(CUDA), compiled=compiled)
    obs.reset_context()
    assert with_dump == plain
    rows = statistic_rows(tmp_path / "dump")
    addmm = [r for r in rows if r["Op Type"] == "Addmm"]
    assert addmm and all(r["Max Value"] not in ("", "null") for r in addmm)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_nan_check_finds_the_first_nan_of_a_cuda_model(tmp_path, compiled):
    class Bad(Net):
        def forward(self, x):
            return self.fc2(torch.log(self.fc1(x)))  # NaN where fc1 < 0

    env_file(tmp_path, {"nan_check": {"enable": True, "path": str(tmp_path)}})
    torch._dynamo.reset()
    train_on_cuda(Bad().to(CUDA), steps=1, compiled=compiled)
    obs.reset_context()
    (finding,) = [json.loads((d / "meta.json").read_text()) for d in (tmp_path / "rank_0" / "nan_check").iterdir()]
    # read once per step on CUDA (nan_check.sync off): which values were found, not how many (dumps.md)
    assert finding["phase"] == "forward" and finding["found"] == ["NaN"], finding


def test_exception_dump_saves_the_cuda_inputs_of_the_failing_module(tmp_path):
    env_file(tmp_path, {"exception_dump": {"enable": True, "path": str(tmp_path)}})
    net = Net(inner=5).to(CUDA)
    with pytest.raises(RuntimeError):
        net(torch.randn(3, 8, device=CUDA))
    obs.reset_context()
    (folder,) = (tmp_path / "rank_0" / "exception_dump").iterdir()
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["scope"].endswith("fc2-Linear") and meta["inputs"][0]["shape"] == [3, 16]
    assert meta["inputs"][0]["device"].startswith("cuda")


@pytest.mark.parametrize("granularity", ["module", "op"])
def test_the_recorder_keeps_a_bundle_of_a_cuda_run_that_raises(tmp_path, granularity):
    env_file(tmp_path, {"rdr": {"enable": True, "path": str(tmp_path / "rdr"), "granularity": granularity}})
    train_on_cuda(Net().to(CUDA), steps=2)
    with pytest.raises(RuntimeError):
        Net(inner=5).to(CUDA)(torch.randn(3, 8, device=CUDA))
    obs.rdr.dump("after the fault")
    obs.reset_context()
    bundles = list_bundles(str(tmp_path / "rdr")).bundles
    assert bundles
    events = load_bundle(bundles[-1].path).events({"module_enter"})
    assert any("fc1-Linear" in str(e) for e in events)


def test_save_graphs_of_a_cuda_compile(tmp_path):
    obs.set_context(save_graphs=3, save_graphs_path=str(tmp_path / "graphs"))
    torch._dynamo.reset()
    train_on_cuda(Net().to(CUDA), steps=1, compiled=True)
    obs.reset_context()
    index = json.loads((tmp_path / "graphs" / "index.json").read_text())
    stages = {g["stage"] for g in index["graphs"]}
    assert {"dynamo_capture", "aot_forward", "aot_backward", "inductor_post_grad"} <= stages
    code = [g for g in index["graphs"] if g["stage"] == "inductor_code"]
    assert code and any("triton" in (tmp_path / "graphs" / g["files"]["code"]).read_text() for g in code)
    assert os.path.exists(tmp_path / "graphs" / "index.json")
