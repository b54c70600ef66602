"""Step semantics on real training loops: who turns step detection on, and what a step is.

A step is a training step (it ends when ``optimizer.step()`` returns); forwards under
``torch.no_grad()`` / ``torch.inference_mode()`` between steps are evaluation inside the current
step; Print to file alone is enough for steps to be counted.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.optim import optimizer as torch_optimizer

import obs
from obs.runtime.steps import tracker
from obs.runtime.torch import adapter
from printsink.reader import iter_print
from recorder.bundle_reader import load_bundle


class MnistNet(torch.nn.Module):
    """pytorch/examples mnist's network, on 1x28x28 inputs."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 8, 3, 1)
        self.conv2 = torch.nn.Conv2d(8, 16, 3, 1)
        self.dropout = torch.nn.Dropout(0.25)
        self.fc1 = torch.nn.Linear(16 * 12 * 12, 32)
        self.fc2 = torch.nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(self.dropout(x), 1)
        return F.log_softmax(self.fc2(F.relu(self.fc1(x))), dim=1)


def batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 1, 28, 28, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(n)]


def train_epoch(model, opt, data, log=None):
    model.train()
    for data_, target in data:
        opt.zero_grad()
        loss = F.nll_loss(model(data_), target)
        loss.backward()
        opt.step()
        if log is not None:
            log(loss)


def evaluate(model, data, *, inference=False):
    model.eval()
    with torch.inference_mode() if inference else torch.no_grad():
        return sum(F.nll_loss(model(x), t, reduction="sum").item() for x, t in data)


def optimizer_hook_count():
    return len(torch_optimizer._global_optimizer_pre_hooks), len(torch_optimizer._global_optimizer_post_hooks)


# -- who turns step detection on ------------------------------------------------------------------

def test_a_step_demand_installs_detection_and_nothing_else():
    assert optimizer_hook_count() == (0, 0) and not adapter.installed["steps"]
    with tracker.require("a feature stamping steps") as demand:
        assert adapter.installed == {"steps": True, "modules": False, "ops": False, "collectives": False,
                                     "phases": False, "compiles": False, "graph_stats": False}
        assert tracker.demands == ("a feature stamping steps",) and demand.active
        model = MnistNet()
        train_epoch(model, torch.optim.SGD(model.parameters(), lr=0.01), batches(3))
        assert tracker.step == 3 and not tracker.in_step
    assert optimizer_hook_count() == (0, 0) and not adapter.installed["steps"] and not demand.active
    demand.remove()  # idempotent
    assert tracker.demands == ()


def test_a_demand_needs_a_reason():
    with pytest.raises(TypeError, match="reason must be a non-empty str"):
        tracker.require("")


def test_print_to_file_alone_counts_optimizer_steps(tmp_path):
    """Issue 9: with only print_file_path set, every record said step 0 through 21 optimizer steps."""
    obs.set_context(print_file_path=str(tmp_path / "print.pb"))
    assert adapter.installed["steps"], "Print to file must ask for step detection (tracker.require)"
    assert not adapter.installed["modules"] and not adapter.installed["ops"]
    model = MnistNet()
    train_epoch(model, torch.optim.SGD(model.parameters(), lr=0.01), batches(5),
                log=lambda loss: obs.Print("loss:", loss.detach()))
    obs.reset_context()
    assert [call.meta.step for call in iter_print(tmp_path / "print.pb")] == [1, 2, 3, 4, 5]
    assert optimizer_hook_count() == (0, 0)


# -- what a step is -------------------------------------------------------------------------------

def record_steps():
    """Subscribe to steps and module entries; module entries note the step in force and whether one is open."""
    seen = {"begins": [], "modules": []}
    obs.subscribe(obs.Event.STEP_BEGIN, lambda step: seen["begins"].append(step))
    obs.subscribe(obs.Event.MODULE_ENTER, lambda scope, module: seen["modules"].append(
        (scope, tracker.step, tracker.in_step, torch.is_grad_enabled())))
    return seen


def test_eval_before_the_first_and_after_the_last_step_opens_no_step():
    """mnist: an eval after the last optimizer step said "step 201" after 200 steps; nanoGPT's iteration-0
    eval was lumped into step 1."""
    seen = record_steps()
    model = MnistNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    evaluate(model, batches(2, seed=1))  # nanoGPT: estimate_loss() at iter 0, under @torch.no_grad()
    train_epoch(model, opt, batches(4))
    evaluate(model, batches(2, seed=1))  # mnist: test() after the epoch
    evaluate(model, batches(1, seed=1), inference=True)
    assert seen["begins"] == [1, 2, 3, 4] and tracker.step == 4
    roots = [(step, open_) for scope, step, open_, grad in seen["modules"] if scope == "Default/net-MnistNet"]
    assert roots == [(0, False)] * 2 + [(1, True), (2, True), (3, True), (4, True)] + [(4, False)] * 3
    assert all(open_ == grad for _, _, open_, grad in seen["modules"])


