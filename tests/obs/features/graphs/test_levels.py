"""save_graphs levels 0-3 through obs.compile: exactly the documented files, the counter, index.json, folders."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys

import pytest
import torch

import obs
from obs.features.graphs import read_ir
from obs.features.graphs.folder import next_number
from tests.obs.features.graphs.nets import Net
from tests.training import train


def parse_dot(path: str):
    """pydot's graph of a .dot file (pydot still calls pyparsing's pre-3.0 names: their warnings are not ours)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import pydot

        (graph,) = pydot.graph_from_dot_file(path)
    return graph


def train_obs_compiled(steps: int = 2, batch: int = 8) -> None:
    """A fresh ``Net`` through ``obs.compile`` (aot_eager), trained ``steps`` steps that obs detects."""
    torch._dynamo.reset()
    train(steps, obs.compile(Net(), backend="aot_eager"), batch=batch, marked=False)


def files(folder) -> list[str]:
    out = []
    for root, _, names in os.walk(folder):
        out += [os.path.relpath(os.path.join(root, n), folder) for n in names]
    return sorted(out)


def numbers_from(start: int, names: list[str]) -> list[str]:
    """The names with their 4-digit prefix made relative to ``start`` (the process-wide counter goes on)."""
    out = []
    for name in names:
        folder, base = os.path.split(name)
        if base[:4].isdigit():
            base = re.sub(r"_(\w+?)_\d+\.", r"_\1_N.", f"{int(base[:4]) - start:04d}{base[4:]}")
        out.append(os.path.join(folder, base))
    return sorted(out)


@pytest.mark.parametrize("level, expected", [
    (0, []),
    (1, ["0000_dynamo_capture_Net_N.ir", "index.json"]),
    (2, ["0000_dynamo_capture_Net_N.ir", "0001_aot_forward_Net_N.ir", "0002_aot_backward_Net_N.ir", "index.json",
         "verbose_ir_files/0000_dynamo_capture_Net_N.ir", "verbose_ir_files/0001_aot_forward_Net_N.ir",
         "verbose_ir_files/0002_aot_backward_Net_N.ir"]),
    (3, ["0000_dynamo_capture_Net_N.ir", "0001_dynamo_capture_Net_N.dot", "0002_aot_joint_Net_N.ir",
         "0003_aot_joint_Net_N.dot", "0004_aot_forward_Net_N.ir", "0005_aot_forward_Net_N.dot",
         "0006_aot_backward_Net_N.ir", "0007_aot_backward_Net_N.dot", "index.json",
         "verbose_ir_files/0000_dynamo_capture_Net_N.ir", "verbose_ir_files/0002_aot_joint_Net_N.ir",
         "verbose_ir_files/0004_aot_forward_Net_N.ir", "verbose_ir_files/0006_aot_backward_Net_N.ir"]),
])
def test_each_level_writes_exactly_its_files(tmp_path, level, expected, monkeypatch):
    monkeypatch.setattr("shutil.which", lambda name: None)  # no Graphviz: no .svg (CI has none either)
    folder = tmp_path / "graphs"
    obs.set_context(mode=obs.GRAPH_MODE, save_graphs=level, save_graphs_path=str(folder))
    start = next_number()
    train_obs_compiled()
    if not level:
        assert not folder.exists()
        return
    assert numbers_from(start + 1, files(folder)) == expected
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    assert all(stat.S_IMODE(os.stat(folder / f).st_mode) == 0o600 for f in files(folder))
    index = json.loads((folder / "index.json").read_text())
    stages = {1: ["dynamo_capture"], 2: ["dynamo_capture", "aot_forward", "aot_backward"],
              3: ["dynamo_capture", "aot_joint", "aot_forward", "aot_backward"]}[level]
    assert [e["stage"] for e in index["graphs"]] == stages
    assert len({e["compile"] for e in index["graphs"]}) == 1 and all(e["step"] == 1 for e in index["graphs"])
    for entry in index["graphs"]:
        ir = read_ir(str(folder / entry["files"]["ir"]))
        assert ir.attrs["stage"] == entry["stage"] and entry["nodes"] == len(ir.main.nodes)
        if level == 3:
            dot = parse_dot(str(folder / entry["files"]["dot"]))
            cluster = dot.get_subgraphs()[0]
            assert len(cluster.get_nodes()) == len(ir.main.params) + len(ir.main.nodes) + 1  # + Return


