"""save_graphs on every compile in the process: plain torch.compile, torch.export; graph breaks and recompiles."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import obs
from obs._core.events import Event
from obs.cli import main
from obs.features.graphs.compiles import break_of
from obs.features.graphs.reader import read_ir
from obs.features.graphs.summary import list_graphs
from obs.runtime.torch._adapter import adapter
from tests import training
from tests.training import train_compiled


class Breaks(torch.nn.Module):
    """One graph break (a print), and a recompile when the batch size changes."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.a(x))
        print("between graphs")  # the graph break
        return self.b(x)


BREAK_LINE = Breaks.forward.__code__.co_firstlineno + 2


def train_on_batches_of(sizes: tuple[int, ...] = (2, 2, 3)) -> None:
    """A fresh ``Breaks`` through a plain ``torch.compile`` (aot_eager), a step on a batch of each size in turn."""
    rows = iter(sizes)
    train_compiled(Breaks(), len(sizes), lambda: (torch.randn(next(rows), 4),), backend="aot_eager")


def index(folder) -> dict:
    return json.loads((folder / "index.json").read_text())


@pytest.mark.parametrize("level, stages", [
    (1, ["dynamo_capture"]),
    (2, ["dynamo_capture", "aot_forward", "aot_backward"]),
    (3, ["dynamo_capture", "aot_joint", "aot_forward", "aot_backward"]),
])
def test_a_plain_torch_compile_writes_its_graphs_at_each_level(level, stages, tmp_path, capsys):
    obs.set_context(save_graphs=level, save_graphs_path=str(tmp_path))
    train_on_batches_of()
    graphs = [g for g in index(tmp_path)["graphs"] if g["stage"] != "trace"]  # not the eager step's trace graph
    # forward up to the break (frame 0), the rest of forward after it (frame 1); both again for batch 3
    assert [g["compile"] for g in graphs] == [c for c in ("0/0", "1/0", "0/1", "1/1") for _ in stages]
    assert [g["stage"] for g in graphs] == stages * 4
    assert {g["graph"] for g in graphs} == {"Breaks"}  # the module compiled, also where Dynamo resumes its forward
    assert [g["step"] for g in graphs] == [1] * (2 * len(stages)) + [3] * (2 * len(stages))
    # .ir as obs.compile's: named after the module and the compile, scoped under it, opened by obs graph show
    assert [g["files"]["ir"][5:] for g in graphs[:len(stages)]] == [f"{stage}_Breaks_0-0.ir" for stage in stages]
    first = read_ir(str(tmp_path / graphs[0]["files"]["ir"]))
    assert first.entry == "Breaks_0-0" and first.attrs["compile"] == "0/0"
    assert [n.scope for n in first.graphs[0].nodes] == ["Default/net-Breaks/a-Linear/linear-op0",
                                                        "Default/net-Breaks/relu-op0"]
    assert [p.name for p in first.graphs[0].params] == ["a.weight", "a.bias", "x"]
    if level >= 2:  # an AOT graph's inputs are named after its Dynamo graph's
        forward = read_ir(str(tmp_path / graphs[stages.index("aot_forward")]["files"]["ir"]))
        assert forward.entry == "Breaks_0-0_forward" and [p.name for p in forward.graphs[0].params] == [
            "a.weight", "a.bias", "x"]
    for g in graphs:
        capsys.readouterr()
        assert main(["graph", "show", str(tmp_path / g["files"]["ir"])]) == 0
        assert "@Breaks_" in capsys.readouterr().out


