"""An FX graph (Dynamo capture, AOT forward/backward, torch.export) as an :class:`~obs.features.graphs.model.IrFile`.

Pure apart from reading the graph: parameters get their module path (``fc1.weight``), nodes their
MindSpore scope built from ``nn_module_stack`` (``Default/net-Net/fc1-Linear/addmm-op0``;
``Gradients/Default/...`` for backward nodes; ``Default/net/fc1/addmm-op0`` without class names), their
types from the fake values FX keeps, and their source frames from ``stack_trace``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from obs.features.graphs.ir_text import OBS_DIR
from obs.features.graphs.model import Abstract, Graph, IrFile, Node, Param
from printsink.dtypes import NAME_OF_TORCH

__all__ = ["abstract_of", "describe", "describe_compiled", "describe_export", "describe_logged", "dtype_name",
           "frames_of", "input_names", "literal", "op_name", "scope_parts"]

_FRAME = re.compile(r'^\s*File "(?P<path>[^"]*)", line (?P<line>\d+), in (?P<func>.*)$')
_SOURCE_ROOT = re.compile(r"^L\[['\"]([^'\"]*)['\"]\]|^L__([A-Za-z_]\w*?)__")
_TOKEN = re.compile(r"\[['\"]([^'\"]+)['\"]\]|\.(\w+)|\[(\d+)\]|^(\w+)")
_CONTAINERS = {"_modules", "_parameters", "_buffers"}
_SAFE_REPR = re.compile(r"[\w.:+\-]*")


_DTYPE_NAMES: dict[Any, str] = {}


def dtype_name(dtype: Any) -> str:
    """MindSpore's name of a torch dtype (``Float32``); unknown ones capitalised (``Float8_e4m3fn``)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        text = str(dtype)
        name = _DTYPE_NAMES[dtype] = NAME_OF_TORCH.get(text) or text.removeprefix("torch.").capitalize()
    return name


def _dim(d: Any) -> int | str:
    if type(d) is int:
        return d
    # A symbolic size: its expression.  Never int(d): that would specialize the symbol (add a guard).
    return re.sub(r"[^\w*+\-/ ]", "", str(d)) or "s"


def _dims(dims: Any) -> tuple[int | str, ...]:
    dims = tuple(dims)
    return dims if all(type(d) is int for d in dims) else tuple(_dim(d) for d in dims)


def abstract_of(value: Any, *, extras: bool = True) -> Abstract:
    """The type of a value FX recorded (a fake tensor, a SymInt, a Python scalar, a tuple of them)."""
    if value is None:
        return Abstract("None")
    if isinstance(value, torch.Tensor) or (hasattr(value, "shape") and hasattr(value, "dtype")):
        more: list[str] = []
        if extras:
            try:
                more.append("strides=(" + ", ".join(map(str, _dims(value.stride()))) + ")")
            except Exception:  # noqa: BLE001 - no strides (sparse, nested): the other extras still tell
                pass
            device = getattr(value, "device", None)
            if device is not None:
                more.append(f"device={device}")
            if getattr(value, "requires_grad", False):
                more.append("requires_grad")
        return Abstract("Tensor", dtype_name(value.dtype), _dims(value.shape), tuple(more))
    if isinstance(value, bool):
        return Abstract("Bool")
    if isinstance(value, int):
        return Abstract("Int64")
    if isinstance(value, float):
        return Abstract("Float64")
    if isinstance(value, torch.SymBool):
        return Abstract("Bool", extras=(f"value={_dim(value)}",))
    if isinstance(value, torch.SymInt):
        return Abstract("Int64", extras=(f"value={_dim(value)}",))
    if isinstance(value, torch.SymFloat):
        return Abstract("Float64", extras=(f"value={_dim(value)}",))
    if isinstance(value, str):
        return Abstract("String")
    if isinstance(value, (tuple, list)):
        return Abstract("Tuple", elements=tuple(abstract_of(v, extras=extras) for v in value))
    name = re.sub(r"\W", "", type(value).__name__) or "Object"
    return Abstract(name if name[0].isalpha() else "Object")


def literal(value: Any, refs: Mapping[Any, str]) -> str:
    """An argument as MindSpore writes it: ``%3``, ``%para1_x``, ``I64(3)``, ``Bool(1)``, ``(0, 1)``..."""
    if isinstance(value, torch.fx.Node):
        return refs.get(value, f"%{value.name}")
    if value is None:
        return "None"
    if isinstance(value, bool):
        return f"Bool({int(value)})"
    if isinstance(value, int):
        return f"I64({value})"
    if isinstance(value, float):
        return f"F64({value if math.isfinite(value) else str(value)})"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, tuple):
        return "(" + ", ".join(literal(v, refs) for v in value) + ")"
    if isinstance(value, list):
        return "[" + ", ".join(literal(v, refs) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {literal(v, refs)}" for k, v in value.items()) + "}"
    if isinstance(value, torch.dtype):
        return dtype_name(value)
    text = str(value)
    kind = re.sub(r"\W", "", type(value).__name__) or "Object"
    return f"{kind}[{text}]" if _SAFE_REPR.fullmatch(text) else f"{kind}[{json.dumps(text)}]"


