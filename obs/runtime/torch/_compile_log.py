"""Every compile in the process, from PyTorch's structured trace: COMPILE_RECORD events.

torch.compile (any backend), torch.export and obs.compile report each step of a compile through
``torch._logging.trace_structured``: the frame Dynamo starts (with the user's stack), the graph it
captured, AOT autograd's joint, forward, backward and inference graphs, Inductor's post-grad graph and
the code it generated, each graph break (reason and the user's line), each recompile (the guard that
failed) and the compile's metrics.  A graph's record also carries its GraphModule where PyTorch still holds it
(``meta["graph_module"]``; a Dynamo graph of a module its class, ``module``, and its submodules' ``classes``:
:mod:`obs.runtime.torch._compile_graphs`).  ``tlparse`` reads the same records from ``TORCH_TRACE`` files; obs
adds a logging handler to the same logger while someone subscribes to COMPILE_RECORD.  PyTorch builds
these records only while the logger has a handler, and only while it compiles: compiled code runs as
without it.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from obs._core.events import Event, bus
from obs._core.internal import report_internal_error, suppressed

__all__ = ["CompileLog", "KINDS"]

#: Structured-trace record names published, as COMPILE_RECORD kinds (artifacts by their own names)
KINDS = {
    "dynamo_start": "dynamo_start",
    "dynamo_output_graph": "dynamo_output_graph",
    "aot_joint_graph": "aot_joint_graph",
    "aot_forward_graph": "aot_forward_graph",
    "aot_backward_graph": "aot_backward_graph",
    "aot_inference_graph": "aot_inference_graph",
    "inductor_post_grad_graph": "inductor_post_grad_graph",
    "inductor_output_code": "inductor_output_code",
    "compilation_metrics": "compilation_metrics",
}
_ARTIFACTS = {"dynamo_graph_break_reason": "graph_break", "recompile_reasons": "recompile",
              "inductor_post_grad_graph": "inductor_post_grad_graph"}
_ID_KEYS = ("frame_id", "frame_compile_id", "attempt", "rank", "compiled_autograd_id")
#: the kinds that carry a graph (their GraphModule is added to the meta where PyTorch still holds it)
_GRAPHS = {"dynamo_output_graph", "aot_joint_graph", "aot_forward_graph", "aot_backward_graph", "aot_inference_graph",
           "inductor_post_grad_graph"}


class _Handler(logging.Handler):
    """Turns the records of interest into COMPILE_RECORD; string-interning records resolve stack file names."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.files: dict[int, str] = {}

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._publish(getattr(record, "metadata", None), getattr(record, "payload", None))
        except Exception as exc:  # noqa: BLE001 - reported; the compile goes on
            report_internal_error("COMPILE_RECORD", exc)

    def _publish(self, metadata: Any, payload: Any) -> None:
        if not isinstance(metadata, dict):
            return
        name = next((k for k in metadata if k not in _ID_KEYS), None)
        if name == "str":  # ["path", id]: the file names stacks refer to by number
            path, number = metadata["str"]
            self.files[int(number)] = str(path)
            return
        kind = KINDS.get(name or "")
        body = metadata.get(name) if name else None
        if name == "artifact" and isinstance(body, dict):
            kind = _ARTIFACTS.get(body.get("name", ""))
        if kind is None or not bus.has_subscribers(Event.COMPILE_RECORD):
            return
        meta = dict(body) if isinstance(body, dict) else {}
        if kind == "dynamo_start" and isinstance(meta.get("stack"), list):
            meta["stack"] = [self._frame(f) for f in meta["stack"]]
        if kind == "recompile" and isinstance(payload, str):
            try:
                meta["reasons"] = [str(r) for r in json.loads(payload)]
            except ValueError:
                meta["reasons"] = [payload]
        compile_id = f"{metadata.get('frame_id', '-')}/{metadata.get('frame_compile_id', '-')}"
        if metadata.get("compiled_autograd_id") is not None:
            compile_id = f"!{metadata['compiled_autograd_id']}/{compile_id}"
        if kind in _GRAPHS:
            self._add_graph(kind, meta)
        text = payload if isinstance(payload, str) else ""
        with suppressed():
            bus.emit(Event.COMPILE_RECORD, compile_id, kind, meta, text)

    @staticmethod
    def _add_graph(kind: str, meta: dict[str, Any]) -> None:
        """The graph's GraphModule, where PyTorch still holds it (not obs.compile's Dynamo graph: its backend
        publishes it); for a Dynamo graph of a module, its class and its submodules'."""
        from obs.runtime.torch._compile_graphs import compiled_by_obs, compiled_module, logged_graph

        graph, output = logged_graph(kind)
        module = compiled_module(output) if output is not None else None
        if module is not None:
            meta["module"] = type(module).__name__
            meta["classes"] = {name: type(sub).__name__ for name, sub in module.named_modules() if name}
        if graph is not None and not (output is not None and compiled_by_obs(output)):
            meta["graph_module"] = graph

    def _frame(self, frame: Any) -> dict[str, Any]:
        if not isinstance(frame, dict):
            return {}
        filename = frame.get("filename")
        if isinstance(filename, int):
            if filename not in self.files:  # interned before this handler came: PyTorch's table has it
                from torch._logging.structured import INTERN_TABLE

                self.files.update((number, path) for path, number in INTERN_TABLE.items())
            filename = self.files.get(filename, str(filename))
        return {"filename": str(filename), "line": frame.get("line"), "name": frame.get("name")}


class CompileLog:
    """Attached to PyTorch's structured-trace logger until ``remove()``."""

    def __init__(self) -> None:
        from torch._logging._internal import trace_log

        self._log = trace_log
        self._handler = _Handler()
        trace_log.addHandler(self._handler)
        if trace_log.level == logging.NOTSET or trace_log.level > logging.DEBUG:
            trace_log.setLevel(logging.DEBUG)  # PyTorch keeps it at DEBUG; a handler of its own sets it too

    def remove(self) -> None:
        self._log.removeHandler(self._handler)