def test_graph_breaks_and_recompiles_name_the_users_line_and_the_guard(tmp_path, capsys):
    obs.set_context(save_graphs=1, save_graphs_path=str(tmp_path))
    train_on_batches_of()
    data = index(tmp_path)
    brk, again = data["breaks"]  # the recompiled forward breaks at the same line
    assert brk["compile"] == "0/0" and brk["function"] == "forward" and again["compile"] == "0/1"
    assert brk["source"] == f"{__file__}:{BREAK_LINE}"
    assert "print" in brk["explanation"]
    recompile, resumed = data["recompiles"]
    assert recompile["compile"] == "0/1" and recompile["function"] == "forward"
    assert "size mismatch" in recompile["reasons"][0]
    assert resumed["compile"] == "1/1" and resumed["function"].startswith("torch_dynamo_resume_in_forward")
    compiles = data["compiles"]
    assert [c["compile"] for c in compiles] == ["0/0", "1/0", "0/1", "1/1"]
    assert compiles[0]["source"] == f"{__file__}:{Breaks.forward.__code__.co_firstlineno}"
    assert compiles[0]["called_from"].startswith(f"{training.__file__}:")  # the training loop's line, not torch's

    listing = list_graphs(str(tmp_path))
    assert listing.breaks[0]["source"] == brk["source"] and listing.recompiles[0]["compile"] == "0/1"
    capsys.readouterr()
    assert main(["graph", "ls", str(tmp_path)]) == 0
    shown = capsys.readouterr().out
    assert "2 graph break(s)" in shown and "2 recompile(s)" in shown and "size mismatch" in shown


def test_level_0_listens_to_no_compile(tmp_path):
    obs.set_context(save_graphs=0)
    assert not adapter.installed["compiles"]
    obs.set_context(save_graphs=1, save_graphs_path=str(tmp_path))
    assert adapter.installed["compiles"]
    obs.set_context(save_graphs=0)
    assert not adapter.installed["compiles"]


def test_graph_dumps_add_nothing_after_compilation(tmp_path, capsys):
    obs.set_context(save_graphs=3, save_graphs_path=str(tmp_path))
    records: list[str] = []
    with obs.subscribe(Event.COMPILE_RECORD, lambda cid, kind, meta, payload: records.append(kind)):
        train_on_batches_of((2,))
        assert records
        written = len(list(tmp_path.iterdir()))
    # the same compiled model run again: no record, no file
    torch._dynamo.reset()
    model = Breaks()
    compiled = torch.compile(model, backend="aot_eager")
    compiled(torch.randn(2, 4)).sum().backward()
    with obs.subscribe(Event.COMPILE_RECORD, lambda cid, kind, meta, payload: records.append(kind)):
        before, files = len(records), len(list(tmp_path.iterdir()))
        for _ in range(3):
            compiled(torch.randn(2, 4)).sum().backward()
        assert len(records) == before and len(list(tmp_path.iterdir())) == files
    assert written > 0


def test_torch_export_writes_the_exported_program(tmp_path, recwarn):
    obs.set_context(save_graphs=1, save_graphs_path=str(tmp_path))
    torch.export.export(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), (torch.randn(2, 4),))
    (graph,) = index(tmp_path)["graphs"]
    assert graph["stage"] == "export" and graph["files"]["ir"].endswith("_export_program.ir")


def test_break_text_is_read_into_source_reason_and_explanation():
    text = ("Graph break in user code at /src/model.py:42\nGraph Break Reason: Unsupported call\n"
            "  Explanation: Dynamo does not know how to trace x\n\nUser code traceback:\n  File \"/src/model.py\"")
    assert break_of(text) == {"source": "/src/model.py:42", "reason": "Unsupported call",
                              "explanation": "Dynamo does not know how to trace x"}
    assert break_of("something else") == {"source": "", "reason": "", "explanation": ""}