def test_backward_graph_names_and_scopes(tmp_path):
    obs.set_context(mode=obs.GRAPH_MODE, save_graphs=2, save_graphs_path=str(tmp_path))
    train_obs_compiled()
    (bw,) = [f for f in os.listdir(tmp_path) if "aot_backward" in f]
    ir = read_ir(str(tmp_path / bw))
    assert re.fullmatch(r"Net_\d+_backward", ir.entry)
    assert all(n.scope.startswith("Gradients/Default/net-Net/") for n in ir.main.nodes)
    assert any(n.scope.startswith("Gradients/Default/net-Net/fc1-Linear/") for n in ir.main.nodes)
    assert "x" in {p.name for p in ir.main.params}  # AOT's primals named after the Dynamo graph's inputs
    (fw,) = [f for f in os.listdir(tmp_path) if "aot_forward" in f]
    assert {p.name for p in read_ir(str(tmp_path / fw)).main.params} == \
           {"x", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}


def test_counter_is_one_sequence_across_graphs_and_recompiles(tmp_path):
    obs.set_context(mode=obs.GRAPH_MODE, save_graphs=1, save_graphs_path=str(tmp_path))
    torch._dynamo.reset()
    fn = obs.compile(lambda x: torch.sin(x) + 1, backend="eager")
    fn(torch.ones(3))
    fn(torch.ones(3, 5))  # a recompile (new rank): a new graph, the next number
    g = obs.compile(lambda x: torch.cos(x), backend="eager")
    g(torch.ones(2))
    index = json.loads((tmp_path / "index.json").read_text())["graphs"]
    numbers = [e["number"] for e in index]
    assert numbers == list(range(numbers[0], numbers[0] + 3))
    assert all(re.fullmatch(r"\d{4}_dynamo_capture_lambda_+\d+\.ir", e["files"]["ir"]) for e in index)
    first, second = (read_ir(str(tmp_path / e["files"]["ir"])) for e in index[:2])
    tensors = [[p.abstract for p in ir.main.params if p.abstract.is_tensor] for ir in (first, second)]
    assert tensors[0][0].shape == (3,) and len(tensors[1][0].shape) == 2  # dims may be symbols (s0) after a recompile


def test_names_from_code_stay_inside_the_folder(tmp_path):
    folder = tmp_path / "g"
    obs.set_context(mode=obs.GRAPH_MODE, save_graphs=1, save_graphs_path=str(folder))

    def evil(x):
        return x * 2

    evil.__name__ = "../../../escape/..\\x"
    torch._dynamo.reset()
    obs.compile(evil, backend="eager")(torch.ones(2))
    (name,) = [f for f in os.listdir(folder) if f.endswith(".ir")]
    assert "/" not in name and "\\" not in name and not name.startswith(".")
    assert os.path.dirname(os.path.realpath(folder / name)) == os.path.realpath(folder)
    assert sorted(os.listdir(tmp_path)) == ["g"]


def test_level_change_applies_to_graphs_compiled_after(tmp_path):
    obs.set_context(mode=obs.GRAPH_MODE, save_graphs=0, save_graphs_path=str(tmp_path / "g"))
    torch._dynamo.reset()
    fn = obs.compile(lambda x: x.exp(), backend="eager")
    fn(torch.ones(2))
    assert not (tmp_path / "g").exists()
    obs.set_context(save_graphs=True)  # True means 2
    assert obs.get_context("save_graphs") == 2
    fn(torch.ones(2, 2))
    assert sorted(os.listdir(tmp_path / "g")) != [] and (tmp_path / "g" / "verbose_ir_files").is_dir()
    obs.set_context(save_graphs=False)
    before = sorted(os.listdir(tmp_path / "g"))
    fn(torch.ones(2, 2, 2))
    assert sorted(os.listdir(tmp_path / "g")) == before


