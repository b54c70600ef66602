"""The data dump and the NaN check inside Inductor-compiled graphs (the graphs compute their own statistics).

One script trains a small model compiled with Inductor, without obs and with a feature on, for every case, and
prints JSON.  The cases run one after the other in one process of their own (Inductor keeps worker threads for the
rest of a process), once for the module (``case``): the tests of the path read after the step compare against the
same runs as the tests of the immediate path.  Each model variant is trained without obs once, before obs is first
turned on in that process.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

SCRIPT = r'''
import functools, json, os, sys
import torch, obs
from obs.runtime.steps import tracker

class Masked(torch.nn.Module):
    """Attention's causal mask: -inf by design, built from the shape alone (no data of the step)."""

    def forward(self, x):
        mask = torch.triu(torch.full((x.shape[0], x.shape[1]), float("-inf")), 1)
        return torch.softmax(x + mask, -1)

class Net(torch.nn.Module):
    def __init__(self, feature, graph_break):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 4)
        self.attn1, self.attn2 = Masked(), Masked()
        self.feature, self.graph_break = feature, graph_break

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        if self.graph_break:
            torch._dynamo.graph_break()
        if self.feature == "nan":
            h = torch.log(h - 1.0)  # NaN wherever h < 1
        if self.feature == "mask":
            h = self.attn2(self.attn1(h))
        return self.fc2(h)