def test_eval_between_epochs_stays_in_the_last_step():
    seen = record_steps()
    model = MnistNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(2):
        train_epoch(model, opt, batches(2))
        evaluate(model, batches(1, seed=1))
    assert seen["begins"] == [1, 2, 3, 4]
    evals = [step for scope, step, open_, _ in seen["modules"] if scope == "Default/net-MnistNet" and not open_]
    assert evals == [2, 4]


def test_a_no_grad_forward_inside_a_step_stays_in_it():
    """A teacher / EMA forward under no_grad after the student's forward belongs to the step."""
    seen = record_steps()
    student, teacher = MnistNet(), MnistNet()
    opt = torch.optim.SGD(student.parameters(), lr=0.01)
    for x, t in batches(2):
        opt.zero_grad()
        out = student(x)
        with torch.no_grad():
            soft = teacher(x).exp()
        (F.nll_loss(out, t) + (out.exp() - soft).pow(2).mean()).backward()
        opt.step()
    assert seen["begins"] == [1, 2]
    assert [step for scope, step, open_, _ in seen["modules"] if scope.count("/") == 1] == [1, 1, 2, 2]


def test_compiled_eval_opens_no_step():
    obs.set_context(mode=obs.GRAPH_MODE)
    begins = []
    obs.subscribe(obs.Event.STEP_BEGIN, lambda step: begins.append(step))
    model = obs.compile(MnistNet(), backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    evaluate(model, batches(1, seed=1))
    train_epoch(model, opt, batches(2))
    evaluate(model, batches(1, seed=1))
    assert begins == [1, 2] and tracker.step == 2


def test_explicit_steps_still_count_eval_inside_them():
    seen = record_steps()
    model = MnistNet()
    with obs.step() as number:
        evaluate(model, batches(1))
    assert number == 1 and seen["begins"] == [1]
    assert {step for _, step, _, _ in seen["modules"]} == {1}


def test_recorder_puts_eval_module_events_in_the_current_step(tmp_path):
    """The RDR timeline of a run with eval at iteration 0 and after the last step: two steps, not three or four."""
    config = tmp_path / "obs.json"
    config.write_text(json.dumps({"rdr": {"enable": True, "path": str(tmp_path / "rdr")}}))
    obs.set_context(env_config_path=str(config))
    model = MnistNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    evaluate(model, batches(1, seed=1))
    train_epoch(model, opt, batches(2))
    evaluate(model, batches(1, seed=1))
    path = obs.rdr.dump("eval")
    obs.reset_context()
    events = list(load_bundle(path).iter_events())
    assert [e["step"] for e in events if e["kind"] == "step_begin"] == [1, 2]
    roots = [e["step"] for e in events if e["kind"] == "module_enter" and e["scope"] == "Default/net-MnistNet"]
    assert roots == [0, 1, 2, 2]


def test_a_demand_loads_the_adapter_and_only_then_imports_torch():
    """``import obs`` imports no torch; the first demand loads the adapter, which installs only step hooks."""
    code = (
        "import sys, obs\n"
        "from obs.runtime.steps import tracker\n"
        "assert 'torch' not in sys.modules and 'obs.runtime.torch' not in sys.modules\n"
        "demand = tracker.require('Print to file')\n"
        "from obs.runtime.torch import adapter\n"
        "from torch.optim import optimizer as o\n"
        "print(adapter.installed, len(o._global_optimizer_pre_hooks), len(o._global_optimizer_post_hooks))\n"
        "demand.remove()\n"
        "print(adapter.installed['steps'], len(o._global_optimizer_pre_hooks))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "{'steps': True, 'modules': False, 'ops': False, 'collectives': False, 'phases': False, 'compiles': False, "
        "'graph_stats': False} "
        "1 1",
        "False 0"]


# -- memory at step ends ----------------------------------------------------------------------------

def test_memory_is_read_at_every_step_end():
    """Issue: memory came at steps 1 and 3 of 5 (at most every 50 ms), though the docs say at step ends."""
    seen = []
    obs.subscribe(obs.Event.MEMORY, lambda step, stats: seen.append((step, stats["device"], stats["rss_bytes"] > 0)))
    model = MnistNet()
    train_epoch(model, torch.optim.SGD(model.parameters(), lr=0.01), batches(5))
    assert seen == [(n, "cpu", True) for n in range(1, 6)]


def test_the_rdr_records_memory_at_every_step_end(tmp_path):
    config = tmp_path / "obs.json"
    config.write_text(json.dumps({"rdr": {"enable": True, "path": str(tmp_path / "rdr"), "granularity": "step"}}))
    obs.set_context(env_config_path=str(config))
    model = MnistNet()
    train_epoch(model, torch.optim.SGD(model.parameters(), lr=0.01), batches(5))
    path = obs.rdr.dump("memory")
    obs.reset_context()
    memory = [e for e in load_bundle(path).iter_events() if e["kind"] == "memory"]
    assert [e["step"] for e in memory] == [1, 2, 3, 4, 5] and all(e["used_bytes"] > 0 for e in memory)
