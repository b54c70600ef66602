"""Graphs of every compile in the process, with its graph breaks and recompiles, from COMPILE_RECORD events.

torch.compile (any backend), torch.export, HF Trainer's ``torch_compile=True`` and obs.compile all report
through PyTorch's structured trace (:mod:`obs.runtime.torch._compile_log`).  ``save_graphs`` chooses what
is written, as for obs.compile:

====== =====================================================================================
level  graphs written (``{NNNN}_{stage}_{graph}_{compile}.ir``)
====== =====================================================================================
1      ``dynamo_capture``: the graph Dynamo captured
2      + ``aot_forward``, ``aot_backward``, ``aot_inference`` (after AOT autograd) and
       ``inductor_post_grad`` (the graph Inductor lowers)
3      + ``aot_joint`` and ``inductor_code`` (the code Inductor generated)
====== =====================================================================================

A graph is named after the module compiled (its class, as obs.compile names it), else the function, and is
written as ``.ir`` with its verbose copy and ``.dot`` as the level asks, where the record carries its
GraphModule; where PyTorch logged only code text (Inductor's generated code, AOT autograd's cache) that text is
written as ``.py``.  At every level ``index.json`` lists each compile (``compiles``: the function, its source
line, the graph's op count, why it failed), each graph break (``breaks``: the reason and the user's line) and
each recompile (``recompiles``: the guards that failed).  obs.compile's own graphs are published by its backend,
so its Dynamo and AOT graphs are not written twice.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, MutableSet
from typing import Any

from obs._core.internal import report_internal_error
from obs.features.graphs.code_text import fx_ops
from obs.features.graphs.folder import GraphFiles, Written
from obs.features.graphs.ir_text import user_frame

__all__ = ["STAGES", "CompileRecords"]

#: COMPILE_RECORD kind -> (stage, lowest save_graphs level that writes it)
STAGES = {
    "dynamo_output_graph": ("dynamo_capture", 1),
    "aot_forward_graph": ("aot_forward", 2),
    "aot_backward_graph": ("aot_backward", 2),
    "aot_inference_graph": ("aot_inference", 2),
    "inductor_post_grad_graph": ("inductor_post_grad", 2),
    "aot_joint_graph": ("aot_joint", 3),
    "inductor_output_code": ("inductor_code", 3),
}
_OBS_COMPILE_WRITES = {"dynamo_capture", "aot_forward", "aot_backward", "aot_inference", "aot_joint"}
_BREAK_AT = re.compile(r"Graph break in user code at (?P<source>\S+:\d+)")
_KEPT_REASON = 2000


def break_of(text: str) -> dict[str, str]:
    """``{"source", "reason", "explanation"}`` of a graph break's text (PyTorch's ``dynamo_graph_break_reason``)."""
    m = _BREAK_AT.search(text)
    lines = [line.strip() for line in text.split("User code traceback:", 1)[0].splitlines()]
    reason = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("Graph Break Reason:")), "")
    explanation = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("Explanation:")), "")
    return {"source": m.group("source") if m else "", "reason": reason[:_KEPT_REASON],
            "explanation": explanation[:_KEPT_REASON]}


#: a graph to write: (COMPILE_RECORD kind, PyTorch's code text, index fields, its description or None)
_Graph = tuple[str, str, dict[str, Any], Any]
#: writes a described graph's files: (IrFile, graph, file name, index fields) -> what was written
WriteIr = Callable[[Any, str, str, dict[str, Any]], Written | None]


class CompileRecords:
    """Writes what each COMPILE_RECORD asks for into the folder ``files()`` returns (a described graph through
    ``write_ir``), at the level ``level()`` says; ``own`` holds the ids of obs.compile's compiles (its backend adds
    them; a new compile with a reused id, after ``torch._dynamo.reset()``, is taken out)."""

    def __init__(self, files: Callable[[], GraphFiles], write_ir: WriteIr, level: Callable[[], int],
                 own: MutableSet[str], step: Callable[[], int]) -> None:
        self._files, self._write_ir, self._level, self._own, self._step = files, write_ir, level, own, step
        self._lock = threading.Lock()
        self._starts: dict[str, dict[str, Any]] = {}  # compile id -> the compiled function and its caller
        self._functions: dict[str, str] = {}  # frame id -> its function (a recompile is reported before its start)
        self._pending: dict[str, list[_Graph]] = {}  # graphs of compiles not yet ended
        # compile id -> the module compiled and its Dynamo graph's inputs (kept: Inductor compiles a backward lazily)
        self._modules: dict[str, dict[str, Any]] = {}

    def on_record(self, compile_id: str, kind: str, meta: dict[str, Any], payload: str) -> None:
        try:
            self._record(compile_id, kind, meta, payload)
        except OSError as exc:
            report_internal_error(f"save_graphs: writing compile {compile_id}'s {kind}", exc)

    def _record(self, compile_id: str, kind: str, meta: dict[str, Any], payload: str) -> None:
        if kind == "dynamo_start":
            stack = [f for f in meta.get("stack", ()) if isinstance(f, dict)]
            frames = [f"{f.get('filename')}:{f.get('line')}" for f in stack]
            function = str(stack[-1].get("name", "")) if stack else ""
            self._own.discard(compile_id)
            with self._lock:
                self._starts[compile_id] = {"function": function, "called_from": user_frame(frames[:-1]) or ""}
                self._pending[compile_id] = []
                self._functions[compile_id.split("/")[0]] = function
            return
        level = self._level()
        if level <= 0:
            return
        start = self._starts.get(compile_id, {})
        where = {"compile": compile_id, "step": self._step()}
        if kind in STAGES:
            stage, lowest = STAGES[kind]
            if level < lowest or not payload or compile_id == "-/-":  # no Dynamo compile: export's own passes
                return
            if stage in _OBS_COMPILE_WRITES and compile_id in self._own:  # obs.compile's backend publishes it
                return
            graph = (kind, payload, where, self._describe(compile_id, kind, meta, payload))
            with self._lock:
                pending = self._pending.get(compile_id)
                if pending is not None:  # obs.compile's backend is only known to be this compile's at its end
                    pending.append(graph)
                    return
            self._write(compile_id, *graph)
        elif kind == "graph_break":
            self._files().note("breaks", {**where, "function": start.get("function", ""), **break_of(payload)})
        elif kind == "recompile":
            self._files().note("recompiles", {**where, "function": self._functions.get(compile_id.split("/")[0], ""),
                                              "reasons": [str(r) for r in meta.get("reasons", ())]})
        elif kind == "compilation_metrics":
            with self._lock:
                pending = self._pending.pop(compile_id, [])
            for graph in pending:
                self._write(compile_id, *graph)
            self._files().note("compiles", {
                **where, "function": str(meta.get("co_name") or start.get("function", "")),
                "source": f"{meta.get('co_filename')}:{meta.get('co_firstlineno')}" if meta.get("co_filename") else "",
                "called_from": start.get("called_from", ""), "graph_ops": meta.get("graph_op_count"),
                "failed": meta.get("fail_reason") or None, "recompile_reason": meta.get("recompile_reason") or None})

    def _graph_name(self, compile_id: str) -> str:
        """What the compile's graphs are named after: the module compiled (its class), else the function."""
        return (self._modules.get(compile_id, {}).get("module") or self._starts.get(compile_id, {}).get("function")
                or "graph")

    def _file_name(self, compile_id: str, kind: str, payload: str) -> str:
        name = f"{self._graph_name(compile_id)}_{compile_id.replace('/', '-')}"
        if kind == "inductor_post_grad_graph":  # forward and backward share the compile id: tell them apart
            name += "_backward" if "tangents_" in payload else "_forward"
        return name

    def _describe(self, compile_id: str, kind: str, meta: dict[str, Any], payload: str) -> Any:
        """The record's graph as an IrFile, described now, while PyTorch holds it as it logged it; None where the
        record carries no GraphModule (its code text is written instead)."""
        gm = meta.get("graph_module")
        stage = STAGES[kind][0]
        try:
            if kind == "dynamo_output_graph":  # what the compile's graphs are named after, its AOT graphs' inputs
                from obs.features.graphs.describe import input_names

                with self._lock:
                    self._modules[compile_id] = {"module": meta.get("module"), "classes": meta.get("classes"),
                                                 "inputs": None if gm is None else input_names(gm)}
            if gm is None:
                return None
            from obs.features.graphs.describe import describe_logged

            module = self._modules.get(compile_id, {})
            name = self._file_name(compile_id, kind, payload)  # Net_0-0; an AOT graph Net_0-0_forward, as obs.compile
            if stage != "dynamo_capture":
                name += "_" + stage.removeprefix("aot_").removeprefix("inductor_")
            return describe_logged(gm, name, stage=stage, compile_id=compile_id, root_class=module.get("module"),
                                   classes=module.get("classes"),
                                   inputs=None if stage == "dynamo_capture" else module.get("inputs"))
        except Exception as exc:  # noqa: BLE001 - reported (raised in tests); its code text is written instead
            report_internal_error(f"save_graphs: describing compile {compile_id}'s {kind}", exc)
            return None

    def _write(self, compile_id: str, kind: str, payload: str, where: dict[str, Any], doc: Any) -> None:
        stage = STAGES[kind][0]
        if stage in _OBS_COMPILE_WRITES and compile_id in self._own:
            return
        graph, name = self._graph_name(compile_id), self._file_name(compile_id, kind, payload)
        meta = {**where, "source": self._starts.get(compile_id, {}).get("called_from", "")}
        if doc is not None:
            self._write_ir(doc, graph, name, meta)
            return
        self._files().write_code(graph=graph, stage=stage, name=name, text=payload, meta={
            **meta, "nodes": None if kind == "inductor_output_code" else sum(fx_ops(payload).values())})

