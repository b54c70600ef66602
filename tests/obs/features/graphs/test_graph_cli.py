"""``obs graph ls/show/diff/render`` on graphs dumped by a real obs.compile run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from obs.features.graphs.ir_text import ir_text
from obs.features.graphs.model import parse_abstract
from tests.fuzz.targets_graphs import sample_ir
from tests.obs.cli.test_cli import obs_cli, obs_process

SCRIPT = """
import sys, torch, obs
obs.set_context(mode=obs.GRAPH_MODE, save_graphs=int(sys.argv[2]), save_graphs_path=sys.argv[1])
net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
model = obs.compile(net, backend="aot_eager")
model(torch.randn(16, 4)).sum().backward()
model(torch.randn(16, 4, 4)).sum().backward()   # another rank: a recompile
"""


@pytest.fixture(scope="module")
def dumped(tmp_path_factory):
    root = tmp_path_factory.mktemp("graph-cli")
    (root / "train.py").write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(root / "train.py"), str(root / "g"), "2"], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return root / "g"


def test_ls_lists_every_graph_with_counter_stage_nodes_and_step(dumped):
    result = obs_cli("graph", "ls", str(dumped), "--json")
    assert result.returncode == 0, result.stderr
    graphs = json.loads(result.stdout)["graphs"]
    assert [g["stage"] for g in graphs] == ["dynamo_capture", "aot_forward", "aot_backward"] * 2
    assert [g["number"] for g in graphs] == list(range(6))
    assert all(g["nodes"] > 0 and g["step"] in (1, 2) for g in graphs)
    pretty = obs_cli("graph", "ls", str(dumped))
    assert "0003" in pretty.stdout and "aot_backward" in pretty.stdout and "Sequential_1_forward" in pretty.stdout


def test_ls_without_index_reads_the_files_and_names_damaged_ones(tmp_path):
    (tmp_path / "0000_dynamo_capture_a.ir").write_text(ir_text(sample_ir(3)))
    (tmp_path / "0001_dynamo_capture_b.ir").write_text(ir_text(sample_ir(3))[:-40])
    result = obs_cli("graph", "ls", str(tmp_path), "--json")
    assert result.returncode == 1
    data = json.loads(result.stdout)
    assert [g["file"] for g in data["graphs"]] == ["0000_dynamo_capture_a.ir"]
    assert "0001_dynamo_capture_b.ir" in data["problems"][0] and "line" in data["problems"][0]


def test_show_summarizes_ops_params_tensors_and_scopes(dumped):
    forward = next(f for f in sorted(os.listdir(dumped)) if "aot_forward" in f)
    result = obs_cli("graph", "show", str(dumped / forward), "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert dict(data["ops"])["aten.addmm"] == 2 and data["stage"] == "aot_forward"
    assert data["param_bytes"] == (4 * 8 + 8 + 8 * 2 + 2) * 4
    assert data["largest"][0]["type"] == "<Tensor[Float32], (16, 8)>"
    assert "Default/net-Sequential/0-Linear" in data["scopes"]
    pretty = obs_cli("graph", "show", str(dumped / forward))
    for text in ("nodes by op", "aten.addmm", "0.weight", "largest tensors", "0-Linear", "scopes"):
        assert text in pretty.stdout, text


def test_diff_of_a_recompile_names_the_changed_inputs(dumped):
    first, second = sorted(f for f in os.listdir(dumped) if "dynamo_capture" in f)
    same = obs_cli("graph", "diff", str(dumped / first), str(dumped / first))
    assert same.returncode == 0 and "same graph" in same.stdout
    result = obs_cli("graph", "diff", str(dumped / first), str(dumped / second), "--json")
    assert result.returncode == 1
    data = json.loads(result.stdout)
    (name, before, after), = data["inputs_changed"]
    assert (name, before) == ("args.0", "<Tensor[Float32], (16, 4)>") and len(parse_abstract(after).shape) == 3
    assert not data["same"] and data["nodes"] == [3, 3] and any(line.startswith("+linear") for line in data["lines"])
    pretty = obs_cli("graph", "diff", str(dumped / first), str(dumped / second))
    assert pretty.returncode == 1 and "inputs" in pretty.stdout


def test_render_needs_graphviz_and_says_so(dumped, tmp_path):
    forward = next(f for f in sorted(os.listdir(dumped)) if "aot_forward" in f and f.endswith(".ir"))
    result = obs_cli("graph", "render", str(dumped / forward), "-o", str(tmp_path / "f.svg"),
                     env={"PATH": str(tmp_path)})  # no dot on this PATH
    assert result.returncode == 1 and "Graphviz's 'dot' program is not installed" in result.stderr
    assert not (tmp_path / "f.svg").exists()
    fake = tmp_path / "bin" / "dot"  # a stand-in for Graphviz: checks its input is DOT, writes an SVG
    fake.parent.mkdir()
    fake.write_text(f"#!{sys.executable}\nimport sys\ndata = sys.stdin.read()\n"
                    "assert data.startswith('digraph mindspore {') and sys.argv[1] == '-Tsvg'\n"
                    "sys.stdout.write('<svg>' + str(data.count('->')) + '</svg>')\n")
    fake.chmod(0o755)
    result = obs_cli("graph", "render", str(dumped / forward), "-o", str(tmp_path / "f.svg"),
                     env={"PATH": f"{fake.parent}:{os.environ['PATH']}"})
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "f.svg").read_text().startswith("<svg>") and "wrote SVG rendering" in result.stderr


def test_bad_inputs_exit_2(tmp_path):
    (tmp_path / "x.ir").write_text("hello")
    result = obs_cli("graph", "show", str(tmp_path / "x.ir"))
    assert result.returncode == 2 and "not an IR text file" in result.stderr
    assert obs_cli("graph", "show", str(tmp_path / "missing.ir")).returncode == 2
    assert obs_cli("graph", "ls", str(tmp_path / "missing")).returncode == 2


def test_demo_shows_the_feature_and_the_next_commands(tmp_path):
    result = obs_process("demo", "--set", "save_graphs=2", "--steps", "3", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"obs graph ls {tmp_path}" in result.stdout and "graph(s): trace" in result.stdout
    (name,) = [f for f in os.listdir(tmp_path) if f.endswith(".ir")]
    assert f"obs graph show {tmp_path / name}" in result.stdout
    assert (tmp_path / "verbose_ir_files" / name).is_file() and "wrote graph dumps" in result.stderr