def op_name(node: torch.fx.Node, gm: torch.fx.GraphModule | None = None) -> str:
    """``aten.addmm`` (``.default`` dropped), ``linear``, ``mul``, a method's name, a module's class."""
    target = node.target
    if node.op == "call_module" and gm is not None:
        try:
            return type(gm.get_submodule(str(target))).__name__
        except AttributeError:
            return str(target)
    if isinstance(target, str):
        return target
    if isinstance(target, torch._ops.OpOverload):
        text = str(target)
        return text.removesuffix(".default")
    if isinstance(target, torch._ops.OpOverloadPacket):
        return str(target)
    return getattr(target, "__name__", None) or re.sub(r"\W", "_", str(target))


def _short(op: str) -> str:
    parts = op.split(".")
    return parts[1] if parts[0] in ("aten", "prims", "quantized") and len(parts) > 1 else parts[-1]


def frames_of(stack_trace: str | None) -> list[str]:
    """``path:line/source/`` per frame of an FX ``stack_trace``, outermost first (obs's own frames left out: Dynamo
    traces through obs's module wrapper)."""
    if not stack_trace:
        return []
    out: list[str] = []
    lines = stack_trace.splitlines()
    for i, line in enumerate(lines):
        m = _FRAME.match(line)
        if m is None:
            continue
        source = lines[i + 1].strip() if i + 1 < len(lines) and not _FRAME.match(lines[i + 1]) else ""
        if set(source) <= {"^", "~", " "}:
            source = ""
        if m.group("path").startswith(OBS_DIR):
            continue
        out.append(f"{m.group('path')}:{m.group('line')}/{source.replace(chr(10), ' ')}/")
    return out


def _components(path: str) -> tuple[list[str], str]:
    """``L['self'].seq.0`` -> (['seq', '0'], 'self'); ``seq.0`` (export) -> (['seq', '0'], '')."""
    root = ""
    m = _SOURCE_ROOT.match(path)
    if m:
        root = m.group(1) or m.group(2) or ""
        path = path[m.end():]
    out = [next(g for g in t if g) for t in _TOKEN.findall(path)]
    while out and out[0] == "__self__":  # L['fn'].__self__: the module whose bound C __call__ was compiled
        out = out[1:]
    return [c for c in out if c not in _CONTAINERS], root


def scope_parts(stack: Mapping[str, Any] | None, root_class: str | None, keep_class: bool,
                classes: Mapping[str, str] | None = None) -> list[str]:
    """The cells of a node's scope (``['net-Net', 'fc1-Linear']``) from its ``nn_module_stack``.

    ``classes`` (qualified name -> class, the compiled module's ``named_modules()``) names the containers
    that are never called and so are not on the stack (``transformer-ModuleDict/h-ModuleList/0-Block``, as
    the eager scopes say); without it such a path is one cell (``transformer.h.0-Block``)."""
    parts: list[str] = []
    previous: list[str] = []
    entries = list((stack or {}).values())
    if root_class is not None:
        parts.append(f"net-{root_class}" if keep_class else "net")
    for entry in entries:
        try:
            path, cls = entry[0], entry[1]
        except (TypeError, IndexError):
            continue
        name = cls if isinstance(cls, str) else getattr(cls, "__name__", str(cls))
        name = name.rsplit(".", 1)[-1]
        comps, _ = _components(str(path))
        if not comps:
            if not parts:  # the root module itself (export's '', a module called by a compiled function)
                parts.append(f"net-{name}" if keep_class else "net")
            previous = []
            continue
        if not parts:
            parts.append("net")  # a module reached from a function, no root module recorded
        start = len(previous) if comps[:len(previous)] == previous and len(comps) > len(previous) else 0
        rel = comps[start:]
        if classes and len(rel) > 1 and all(".".join(comps[:i + 1]) in classes for i in range(start, len(comps) - 1)):
            for i in range(start, len(comps) - 1):
                parts.append(f"{comps[i]}-{classes['.'.join(comps[:i + 1])]}" if keep_class else comps[i])
            rel = rel[-1:]
        label = ".".join(rel)
        parts.append(f"{label}-{name}" if keep_class else label)
        previous = comps
    return parts


