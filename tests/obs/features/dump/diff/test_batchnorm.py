"""`obs dump diff` on a Conv-BatchNorm model: eager's BatchNorm pairs with the one aot_eager runs, and an optimizer's
op whose first input two parameters (or two ops) share names no parameter."""

from __future__ import annotations

import pytest
import torch

from obs.features.dump import DumpReader
from obs.features.dump.diff import compare_dumps
from obs.features.dump.diff.metrics import Tolerance
from tests.obs.features.dump.test_reader_cli import dump_config
from tests.training import train_under


class ConvBN(torch.nn.Module):
    """Two Conv-BatchNorm-ReLU blocks of one width (their BatchNorms' weights and biases start equal); the second
    BatchNorm in eval mode."""

    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4)
        self.conv2, self.bn2 = torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.BatchNorm2d(4)
        self.fc = torch.nn.Linear(4, 2)
        self.bn2.eval()

    def forward(self, x):
        x = torch.relu(self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))
        return self.fc(x.mean((2, 3)))


def dump(root, *, compiled=False, lr=0.1, noise=0.0, optimizer=torch.optim.SGD, zero_fc_weight=False):
    """One step of ``ConvBN`` with a statistic dump (``noise``: added to the data); the dump's folder."""
    config = dump_config(root, "statistic")
    torch.manual_seed(0)
    net = ConvBN()
    if zero_fc_weight:
        torch.nn.init.zeros_(net.fc.weight)
    x = torch.randn(2, 3, 6, 6)
    train_under(config, net, optimizer(net.parameters(), lr=lr), [x + noise * torch.randn_like(x)], compiled=compiled)
    return root


@pytest.mark.slow
def test_eager_batchnorm_pairs_with_aot_eagers_in_training_and_eval(tmp_path):
    eager, compiled = dump(tmp_path / "eager"), dump(tmp_path / "compiled", compiled=True)
    report = compare_dumps(DumpReader(str(eager)), DumpReader(str(compiled)), tolerance=Tolerance("fp32"))
    assert not report.diverged, [op.name for op in report.divergent]
    norms = [(op.op_type, op.name_b.rsplit("_", 1)[-1].split("-")[0], op.status) for op in report.ops
             if op.phase == "forward" and "BatchNorm" in op.op_type and "Backward" not in op.op_type]
    # eager's running statistics are read before BatchNorm writes them: its inputs agree with the functional op's
    assert norms == [("NativeBatchNorm", "NativeBatchNormLegitFunctional", "same"),
                     ("NativeBatchNorm", "NativeBatchNormLegitNoTraining", "same")]
    # what stays unpaired (docs/dumps.md): the graph's Detach, T and Copy (its buffers written back), eager's Detach
    # of a saved output read back in backward
    assert {op.op_type for op in report.inserted} <= {"Detach", "T", "Copy"}
    assert {op.op_type for op in report.removed} <= {"Detach"}


def test_an_update_whose_first_input_is_ambiguous_names_no_parameter(tmp_path):
    a, b = dump(tmp_path / "a", lr=0.101), dump(tmp_path / "b")
    report = compare_dumps(DumpReader(str(a)), DumpReader(str(b)))
    updates = [op.parameter for op in report.ops if op.status == "producer" and op.name_a.startswith("Default_Add")]
    # SGD adds each gradient to its parameter (conv1's bias gets none: a BatchNorm follows); bn1's and bn2's weights
    # (ones) and biases (zeros) are alike, so their updates name none
    assert updates == ["conv1_weight", None, None, "conv2_weight", "conv2_bias", None, None, "fc_weight", "fc_bias"]


def test_a_value_two_optimizer_ops_start_from_names_no_parameter(tmp_path):
    a = dump(tmp_path / "a", lr=0.101, noise=0.01, optimizer=torch.optim.Adam, zero_fc_weight=True)
    b = dump(tmp_path / "b", optimizer=torch.optim.Adam, zero_fc_weight=True)
    report = compare_dumps(DumpReader(str(a)), DumpReader(str(b)))
    named = {(op.op_type, op.parameter) for op in report.ops if op.parameter and op.op_type != "Parameter"}
    # Adam's first step starts fc.weight's moments from zeros, as fc.weight is: their Lerp and Addcmul and its
    # Addcdiv start from one value, and name nothing; fc.bias's Addcdiv (the others' gradients are zero) names it
    assert named == {("Addcdiv", "fc_bias")}
    fc_weight = [op for op in report.divergent if op.op_type in ("Lerp", "Addcmul", "Addcdiv") and op.parameter is None]
    assert len(fc_weight) == 3
