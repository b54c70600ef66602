"""Which values of a compiled training forward graph are a module call's inputs and outputs (FX analysis, pure).

A node belongs to the modules of its ``nn_module_stack`` (as Dynamo recorded it; each call of a module is an entry of
its own, ``id@1`` for the second).  Only what the forward computes its returns from counts (not what AOT autograd adds
for backward: its detaches, the values only backward reads).  Of a chosen module's call:

* its outputs are its nodes read outside that call, or returned by the graph to the caller;
* its inputs are the values made outside it that its nodes read: other modules' values and the graph's inputs;
  parameters and buffers (AOT's static inputs), and what is made of them alone (a weight's transpose), are none.

The compiled module itself (name ``""``) has the graph's inputs and its outputs.  Backward and inference graphs have
no rows.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["module_name", "select"]

_ROOT = re.compile(r"^L\[['\"][^'\"]+['\"]\]\.?")


def module_name(path: str) -> str:
    """A module's name under the compiled module, from Dynamo's path of it (``L['self'].h[0]._modules['mlp']`` ->
    ``h.0.mlp``; torch.compile's ``_orig_mod.`` left out)."""
    name = _ROOT.sub("", path, count=1)
    name = re.sub(r"\._modules\[['\"]([^'\"]+)['\"]\]", r".\1", name)
    name = re.sub(r"\[['\"]?([^'\"\]]+)['\"]?\]", r".\1", name)
    name = name.replace("_orig_mod.", "").removeprefix("_orig_mod").strip(".")
    return name


def _calls(node: torch.fx.Node) -> list[tuple[str, str]]:
    """The module calls a node ran in, outermost first: (call key, module name); the compiled module's own left out."""
    stack = node.meta.get("nn_module_stack") or {}
    out = []
    for key, entry in stack.items():
        try:
            out.append((str(key), module_name(str(entry[0]))))
        except (TypeError, IndexError):
            continue
    return [c for c in out if c[1]]


def _own(node: torch.fx.Node) -> bool:
    """Whether a node is AOT autograd's own (a detach or an alias of what backward saves), not the model's."""
    return node.op == "call_function" and node.target in (torch.ops.aten.detach.default, torch.ops.aten.alias.default)


def _reads(user: torch.fx.Node) -> bool:
    """Whether ``user`` reads a value as the model does (the graph's output and AOT's own nodes do not)."""
    return user.op != "output" and not _own(user)


def _floating(node: Any) -> bool:
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel() != 0 and not _own(node)


def _static_inputs() -> set[int]:
    """The positions of the graph inputs that are parameters or buffers (AOT autograd's static inputs)."""
    from torch._guards import TracingContext

    context = TracingContext.try_get()
    meta = getattr(context, "fw_metadata", None) if context is not None else None
    return set(getattr(meta, "static_input_indices", None) or ())


def _forward_returns(output: torch.fx.Node) -> tuple[set[torch.fx.Node], list[torch.fx.Node]]:
    """What a training forward graph returns to the caller (not what it saves for backward), and of that the
    model's own outputs (not the inputs it wrote); where AOT autograd's metadata is missing, every return and none."""
    from torch._guards import TracingContext

    returned = output.args[0] if isinstance(output.args[0], (list, tuple)) else [output.args[0]]
    context = TracingContext.try_get()
    meta = getattr(context, "fw_metadata", None) if context is not None else None
    count = getattr(meta, "num_forward_returns", None)
    if count is None:
        return {n for n in returned if isinstance(n, torch.fx.Node)}, []
    mutated, outputs = meta.num_mutated_inp_runtime_indices, meta.num_outputs
    return ({n for n in returned[:count] if isinstance(n, torch.fx.Node)},
            [n for n in returned[mutated:mutated + outputs] if isinstance(n, torch.fx.Node)])


def select(graph: torch.fx.Graph, chosen: Callable[[str], bool]) -> list[tuple[torch.fx.Node, dict[str, Any]]]:
    """The values to tap of a training forward graph and their rows (module, call, io, position, shape, dtype)."""
    nodes = list(graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    if not any(str(n.target).startswith("primals") for n in placeholders) or \
            any(str(n.target).startswith("tangents") for n in placeholders):
        return []
    static = {placeholders[i] for i in _static_inputs() if i < len(placeholders)}
    for n in nodes:  # and what is made of parameters alone (a weight's transpose, shared by two calls): no activation
        if n.op == "call_function" and n.all_input_nodes and all(a in static for a in n.all_input_nodes):
            static.add(n)
    output = next(n for n in reversed(nodes) if n.op == "output")
    returned, outputs = _forward_returns(output)
    live, todo = set(), list(returned)  # what the forward computes its returns from (not what only backward reads)
    while todo:
        n = todo.pop()
        if n not in live:
            live.add(n)
            todo.extend(n.all_input_nodes)
    calls: dict[str, str] = {}  # call key -> module name, in the order of the calls' first node
    inside: dict[torch.fx.Node, set[str]] = {}
    for n in nodes:
        keys = set()
        for key, name in _calls(n):
            if chosen(name):
                calls.setdefault(key, name)
                keys.add(key)
        inside[n] = keys
    found: dict[tuple[str, str], list[torch.fx.Node]] = {}  # (call key, io) -> its values, in graph order
    for n in nodes:
        if n.op != "call_function" or n not in live:
            continue
        for arg in n.all_input_nodes:  # inputs: made outside the call, read inside it
            if arg in static or not _floating(arg) or arg.op not in ("placeholder", "call_function"):
                continue
            for key in inside[n] - inside.get(arg, set()):
                values = found.setdefault((key, "input"), [])
                if arg not in values:
                    values.append(arg)
        if n in static or not _floating(n):
            continue
        for key in inside[n]:  # outputs: read outside the call, or returned
            if n in returned or any(_reads(u) and u in live and key not in inside.get(u, set()) for u in n.users):
                values = found.setdefault((key, "output"), [])
                if n not in values:
                    values.append(n)
    if chosen(""):  # the compiled module itself: the graph's inputs and outputs
        calls = {"": "", **calls}
        found["", "input"] = [p for p in placeholders
                              if p not in static and _floating(p) and any(_reads(u) and u in live for u in p.users)]
        found["", "output"] = [n for n in dict.fromkeys(outputs) if _floating(n)]
    out = []
    for key, name in calls.items():
        for io in ("input", "output"):
            values = found.get((key, io), [])
            for i, n in enumerate(values):
                value = n.meta["val"]
                out.append((n, {"module": name, "call": key, "io": io, "slot": i, "count": len(values), "node": n.name,
                                "shape": [int(d) if isinstance(d, int) else str(d) for d in value.shape],
                                "dtype": str(value.dtype)}))
    return out
