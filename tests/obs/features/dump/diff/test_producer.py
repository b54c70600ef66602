"""`obs dump diff` on real dumps made by obs: the producer of a difference, the ops that carry it on, an inserted op,
eager against compiled (aot_eager), a learning rate; the command's table and JSON."""

from __future__ import annotations

import json
import re

import pytest
import torch

from obs.features.dump import DumpReader
from obs.features.dump.diff import compare_dumps, diff_dumps
from obs.features.dump.diff.metrics import Tolerance
from tests.obs.cli.test_cli import obs_cli
from tests.obs.features.dump.test_reader_cli import dump_config
from tests.training import train_under

LAYER = re.compile(r"layers-ModuleList_(\d+)")


class Block(torch.nn.Module):
    def __init__(self, approximate: str = "none", extra: bool = False):
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)
        self.act = torch.nn.GELU(approximate=approximate)
        self.extra = extra

    def forward(self, x):
        x = self.act(self.fc(x))
        return x * 1.0 if self.extra else x


class MLP(torch.nn.Module):
    """Four hidden layers (Linear and GELU: ``layers.0`` to ``layers.3``) and an output layer (``layers.4``)."""

    def __init__(self, tanh_at: int | None = None, extra_after: int | None = None):
        super().__init__()
        hidden = [Block("tanh" if i == tanh_at else "none", i == extra_after) for i in range(4)]
        self.layers = torch.nn.ModuleList([*hidden, torch.nn.Linear(16, 4)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def dump(root, *, saved="full", lr=1e-3, steps=1, compiled=False, **model):
    """Train ``MLP(**model)`` for ``steps`` steps with obs's data dump on (``saved``: statistic, tensor or full);
    returns the dump's folder."""
    config = dump_config(root, saved)
    torch.manual_seed(0)
    net = MLP(**model)
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    train_under(config, net, opt, [torch.randn(8, 16) * 2 for _ in range(steps)], compiled=compiled)
    return root


def layer(op) -> int | None:
    m = LAYER.search(op.name)
    return int(m.group(1)) if m else None


def test_a_changed_activation_is_the_producer_and_the_later_layers_carry_it(tmp_path):
    a = dump(tmp_path / "tanh", tanh_at=2)
    b = dump(tmp_path / "exact")
    report = compare_dumps(DumpReader(str(a)), DumpReader(str(b)))
    assert report.mode == "tensors" and report.diverged and not report.inserted and not report.removed
    p = report.producer
    assert p is not None and p.op_type == "Gelu" and layer(p) == 2 and "act-GELU" in p.name_a
    assert (p.iteration, p.inputs_agree, p.outputs_agree, p.source) == (0, True, False, "tensors")
    assert 0 < p.max_abs < 1e-2 and p.max_rel > 1e-5 and 0.99 < p.cosine < 1 and p.mean_rel is not None
    assert report.first.op_name == p.name_a and report.first.io == "output"
    forward = [op for op in report.ops if op.phase == "forward" and layer(op) is not None]
    # nothing before layer 2 differs; its GELU is the one producer of the forward; layers 3 and 4 carry it on
    assert all(op.status == "same" for op in forward if layer(op) < 2)
    assert [op for op in report.ops if op.phase == "forward" and op.status == "producer"] == [p]
    carried = {(layer(op), op.op_type) for op in forward if op.status == "carried"}
    assert {(3, "Addmm"), (3, "Gelu"), (4, "Addmm")} <= carried and all(n >= 3 for n, _ in carried)
    # the command: the producer, then the first divergent ops; exit 1
    result = obs_cli("dump", "diff", str(a), str(b), "--top", "5")
    assert result.returncode == 1, result.stderr
    assert "producer" in result.stdout and p.name_a in result.stdout and "first divergences (5 of" in result.stdout
    result = obs_cli("dump", "diff", str(a), str(b), "--json", "--top", "50")
    doc = json.loads(result.stdout)
    assert result.returncode == 1 and doc["diverged"] and doc["mode"] == "tensors"
    assert doc["producer"]["name_a"] == p.name_a and doc["producer"]["status"] == "producer"
    assert doc["producer"]["cosine"] == pytest.approx(p.cosine)
    assert {"layers-ModuleList_3-Block_fc-Linear_Addmm", "layers-ModuleList_4-Linear_Addmm"} <= {
        re.sub(r"-op\d+$", "", d["name_a"]).split("Default_net-MLP_")[-1] for d in doc["divergent"]
        if d["status"] == "carried"}


def test_an_inserted_op_is_listed_and_everything_else_aligns(tmp_path):
    a = dump(tmp_path / "plain", saved="tensor")
    b = dump(tmp_path / "times_one", saved="tensor", extra_after=1)
    report = compare_dumps(DumpReader(str(a)), DumpReader(str(b)))
    assert not report.diverged and report.producer is None and not report.divergent and not report.removed
    inserted = [op.name_b for op in report.inserted]
    assert len(inserted) == 2 and all("layers-ModuleList_1-Block_Mul" in n for n in inserted)  # forward, backward
    assert all(op.status == "same" for op in report.ops if op.status != "inserted")
    # what the earlier diff, matching ops by name, could not do: every op after the Mul has another index in B
    assert sum(op.name_a != op.name_b for op in report.ops if op.status == "same") > 20
    result = obs_cli("dump", "diff", str(a), str(b))
    assert result.returncode == 0 and "no divergence" in result.stdout
    assert "1 only in B (inserted)" not in result.stdout and "2 only in B (inserted)" in result.stdout
    assert "layers-ModuleList_1-Block_Mul" in result.stdout


def test_eager_and_compiled_align_and_agree_within_fp32(tmp_path):
    eager = dump(tmp_path / "eager", steps=2)
    compiled = dump(tmp_path / "compiled", steps=2, compiled=True)
    report = compare_dumps(DumpReader(str(eager)), DumpReader(str(compiled)), tolerance=Tolerance("fp32"))
    assert report.steps == [(0, 0), (0, 1)] and report.mode == "tensors"
    assert not report.diverged and not report.divergent, [op.name for op in report.divergent]
    # every eager op pairs with a compiled one (named by the compiled module only); compiled adds the parameters'
    # detaches and transposes
    assert not report.removed
    paired = [op for op in report.ops if op.status not in ("inserted", "removed")]
    assert all(op.name_b.startswith(("Default_net-MLP_", "Gradients_Default_net-MLP_")) for op in paired
               if op.phase != "parameter" and layer(op) is not None)
    assert {op.op_type for op in report.inserted} <= {"Detach", "T", "Copy"}
    assert report.compared >= 200
    result = obs_cli("dump", "diff", str(eager), str(compiled), "--tolerance", "fp32")
    assert result.returncode == 0 and "no divergence" in result.stdout and "preset fp32" in result.stdout


@pytest.mark.parametrize("saved", ["statistic", "tensor"])
def test_a_learning_rate_names_the_first_parameter_update(tmp_path, saved):
    a = dump(tmp_path / "lr_a", saved=saved, lr=1.01e-3, steps=2)
    b = dump(tmp_path / "lr_b", saved=saved, lr=1e-3, steps=2)
    report = compare_dumps(DumpReader(str(a)), DumpReader(str(b)))
    p = report.producer
    # forward and backward of the first step agree bit for bit: the optimizer's first update makes the difference,
    # named by the parameter it updates
    assert p is not None and (p.iteration, p.op_type, p.phase, p.parameter) == (0, "Add", "forward",
                                                                                   "layers_0_fc_weight")
    assert p.name_a.startswith("Default_Add-op") and p.inputs_agree is True
    assert all(op.status == "same" for op in report.ops if op.index < p.index)
    # in the next step the parameters themselves differ: carried, named
    moved = [op for op in report.divergent if op.iteration == 1 and op.op_type == "Parameter"]
    assert moved and all(op.status == "carried" and op.parameter == op.name_a for op in moved)
    result = obs_cli("dump", "diff", str(a), str(b))
    assert result.returncode == 1 and "layers_0_fc_weight" in result.stdout and p.name_a in result.stdout


def test_the_earlier_answer_stays_available(tmp_path):
    """diff_dumps still gives the first divergent tensor in execution order (now over aligned ops)."""
    a = dump(tmp_path / "tanh", saved="statistic", tanh_at=2)
    b = dump(tmp_path / "exact", saved="statistic")
    found = diff_dumps(DumpReader(str(a)), DumpReader(str(b)))
    assert found.mode == "statistics" and found.compared > 100 and found.steps == [(0, 0)]
    assert found.first is not None and "layers-ModuleList_2-Block_act-GELU_Gelu" in found.first.op_name
    assert found.first.io == "output" and found.first.what in ("max", "min", "avg", "l2norm")
    assert diff_dumps(DumpReader(str(b)), DumpReader(str(b))).first is None
