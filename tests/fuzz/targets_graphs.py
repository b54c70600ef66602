"""Fuzz targets: ``.ir`` files through ``read_ir`` (+ the summary and diff built on it) and ``obs graph``.

Seeds are written by the real writer: plain and verbose text of a graph with weights, tuples,
symbolic dims, scalars, kwargs, quoted strings and several subgraphs, the DOT of it (not an .ir
file), and an eager-style trace graph.
"""

from __future__ import annotations

import os

from obs.features.graphs.dot import dot_text
from obs.features.graphs.ir_text import ir_text
from obs.features.graphs.model import Abstract, Graph, IrFile, Node, Param
from obs.features.graphs.reader import read_ir
from obs.features.graphs.summary import diff_graphs, summarize
from tests.fuzz import Rejected, Target, cli_exit


def sample_ir(n: int = 6, *, subgraphs: int = 1) -> IrFile:
    """A graph exercising every part of the grammar (used by the tests too)."""
    graphs = []
    for g in range(subgraphs):
        x = Param(1, "x", Abstract("Tensor", "Float32", ("s0", 4), ("strides=(4, 1)", "device=cpu")))
        w = Param(2, "fc1.weight", Abstract("Ref", "Float32", (3, 4), ("ref_key=fc1.weight", "is_parameter")),
                  has_default=True)
        graph = Graph(f"Net_{g}" if g == 0 else f"sub_{g}", [x, w], attrs={"stage": "dynamo_capture"},
                      frames=["/home/u/train.py:10/def forward(self, x):/"])
        prev = "%para1_x"
        for i in range(n):
            out = Abstract("Tensor", "Float32", ("s0", 3), ("strides=(3, 1)",))
            if i % 3 == 2:
                out = Abstract("Tuple", elements=(out, Abstract("Int64", extras=("value=s0",))))
            graph.nodes.append(Node(i, f"op_{i}", "aten.addmm" if i % 2 else "linear",
                                    [prev, "%para2_fc1.weight", "I64(1)", '"a, (b) <c> \\"q\\""', "(I64(0), F64(0.5))"],
                                    {"keepdim": "Bool(1)", "dim": "[I64(0), I64(1)]"} if i % 2 else {},
                                    [x.abstract, w.abstract, Abstract("Int64")], [out],
                                    f"Default/net-Net/fc{i}-Linear/linear-op{i}",
                                    ["/home/u/train.py:20/y = self.fc1(x) / 2/", f"/home/u/model.py:{i}/z = f(y)/"]))
            prev = f"%{i}"
        graph.returns = [prev, "None"]
        graph.return_types = [Abstract("Tensor", "BFloat16", ()), Abstract("None")]
        graphs.append(graph)
    return IrFile("Net_0", graphs, {"stage": "dynamo_capture", "compile": "Net_0", "step": "3"})


def _seeds(scratch: str) -> list[bytes]:
    plain = sample_ir()
    return [ir_text(plain).encode(), ir_text(plain, verbose=True).encode(),
            ir_text(sample_ir(3, subgraphs=3)).encode(), ir_text(sample_ir(0)).encode(),
            dot_text(plain).encode(), "# IR entry: @é中\n# Total subgraphs: 0\n".encode()]


def _place(folder: str, data: bytes) -> str:
    path = os.path.join(folder, "0000_dynamo_capture_Net_0.ir")
    with open(path, "wb") as fh:
        fh.write(data)
    return path


def _api(path: str) -> None:
    ir = read_ir(path)
    summarize(ir)
    assert diff_graphs(ir, ir).same, "a graph differs from itself"


def _cli(path: str) -> None:
    codes = []
    for argv in (("graph", "show", path), ("graph", "show", "--json", path), ("graph", "ls", os.path.dirname(path)),
                 ("graph", "diff", path, path)):
        try:
            codes.append(cli_exit(*argv))
        except Rejected as exc:
            codes.append(exc.args[0])
    show, show_json, ls, diff = codes
    assert show == show_json, f"show exits {show}, with --json {show_json}"
    assert ls == (1 if show else 0), f"ls exits {ls} where show exits {show}"
    assert diff == (show if show else 0), f"diff of a file with itself exits {diff} (show {show})"
    if show:
        raise Rejected(show)


TARGETS = [
    Target("graph_ir_api", _seeds, _api, _place),
    Target("graph_ir_cli", _seeds, _cli, _place),
]
