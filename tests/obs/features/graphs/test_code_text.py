"""A graph written as PyTorch's code, read back: an FX graph's ops counted, Inductor's code told apart, anything
else refused with what was expected."""

from __future__ import annotations

import pytest

from obs._core.errors import NotOurFileError
from obs.features.graphs.code_text import FX_GRAPH, INDUCTOR_CODE, parse_code, read_code

DYNAMO = '''class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[8, 4][4, 1]cpu"):
        l_x_ = L_x_
        y: "f32[8, 3][3, 1]cpu" = torch._C._nn.linear(l_x_, w, b);  l_x_ = None
        relu: "f32[8, 3][3, 1]cpu" = y.relu();  y = None
        add: "f32[8, 3][3, 1]cpu" = torch.ops.aten.add.Tensor(relu, relu)
        add_1 = torch.ops.aten.add.Tensor(add, 1)
        return (add_1,)
'''


def test_an_fx_graphs_calls_are_its_nodes_by_op():
    code = parse_code(DYNAMO, "g.py", {"graph": "Net"})
    assert (code.kind, code.nodes, code.entry) == (FX_GRAPH, 4, {"graph": "Net"})
    assert dict(code.ops) == {"linear": 1, "relu": 1, "aten.add": 2}


def test_inductors_code_is_told_apart():
    code = parse_code("# AOT ID: ['0_forward']\nfrom ctypes import c_void_p\n", "k.py")
    assert (code.kind, code.nodes, code.ops) == (INDUCTOR_CODE, None, [])


@pytest.mark.parametrize("text", [
    "import torch\n\nclass Net(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n",
    "", "{}", "# IR entry: @x\n"])
def test_other_text_is_refused_naming_what_was_expected(text):
    with pytest.raises(NotOurFileError, match=r"not a graph's code .*class GraphModule.*# AOT ID:"):
        parse_code(text, "x.py")


def test_a_file_that_is_not_text_is_refused(tmp_path):
    path = tmp_path / "x.py"
    path.write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(NotOurFileError, match="not UTF-8"):
        read_code(str(path))