@pytest.mark.slow
def test_save_graphs_set_before_torch_is_imported_still_sees_compiles(tmp_path):
    """As under `obs run --set save_graphs=1`: the settings come first (their eager tracer imports torch while
    they are applied), the script imports torch later."""
    script = tmp_path / "train.py"
    script.write_text(
        "import obs, sys\n"
        f"obs.set_context(save_graphs=1, save_graphs_path={str(tmp_path / 'g')!r})\n"
        "import torch\n"
        "model = torch.compile(torch.nn.Linear(4, 2), backend='aot_eager')\n"
        "model(torch.randn(3, 4)).sum().backward()\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    stages = [g["stage"] for g in index(tmp_path / "g")["graphs"]]
    assert "dynamo_capture" in stages


def test_graphs_are_named_after_the_module_compiled_else_the_function(tmp_path):
    """torch.compile(Sequential) compiles torch's own wrapper frame (PyTorch calls it ``inner``): the graph takes the
    class of the module it calls, as obs.compile names it; a compiled function keeps its name."""
    obs.set_context(save_graphs=1, save_graphs_path=str(tmp_path))
    torch._dynamo.reset()
    torch.compile(torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.ReLU()), backend="eager")(torch.randn(3, 4))

    def scaled(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x) * 2

    torch.compile(scaled, backend="eager")(torch.randn(3))
    data = index(tmp_path)
    graphs = [g for g in data["graphs"] if g["stage"] == "dynamo_capture"]
    assert [(g["graph"], g["files"]["ir"][5:]) for g in graphs] == [
        ("Sequential", "dynamo_capture_Sequential_0-0.ir"), ("scaled", "dynamo_capture_scaled_1-0.ir")]
    assert [c["function"] for c in data["compiles"]] == ["inner", "scaled"]  # the frames, as PyTorch names them
    scopes = [n.scope for n in read_ir(str(tmp_path / graphs[0]["files"]["ir"])).graphs[0].nodes]
    assert scopes == ["Default/net-Sequential/0-Linear/linear-op0", "Default/net-Sequential/1-ReLU/relu-op0"]


FX_CODE = '''class GraphModule(torch.nn.Module):
    def forward(self, primals_1: "f32[3, 4][4, 1]cpu", primals_2: "f32[8, 4][4, 1]cpu"):
        # File: /src/model.py:13 in forward, code: y = self.fc1(x)
        permute: "f32[4, 3][1, 4]cpu" = torch.ops.aten.permute.default(primals_1, [1, 0]);  primals_1 = None
        mm: "f32[8, 3][3, 1]cpu" = torch.ops.aten.mm.default(primals_2, permute);  permute = None
        relu: "f32[8, 3][3, 1]cpu" = torch.ops.aten.relu.default(mm);  mm = None
        return (relu,)
'''


def test_a_graph_logged_only_as_code_is_written_as_code_and_shown(tmp_path, capsys):
    """Where a record holds no GraphModule (AOT autograd's cache, Inductor's code) the text is all there is: it is
    written as .py, listed, and obs graph show renders it."""
    obs.set_context(save_graphs=2, save_graphs_path=str(tmp_path))
    stack = [{"filename": "/src/train.py", "line": 20, "name": "<module>"},
             {"filename": "/src/model.py", "line": 12, "name": "forward"}]
    obs.bus.emit(Event.COMPILE_RECORD, "7/0", "dynamo_start", {"stack": stack}, "")
    obs.bus.emit(Event.COMPILE_RECORD, "7/0", "aot_forward_graph", {}, FX_CODE)
    obs.bus.emit(Event.COMPILE_RECORD, "7/0", "compilation_metrics", {"co_name": "forward"}, "")
    (graph,) = index(tmp_path)["graphs"]
    assert (graph["graph"], graph["stage"], graph["nodes"]) == ("forward", "aot_forward", 3)
    assert list(graph["files"]) == ["code"] and graph["files"]["code"][5:] == "aot_forward_forward_7-0.py"
    assert [g.file for g in list_graphs(str(tmp_path)).graphs] == [graph["files"]["code"]]
    capsys.readouterr()
    assert main(["graph", "show", str(tmp_path / graph["files"]["code"])]) == 0
    shown = capsys.readouterr().out
    assert shown.startswith("@forward  stage=aot_forward, compile=7/0, step=1, source=/src/train.py:20\n")
    assert "3 nodes" in shown and "aten.permute" in shown and FX_CODE.splitlines()[-1] in shown