def test_rank_folders_under_distributed_training(tmp_path):
    obs.set_auto_parallel_context(device_num=4, global_rank=3)
    obs.set_context(mode=obs.GRAPH_MODE, save_graphs=1, save_graphs_path=str(tmp_path))
    torch._dynamo.reset()
    obs.compile(lambda x: x + 1, backend="eager")(torch.ones(2))
    assert os.listdir(tmp_path) == ["rank_3"]
    assert any(f.endswith(".ir") for f in os.listdir(tmp_path / "rank_3"))


@pytest.mark.slow
def test_inductor_forward_and_backward_graphs(tmp_path):
    """inductor's own AOT graphs (taken at its inner_compile); in a process of its own: inductor keeps worker
    threads for the rest of the process."""
    script = tmp_path / "train.py"
    script.write_text(
        "import torch, obs\n"
        f"obs.set_context(mode=obs.GRAPH_MODE, save_graphs=2, save_graphs_path={str(tmp_path / 'g')!r})\n"
        "model = obs.compile(torch.nn.Linear(4, 2))\n"
        "model(torch.randn(3, 4)).sum().backward()\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    everything = json.loads((tmp_path / "g" / "index.json").read_text())["graphs"]
    index = [e for e in everything if e["stage"] != "inductor_post_grad"]
    assert [e["stage"] for e in index] == ["dynamo_capture", "aot_forward", "aot_backward"]
    assert [e["graph"] for e in index] == ["Linear_0", "Linear_0_forward", "Linear_0_backward"]
    # and the graphs Inductor lowered, forward and backward, from PyTorch's structured trace (as .ir: the record
    # carries the graph)
    post_grad = [e for e in everything if e["stage"] == "inductor_post_grad"]
    assert [e["files"]["ir"].rsplit("_", 1)[1] for e in post_grad] == ["forward.ir", "backward.ir"]
    assert [read_ir(str(tmp_path / "g" / e["files"]["ir"])).attrs["stage"] for e in post_grad] == [
        "inductor_post_grad"] * 2
    forward = read_ir(str(tmp_path / "g" / index[1]["files"]["ir"]))
    assert {p.name for p in forward.main.params} >= {"weight", "bias"}


def test_a_backend_without_aot_autograd_runs_behind_it_at_level_2(tmp_path):
    obs.set_context(mode=obs.GRAPH_MODE, save_graphs=2, save_graphs_path=str(tmp_path))
    torch._dynamo.reset()
    seen = []

    def backend(gm, example_inputs):  # a user's backend: it compiles each graph AOT autograd made
        seen.append(sorted({str(n.target).split(".")[0] for n in gm.graph.nodes if n.op == "call_function"}))
        return gm.forward

    net = Net()
    x = torch.randn(8, 4)
    expected = net(x)
    out = obs.compile(net, backend=backend)(x)
    out.sum().backward()
    assert torch.allclose(out, expected) and net.fc1.weight.grad is not None
    assert seen == [["aten"], ["aten"]]  # forward and backward, both aten graphs
    stages = [e["stage"] for e in json.loads((tmp_path / "index.json").read_text())["graphs"]]
    assert stages == ["dynamo_capture", "aot_forward", "aot_backward"]


def test_level_3_renders_an_svg_beside_each_dot_where_graphviz_is(tmp_path, monkeypatch):
    fake = tmp_path / "bin" / "dot"  # a stand-in for Graphviz's dot (none on the CI machines)
    fake.parent.mkdir()
    fake.write_text(f"#!{sys.executable}\nimport sys\nassert sys.argv[1] == '-Tsvg'\n"
                    "sys.stdout.write('<svg>' + str(sys.stdin.read().count('->')) + '</svg>')\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    folder = tmp_path / "g"
    obs.set_context(mode=obs.GRAPH_MODE, save_graphs=3, save_graphs_path=str(folder))
    torch._dynamo.reset()
    obs.compile(lambda x: torch.relu(x) * 2, backend="eager")(torch.ones(3))
    entry = json.loads((folder / "index.json").read_text())["graphs"][0]
    assert entry["files"]["svg"] == entry["files"]["dot"][:-4] + ".svg"
    assert (folder / entry["files"]["svg"]).read_text().startswith("<svg>")
