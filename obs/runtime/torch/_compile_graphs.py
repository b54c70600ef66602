"""The FX graph behind a compile record of PyTorch's structured trace, and the module Dynamo compiled.

PyTorch logs each graph of a compile as its code text (``print_readable``), and the GraphModule itself is a
local of the function that logs it while the record is handled (:mod:`obs.runtime.torch._compile_log`'s handler
runs inside that call): Dynamo's ``compile_and_call_fx_graph`` holds ``gm``, AOT autograd's ``_log_fw_bw_graphs``
``fw_module`` and ``bw_module``, and so on.  :func:`logged_graph` finds it there, so that a plain ``torch.compile``'s
graphs are described as ``.ir``, as obs.compile's are.  Where a record is made from text only (AOT autograd's
cache, Inductor's generated code) or a PyTorch release renames the local, it finds nothing, and the code text is
all there is.

:func:`compiled_module` names what Dynamo compiled as ``obs.compile`` names it: a module's class (``Net``), found
as ``self`` of its ``forward`` (or of a function Dynamo resumes after a graph break), or as the module torch's own
wrapper frame calls (``external_utils``' ``inner``, above a module whose ``__call__`` is compiled); else None.
"""

from __future__ import annotations

import os
import sys
from types import FrameType
from typing import Any

import torch

__all__ = ["compiled_by_obs", "compiled_module", "logged_graph"]

#: record kind -> the local of the function that logs it which holds its graph
_LOCALS = {"dynamo_output_graph": "gm", "aot_forward_graph": "fw_module", "aot_backward_graph": "bw_module",
           "aot_inference_graph": "fw_module", "aot_joint_graph": "fx_g", "inductor_post_grad_graph": "gm"}
_TRACE_STRUCTURED = os.path.join("torch", "_logging", "_internal.py")
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def _logging_frame() -> FrameType | None:
    """The frame that called ``torch._logging.trace_structured``, where the handler runs inside that call."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "trace_structured" and frame.f_code.co_filename.endswith(_TRACE_STRUCTURED):
            return frame.f_back
        frame = frame.f_back
    return None


def logged_graph(kind: str) -> tuple[torch.fx.GraphModule | None, Any]:
    """The GraphModule of the record of ``kind`` being logged, and the Dynamo output graph logging it (for
    :func:`compiled_module`; None but for ``dynamo_output_graph``); (None, None) where no frame holds one."""
    local = _LOCALS.get(kind)
    frame = _logging_frame() if local is not None else None
    if frame is None:
        return None, None
    try:
        names = frame.f_locals
        graph = names.get(local)
        output = names.get("self") if kind == "dynamo_output_graph" else None
    finally:
        del frame  # no cycle through this frame
    return (graph, output) if isinstance(graph, torch.fx.GraphModule) else (None, None)


def compiled_module(output: Any) -> torch.nn.Module | None:
    """The module whose call Dynamo compiled into ``output`` (an OutputGraph), or None (a function, or not found)."""
    root = getattr(output, "root_tx", None)
    names, code = getattr(root, "f_locals", None), getattr(root, "f_code", None)
    if not isinstance(names, dict) or code is None:
        return None
    module = names.get("self")
    if isinstance(module, torch.nn.Module):
        return module
    if os.path.abspath(code.co_filename).startswith(_TORCH):  # torch's wrapper: the module it calls
        return next((v for v in names.values() if isinstance(v, torch.nn.Module)), None)
    return None


def compiled_by_obs(output: Any) -> bool:
    """Whether ``output`` (an OutputGraph) is compiled by obs.compile's backend, which publishes its graphs itself.

    Dynamo wraps the backend it was given; each wrapper names the one inside as ``_torchdynamo_orig_backend`` (or
    ``compiler_fn``), which PyTorch documents as the way back to the original backend."""
    from obs.runtime.torch._compile import ObsBackend

    backend = getattr(output, "compiler_fn", None)
    for _ in range(8):  # a few wrappers deep at most; never a cycle
        if backend is None or isinstance(backend, ObsBackend):
            break
        backend = getattr(backend, "_torchdynamo_orig_backend", None) or getattr(backend, "compiler_fn", None)
    return isinstance(backend, ObsBackend)
