"""The .ir text: written from real FX graphs, read back by the reader, compared with the graph itself."""

from __future__ import annotations

import pytest
import torch

from obs.features.graphs.describe import describe, frames_of, scope_parts
from obs.features.graphs.ir_text import ir_text
from obs.features.graphs.model import Abstract, format_abstract, parse_abstract
from obs.features.graphs.reader import parse_ir
from tests.fuzz.targets_graphs import sample_ir


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 3)
        self.act = torch.nn.ReLU()
        self.head = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh())

    def forward(self, x):
        y = self.act(self.fc1(x))
        return self.head(y).sum(dim=1, keepdim=True) * 2.0, y


def capture(model, *inputs, **kwargs):
    """The Dynamo graph of ``model`` and its description (made inside the backend, as obs.compile does: Dynamo
    drops the placeholders' sources once the backend returns)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append((gm, describe(gm, "Net_0", stage="dynamo_capture", root_class="Net", **kwargs)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend)(*inputs)
    return graphs[0]


@pytest.fixture(scope="module")
def dynamo_graph():
    return capture(Net(), torch.randn(2, 4))


def test_dynamo_graph_round_trips_with_ops_shapes_and_scopes(dynamo_graph):
    gm, doc = dynamo_graph
    text = ir_text(doc)
    ir = parse_ir(text, "x.ir")
    graph = ir.main
    calls = [n for n in gm.graph.nodes if n.op.startswith("call_")]
    assert [n.name for n in graph.nodes] == [n.name for n in calls]
    assert [n.op for n in graph.nodes] == ["linear", "relu", "linear", "tanh", "sum", "mul"]
    for node, fx in zip(graph.nodes, calls):
        assert node.outputs[0].shape == tuple(fx.meta["example_value"].shape)
        assert node.outputs[0].dtype == "Float32"
    assert [n.scope for n in graph.nodes] == [
        "Default/net-Net/fc1-Linear/linear-op0", "Default/net-Net/act-ReLU/relu-op0",
        "Default/net-Net/head-Sequential/0-Linear/linear-op1", "Default/net-Net/head-Sequential/1-Tanh/tanh-op0",
        "Default/net-Net/sum-op0", "Default/net-Net/mul-op0"]
    params = {p.name: p for p in graph.params}
    assert set(params) == {"x", "fc1.weight", "fc1.bias", "head.0.weight", "head.0.bias"}
    assert params["fc1.weight"].has_default and params["fc1.weight"].abstract.kind == "Ref"
    assert params["fc1.weight"].abstract.shape == (3, 4) and params["x"].abstract.shape == (2, 4)
    assert not params["x"].has_default
    assert graph.nodes[4].attrs == {"dim": "I64(1)", "keepdim": "Bool(1)"}
    assert graph.nodes[5].args[1] == "F64(2.0)"
    assert graph.returns == ["%5", "%1"]
    assert all(len(n.frames) == 1 and n.frames[0].startswith(__file__ + ":") for n in graph.nodes)
    assert "y = self.act(self.fc1(x))" in graph.nodes[0].frames[0]
    for line in ("# IR entry: @Net_0", "# Total subgraphs: 1", "# Total params: 5", "Total number of cnodes: 7",
                 "%para1_fc1.weight: <Ref[Tensor[Float32]], (3, 4), ref_key=fc1.weight, is_parameter>  :  has_default",
                 "      # Fullname with scope: (Default/net-Net/fc1-Linear/linear-op0)"):
        assert line in text.splitlines(), line


def test_verbose_text_adds_strides_devices_and_every_frame(dynamo_graph):
    doc = dynamo_graph[1]
    verbose = parse_ir(ir_text(doc, verbose=True)).main
    plain = parse_ir(ir_text(doc)).main
    assert verbose.nodes[0].outputs[0].extra("strides") == "(3, 1)"
    assert verbose.nodes[0].outputs[0].extra("device") == "cpu"
    assert plain.nodes[0].outputs[0].extras == ()
    assert [n.op for n in verbose.nodes] == [n.op for n in plain.nodes]


def test_scopes_without_class_names(dynamo_graph):
    doc = describe(dynamo_graph[0], "Net_0", stage="dynamo_capture", root_class="Net", keep_class=False)
    assert doc.main.nodes[2].scope == "Default/net/head/0/linear-op1"


def test_backward_stage_scopes_under_gradients():
    stack = {"1": ("L['self'].layer1", object), "2": ("L['self'].layer1[0]", torch.nn.Linear)}
    assert scope_parts(stack, "Net", True) == ["net-Net", "layer1-object", "0-Linear"]
    assert scope_parts({"": ("", type("Root", (), {}))}, None, True) == ["net-Root"]  # export's root entry


def test_uncalled_containers_are_named_as_the_eager_scopes_name_them():
    stack = {"1": ("L['self'].transformer.h.0", "Block"), "2": ("L['self'].transformer.h.0.attn", "Attention")}
    classes = {"transformer": "ModuleDict", "transformer.h": "ModuleList", "transformer.h.0": "Block"}
    assert scope_parts(stack, "GPT", True, classes) == ["net-GPT", "transformer-ModuleDict", "h-ModuleList",
                                                         "0-Block", "attn-Attention"]
    assert scope_parts(stack, "GPT", True) == ["net-GPT", "transformer.h.0-Block", "attn-Attention"]
    assert scope_parts(stack, "GPT", False, classes) == ["net", "transformer", "h", "0", "attn"]


def test_frames_of_an_fx_stack_trace():
    trace = ('  File "/a/train.py", line 12, in forward\n    y = x / 2\n        ^^^\n'
             '  File "/a/model.py", line 3, in f\n    return g(y)\n')
    assert frames_of(trace) == ["/a/train.py:12/y = x / 2/", "/a/model.py:3/return g(y)/"]


@pytest.mark.parametrize("text", ["<Tensor[Float32], (2, 3)>", "<Tensor[BFloat16], ()>", "<Int64, NoShape>",
                                  "<Ref[Tensor[Float32]], (3, 4), ref_key=fc1.weight, is_parameter>",
                                  "<Tuple[Tensor[Float32]*2], TupleShape((3, 4), (3))>",
                                  "<Tuple[Tensor[Int64],Bool], TupleShape((s0, 2), NoShape)>", "<null>",
                                  "<Tensor[Float32], (s0, 4), strides=(4, 1), device=cuda:0, requires_grad>"])
def test_abstracts_round_trip(text):
    assert format_abstract(parse_abstract(text)) == text


def test_abstract_sizes():
    assert parse_abstract("<Tensor[Float16], (2, 3)>").nbytes() == 12
    assert parse_abstract("<Tensor[Float32], (s0, 3)>").nbytes() is None
    assert Abstract("Int64").nbytes() is None


def test_writer_and_reader_agree_on_every_part_of_the_grammar():
    doc = sample_ir(5, subgraphs=3)
    for verbose in (False, True):
        back = parse_ir(ir_text(doc, verbose=verbose))
        assert back.entry == doc.entry and back.attrs == doc.attrs
        assert [g.name for g in back.graphs] == [g.name for g in doc.graphs]
        for got, want in zip(back.graphs, doc.graphs):
            assert [(n.index, n.name, n.op, n.args, n.attrs, n.scope) for n in got.nodes] == \
                   [(n.index, n.name, n.op, n.args, n.attrs, n.scope) for n in want.nodes]
            assert [len(n.frames) for n in got.nodes] == [2 if verbose else 1] * len(want.nodes)
            assert got.returns == want.returns and got.attrs == want.attrs
            assert [p.name for p in got.params] == ["x", "fc1.weight"]
        if verbose:
            assert back.graphs[0].nodes[0].outputs == doc.graphs[0].nodes[0].outputs