def _param_name(node: torch.fx.Node) -> tuple[str, bool]:
    """A Dynamo placeholder's user-facing name (``fc1.weight``, ``x``) and whether it is a weight/buffer."""
    grapharg = node.meta.get("grapharg")
    source = None
    if grapharg is not None:
        try:
            source = grapharg.source.name
            source = source() if callable(source) else source
        except Exception:  # noqa: BLE001 - a graph argument without a readable source
            source = None
    value = node.meta.get("example_value", node.meta.get("val"))
    is_weight = isinstance(value, torch.nn.Parameter)
    if source:
        comps, root = _components(source)
        weight_like = "_parameters" in source or "_buffers" in source
        parts = comps if weight_like else [root, *comps] if root else comps
        return (".".join(p for p in parts if p) or node.name), is_weight or weight_like
    return node.name, is_weight


def describe(gm: torch.fx.GraphModule, name: str, *, stage: str, root_class: str | None = None,
             keep_class: bool = True, input_names: Sequence[tuple[str, bool]] | None = None,
             param_names: Mapping[str, tuple[str, bool]] | None = None,
             attrs: Mapping[str, Any] | None = None, classes: Mapping[str, str] | None = None) -> IrFile:
    """The :class:`IrFile` of ``gm``.  ``input_names``: (name, is_weight) per input of the graph AOT autograd
    started from (its primals are named after them); ``param_names``: placeholder name -> (name, is_weight)
    (torch.export's signature)."""
    graph = Graph(name, attrs={"stage": stage})
    refs: dict[Any, str] = {}
    types: dict[Any, Abstract] = {}  # each node's value, described once
    counters: dict[str, int] = {}
    backward_stage = stage.endswith("backward")
    output = None
    index = 0
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            pname, weight = _placeholder(node, input_names, param_names)
            _add_param(graph, refs, node, pname, weight, node.meta.get("val", node.meta.get("example_value")))
            continue
        if node.op == "get_attr":
            value = _attr(gm, str(node.target))
            if isinstance(value, torch.fx.GraphModule):
                refs[node] = "@" + re.sub(r"\W", "_", str(node.target))
                continue
            _add_param(graph, refs, node, str(node.target), True, value if value is not None else node.meta.get("val"))
            continue
        if node.op == "output":
            output = node
            continue
        op = op_name(node, gm)
        short = _short(op)
        k = counters.get(short, 0)
        counters[short] = k + 1
        backward = backward_stage or node.meta.get("partitioner_tag") == "is_backward"
        stack = node.meta.get("nn_module_stack")
        if stack is None and backward:
            stack = node.meta.get("fwd_nn_module_stack")
        cells = scope_parts(stack, root_class, keep_class, classes)
        if node.op == "call_module":
            cells.append(f"{node.target}-{op}" if keep_class else str(node.target))
        scope = "/".join((["Gradients"] if backward else []) + ["Default"] + cells + [f"{short}-op{k}"])
        args = [literal(a, refs) for a in node.args]
        kwargs = {str(key): literal(v, refs) for key, v in node.kwargs.items()}
        inputs = [_input_type(a, types) for a in node.args]
        graph.nodes.append(Node(index, node.name, op, args, kwargs, inputs, [_input_type(node, types)], scope,
                                frames_of(node.meta.get("stack_trace"))))
        refs[node] = f"%{index}"
        index += 1
    if output is not None:
        result = output.args[0] if output.args else None
        items = list(result) if isinstance(result, (tuple, list)) else [result]
        graph.returns = [literal(v, refs) for v in items]
        graph.return_types = [_input_type(v, types) for v in items]
        cells = scope_parts(None, root_class, keep_class)
        graph.return_scope = "/".join((["Gradients"] if backward_stage else []) + ["Default"] + cells + ["Return-op0"])
    return IrFile(name, [graph], {k: str(v) for k, v in (attrs or {}).items()})


def _placeholder(node: torch.fx.Node, input_names: Sequence[tuple[str, bool]] | None,
                 param_names: Mapping[str, tuple[str, bool]] | None) -> tuple[str, bool]:
    if param_names is not None and node.name in param_names:
        return param_names[node.name]
    if input_names is not None:
        idx = getattr(node.meta.get("desc"), "idx", None)
        if isinstance(idx, int) and 0 <= idx < len(input_names) and type(node.meta.get("desc")).__name__ in (
                "PlainAOTInput", "ParamAOTInput", "BufferAOTInput"):
            return input_names[idx]
        return node.name, False
    if "grapharg" in node.meta:
        return _param_name(node)
    return node.name, False