def train(feature, graph_break, steps=2, reference=False):
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = Net(feature, graph_break)
    compiled = torch.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, relu = [], []
    for _ in range(steps):
        x = torch.randn(4, 8)
        if reference:  # the relu output the compiled graph computes, computed eagerly (run without obs)
            with torch.no_grad():
                relu.append(torch.relu(model.fc1(x)))
        loss = compiled(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, dict(counters["frames"]), relu

def read_later():
    """From here on the graphs' statistics and the eager gates are read after the step, as on CUDA."""
    from obs.features.dump.nan import check as nan_check
    from obs.features.dump.nan import device_flags
    from obs.runtime.torch import _graph_taps
    os.environ["OBS_NATIVE_DUMP"] = "0"  # the C++ module check reads CPU tensors where they are made
    _graph_taps.DEFER_CPU = True  # read as a graph runs: a graph Inductor cached earlier in this process goes too
    nan_check.DeviceFlags = functools.partial(device_flags.DeviceFlags, cpu=True)

cases = json.loads(sys.argv[1])  # [feature, folder, graph_break, defer] each, those read after the step last
plain = {}
for feature, _, graph_break, _ in cases:  # each model without obs, before obs is first on in this process
    if (feature, graph_break) not in plain:
        plain[feature, graph_break] = train(feature, graph_break, reference=True)
out = []
for feature, folder, graph_break, defer in cases:
    if defer:
        read_later()
    env = {"dump": {"common_dump_settings": {
        "dump_mode": 0, "path": folder, "net_name": "Net", "iteration": "all", "saved_data": "statistic",
        "input_output": 2, "kernels": [], "support_device": [0],
        "statistic_category": ["max", "min", "avg", "l2norm", "nan count"]}}} if feature == "dump" else \
          {"nan_check": {"enable": True, "path": folder}}  # nan, mask
    path = os.path.join(folder, "env.json")
    with open(path, "w") as f:
        json.dump(env, f)
    obs.set_context(env_config_path=path)
    with_obs, frames, _ = train(feature, graph_break)
    obs.reset_context()
    tracker.reset()  # the next case counts its steps from 1 again, as a process of its own would
    losses, plain_frames, relu = plain[feature, graph_break]
    stats = [[float(r.max()), float(r.min()), float(r.mean()), float(r.norm())] for r in relu]
    out.append({"plain": losses, "with_obs": with_obs, "plain_frames": plain_frames, "frames": frames,
                "relu": stats})
print(json.dumps(out))
'''

#: (feature, graph_break, defer): every case a test reads; those read after the step last (the setting stays)
CASES = [("dump", False, False), ("dump", True, False), ("nan", False, False), ("mask", False, False),
         ("dump", False, True), ("nan", False, True)]


@pytest.fixture(scope="module")
def case(tmp_path_factory, inductor_cache):
    """``case(feature, graph_break=False, defer=False)``: (its folder, its output); every case runs in one process,
    once for the module."""
    root = tmp_path_factory.mktemp("compiled")
    folders = [root / f"{f}-{'break' if b else 'one'}-{'later' if d else 'now'}" for f, b, d in CASES]
    for folder in folders:
        folder.mkdir()
    script = root / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": inductor_cache}
    cases = [[f, str(folder), b, d] for (f, b, d), folder in zip(CASES, folders, strict=True)]
    done = subprocess.run([sys.executable, str(script), json.dumps(cases)], capture_output=True, text=True,
                          timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    outs = json.loads(done.stdout.strip().splitlines()[-1])
    found = dict(zip(CASES, zip(folders, outs, strict=True), strict=True))

    def get(feature: str, graph_break: bool = False, defer: bool = False):
        return found[feature, graph_break, defer]
    return get


def rows(tmp_path, iteration: int) -> list[dict[str, str]]:
    with open(tmp_path / "rank_0" / "Net" / "0" / str(iteration) / "statistic.csv", newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("graph_break", [False, True], ids=["one graph", "graph break"])
def test_the_dump_has_a_row_per_node_of_the_compiled_graphs_and_the_numbers_stay(case, graph_break):
    folder, out = case("dump", graph_break)
    assert out["with_obs"] == out["plain"]  # bit for bit: the reductions added change no kernel's result
    assert out["frames"] == out["plain_frames"]
    for iteration in (0, 1):
        found = rows(folder, iteration)
        names = [r["Op Name"] for r in found]
        assert "Default_net-Net_fc1-Linear_Addmm-op0" in names, names
        relu = next(r for r in found if r["Op Type"] == "Relu")
        assert relu["Op Name"].startswith("Default_net-Net_Relu-op") and relu["IO"] == "output"
        expected = out["relu"][iteration]
        assert float(relu["Max Value"]) == pytest.approx(expected[0], rel=1e-5)
        assert float(relu["Min Value"]) == pytest.approx(expected[1], abs=1e-6)
        assert float(relu["Avg Value"]) == pytest.approx(expected[2], rel=1e-5)
        assert float(relu["L2Norm Value"]) == pytest.approx(expected[3], rel=1e-5)
        assert relu["NaN Count"] == "0" and relu["Shape"] == "(4,16)" and relu["Data Type"] == "float32"
        backward = [n for n in names if n.startswith("Gradients_Default_net-Net_fc1-Linear_Mm")]
        assert backward, names  # the weight gradient of fc1, in the backward graph
        assert not [n for n in names if "GraphStats" in n or "GraphBegins" in n]  # obs's own ops are no rows


def test_the_nan_check_names_the_first_node_of_a_compiled_graph(case):
    folder, out = case("nan")
    assert out["with_obs"] == out["plain"] or all(v != v for v in out["plain"])  # NaN losses: both NaN
    found = [json.loads((d / "meta.json").read_text()) for d in (folder / "rank_0" / "nan_check").iterdir()]
    first = min(found, key=lambda m: m["step"])
    assert first["step"] == 1 and first["phase"] == "forward"
    assert first["scope"] == "Default/net-Net" and first["op"] in ("Log", "Sub")  # log(h - 1): its first NaN
    assert first["nan"] > 0


def test_a_mask_that_is_minus_inf_by_design_is_no_finding_of_the_module_check(case):
    folder, out = case("mask")
    assert out["with_obs"] == out["plain"]
    assert not (folder / "rank_0" / "nan_check").exists()


@pytest.mark.parametrize("feature", ["dump", "nan"])
def test_statistics_read_after_the_step_give_the_same_rows_and_findings(case, feature):
    """The CUDA path (the graph's statistics kept on the device, read by a poller after the step, in their place
    among the step's other device values), driven through Inductor's CPU code."""
    (now_path, now), (later_path, later) = case(feature), case(feature, defer=True)
    assert later["with_obs"] == now["with_obs"] or feature == "nan"  # NaN losses
    assert later["frames"] == now["frames"]
    if feature == "dump":
        for iteration in (0, 1):
            want, got = rows(now_path, iteration), rows(later_path, iteration)
            assert len(got) == len(want) > 10
            assert [{k: v for k, v in r.items() if k != "Timestamp"} for r in got] == \
                [{k: v for k, v in r.items() if k != "Timestamp"} for r in want]
        return

    def findings(folder):
        metas = [json.loads((d / "meta.json").read_text()) for d in sorted((folder / "rank_0" / "nan_check").iterdir())]
        return [{k: v for k, v in m.items() if k != "python_stack"} for m in metas]

    assert findings(later_path) == findings(now_path) != []