def _attr(gm: torch.nn.Module, target: str) -> Any:
    owner: Any = gm
    for part in target.split("."):
        owner = getattr(owner, part, None)
        if owner is None:
            return None
    return owner


def _add_param(graph: Graph, refs: dict[Any, str], node: torch.fx.Node, name: str, weight: bool, value: Any) -> None:
    clean = re.sub(r"[^\w.\-]", "_", name) or "p"
    a = abstract_of(value)
    if weight and a.kind == "Tensor":
        flags = [f"ref_key={clean}"] + (["is_parameter"] if isinstance(value, torch.nn.Parameter) else [])
        a = Abstract("Ref", a.dtype, a.shape, tuple(flags) + a.extras)
    param = Param(len(graph.params) + 1, clean, a, has_default=weight)
    graph.params.append(param)
    refs[node] = param.ref


def _input_type(value: Any, types: dict[Any, Abstract]) -> Abstract:
    if isinstance(value, torch.fx.Node):
        found = types.get(value)
        if found is None:
            found = types[value] = abstract_of(value.meta.get("val", value.meta.get("example_value")))
        return found
    if isinstance(value, (tuple, list)) and any(isinstance(v, torch.fx.Node) for v in value):
        return Abstract("Tuple", elements=tuple(_input_type(v, types) for v in value))
    return abstract_of(value)


def input_names(gm: torch.fx.GraphModule) -> list[tuple[str, bool]]:
    """(name, is_weight) of each input of a Dynamo graph, in order."""
    return [_param_name(n) for n in gm.graph.nodes if n.op == "placeholder"]


def _keep_class() -> bool:
    from obs.settings._context import get_context

    return bool(get_context("reserve_class_name_in_scope"))


def describe_compiled(name: str, gm: torch.fx.GraphModule) -> tuple[IrFile, str]:
    """A graph ``obs.compile`` published: the stage and links ``ObsBackend`` left in ``gm.meta`` decide how it
    is named (``obs_stage``, ``obs_root``: the compiled module's class, ``obs_parent``: the Dynamo graph an
    AOT graph came from)."""
    meta = getattr(gm, "meta", {})
    stage = meta.get("obs_stage", "dynamo_capture")
    parent = meta.get("obs_parent")
    if stage == "dynamo_capture":  # kept for the AOT graphs: Dynamo drops its placeholders' sources after compiling
        meta["obs_inputs"] = input_names(gm)
    names = None if parent is None else parent.meta.get("obs_inputs") or input_names(parent)
    graph = name if stage == "dynamo_capture" else f"{name}_{stage.removeprefix('aot_')}"
    attrs = {"stage": stage, "compile": name, "backend": meta.get("obs_backend", "")}
    return describe(gm, graph, stage=stage, root_class=meta.get("obs_root"), keep_class=_keep_class(),
                    input_names=names, attrs={k: v for k, v in attrs.items() if v},
                    classes=meta.get("obs_classes")), stage


def describe_logged(gm: torch.fx.GraphModule, name: str, *, stage: str, compile_id: str, root_class: str | None,
                    classes: Mapping[str, str] | None, inputs: Sequence[tuple[str, bool]] | None) -> IrFile:
    """A graph a plain torch.compile logged (:mod:`obs.features.graphs.compiles`), scoped under the compiled
    module's class as obs.compile's are; an AOT graph's inputs are named after its Dynamo graph's (``inputs``)."""
    return describe(gm, name, stage=stage, root_class=root_class, keep_class=_keep_class(), input_names=inputs,
                    attrs={"stage": stage, "compile": compile_id}, classes=classes)


def describe_export(graph: Any, name: str) -> tuple[IrFile, str]:
    """A ``torch.export`` program or an FX GraphModule given to ``obs.dump_graph``."""
    module = getattr(graph, "graph_module", None)
    if module is not None and hasattr(graph, "graph_signature"):
        sig = graph.graph_signature
        names = {ph: (fqn, True) for ph, fqn in {**getattr(sig, "inputs_to_parameters", {}),
                                                 **getattr(sig, "inputs_to_buffers", {})}.items()}
        return describe(module, name, stage="export", keep_class=_keep_class(), param_names=names,
                        attrs={"stage": "export"}), "export"
    if isinstance(graph, torch.fx.GraphModule):
        stage = "dynamo_capture" if any("grapharg" in n.meta for n in graph.graph.nodes) else "fx"
        return describe(graph, name, stage=stage, keep_class=_keep_class(), attrs={"stage": stage}), stage
    raise TypeError(f"obs.dump_graph takes a torch.fx.GraphModule or a torch.export.ExportedProgram "
                    f"(got {type(graph).__name__})")
