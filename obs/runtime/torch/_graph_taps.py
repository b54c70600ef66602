"""Statistics of the tensors inside Inductor-compiled graphs, computed by the graphs themselves: GRAPH_STATS.

A post-grad graph pass (``torch._inductor.config.post_grad_custom_post_pass``, the hook Inductor offers
for it) adds, after each node whose output is a floating tensor (views left out: they read what their
base holds), eight reductions of that output, in ops Inductor lowers itself: its max, min and sum over
finite elements, its L2 norm, and how many elements are NaN, +Inf, -Inf and zero.  Inductor fuses them
into the kernels it generates, so a compiled step reads each tensor once more at most, inside its own
loops, instead of the dump reading every tensor back.  Each graph starts with a call of
``obs::graph_begins`` and ends with one of ``obs::graph_stats`` (custom ops with side effects) taking the
reductions as one ``[8 * nodes]`` tensor; both publish GRAPH_STATS while the data dump or the NaN check
wants it.  ``spec`` says, per row, the node's op, its module stack (as Dynamo recorded it), dtype and
shape, and whether the graph is a backward graph.

The pass is in place only while GRAPH_STATS has subscribers; graphs compiled meanwhile keep their
reductions (they cost a flag test per graph call while nobody listens).  Where torch.compile uses no
Inductor (``aot_eager``, ``eager``), ops still run one by one and the op dispatch mode sees them.
"""

from __future__ import annotations

import hashlib
import math
import threading
from typing import Any

import torch

from obs._core.events import Event, bus
from obs._core.internal import report_internal_error, suppressed

__all__ = ["COLUMNS", "GraphStatsPass", "specs"]

#: the reductions of each tapped output, in the order of GRAPH_STATS' values
COLUMNS = ("max", "min", "sum", "l2norm", "nan", "pos_inf", "neg_inf", "zero")
_VERSION = "obs-graph-stats-1"
_lock = threading.Lock()
_specs: list[dict[str, Any]] = []  # spec id -> what the rows of that graph's tensor are
_listening = [False]


def specs() -> list[dict[str, Any]]:
    """Every graph's spec so far (tests, readers)."""
    with _lock:
        return list(_specs)


@torch.library.custom_op("obs::graph_stats", mutates_args=())
def graph_stats(values: torch.Tensor, spec: int) -> None:
    """Publish one compiled graph's statistics (``values[8 i : 8 i + 8]`` is row ``i`` of spec ``spec``)."""
    if not _listening[0]:
        return
    try:
        with suppressed():
            flat = values.tolist()
            rows = [flat[i:i + len(COLUMNS)] for i in range(0, len(flat), len(COLUMNS))]
            bus.emit(Event.GRAPH_STATS, _specs[spec], rows)
    except Exception as exc:  # noqa: BLE001 - reported; the compiled step goes on
        report_internal_error("GRAPH_STATS", exc)


@graph_stats.register_fake
def _(values: torch.Tensor, spec: int) -> None:
    return None


@torch.library.custom_op("obs::graph_begins", mutates_args=())
def graph_begins(spec: int) -> None:
    """A graph with statistics starts: GRAPH_STATS with ``rows`` None (the data dump then leaves the ops this
    graph still dispatches one by one, Inductor's extern kernels, to the rows the graph computes)."""
    if not _listening[0]:
        return
    try:
        with suppressed():
            bus.emit(Event.GRAPH_STATS, _specs[spec], None)
    except Exception as exc:  # noqa: BLE001 - reported; the compiled step goes on
        report_internal_error("GRAPH_STATS", exc)


@graph_begins.register_fake
def _(spec: int) -> None:
    return None


torch.fx.node.has_side_effect(torch.ops.obs.graph_stats.default)
torch.fx.node.has_side_effect(torch.ops.obs.graph_begins.default)


def _value(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else node


class _Builder:
    """Adds nodes to a graph with their fake values, as Inductor's later passes expect."""

    def __init__(self, graph: torch.fx.Graph, fake_mode: Any) -> None:
        self.graph, self.fake_mode = graph, fake_mode

    def __call__(self, target: Any, *args: Any, **kwargs: Any) -> torch.fx.Node:
        node = self.graph.call_function(target, args, kwargs)
        with self.fake_mode:
            node.meta["val"] = target(*[_value(a) if not isinstance(a, list) else [_value(x) for x in a]
                                        for a in args], **kwargs)
        return node


def _tapped(node: torch.fx.Node) -> bool:
    value = node.meta.get("val")
    if node.op != "call_function" or not isinstance(value, torch.Tensor) or not value.is_floating_point() \
            or not node.all_input_nodes:  # a constant (full, scalar_tensor): nothing of the model's
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverload) and (target.is_view or target.namespace == "obs"):
        return False
    return not (isinstance(value.numel(), int) and value.numel() == 0)


def _stack(node: torch.fx.Node) -> list[tuple[str, str]]:
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    out = []
    for entry in stack.values():
        try:
            path, cls = entry[0], entry[1]
        except (TypeError, IndexError):
            continue
        name = cls if isinstance(cls, str) else getattr(cls, "__name__", str(cls))
        out.append((str(path), name.rsplit(".", 1)[-1]))
    return out


def _reductions(add: _Builder, x: torch.fx.Node) -> torch.fx.Node:
    """One ``[8]`` float32 node: the COLUMNS of ``x`` (ops Inductor lowers itself: no decompositions here)."""
    aten, prims = torch.ops.aten, torch.ops.prims
    value = x.meta["val"]
    f = x if value.dtype in (torch.float32, torch.float64) else add(prims.convert_element_type.default, x,
                                                                    torch.float32)
    dtype, device = f.meta["val"].dtype, f.meta["val"].device

    def const(v: float) -> torch.fx.Node:
        return add(aten.full.default, [], v, dtype=dtype, device=device, pin_memory=False)

    not_nan = add(aten.eq.Tensor, f, f)
    finite = add(aten.logical_and.default, not_nan, add(aten.ne.Scalar, add(aten.abs.default, f), math.inf))
    counts = dict(dtype=torch.float32)
    parts = [
        add(aten.amax.default, add(aten.where.self, finite, f, const(-math.inf))),
        add(aten.amin.default, add(aten.where.self, finite, f, const(math.inf))),
        add(aten.sum.default, add(aten.where.self, finite, f, const(0.0))),
        add(aten.sqrt.default, add(aten.sum.default, add(aten.mul.Tensor, f, f))),
        add(aten.sum.default, add(aten.logical_not.default, not_nan), **counts),
        add(aten.sum.default, add(aten.eq.Scalar, f, math.inf), **counts),
        add(aten.sum.default, add(aten.eq.Scalar, f, -math.inf), **counts),
        add(aten.sum.default, add(aten.eq.Scalar, f, 0.0), **counts),
    ]
    parts = [p if p.meta["val"].dtype == torch.float32 else add(prims.convert_element_type.default, p,
                                                                 torch.float32) for p in parts]
    return add(aten.cat.default, [add(aten.view.default, p, [1]) for p in parts])


class GraphStatsPass:
    """The post-grad pass (Inductor's CustomGraphPass protocol: ``__call__(graph)`` and ``uuid()``)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        try:
            self._tap(graph)
        except Exception as exc:  # noqa: BLE001 - reported; the graph compiles without statistics
            report_internal_error("graph statistics pass", exc)

    def uuid(self) -> bytes:
        return hashlib.sha256(_VERSION.encode()).digest()  # Inductor's cache: graphs with and without taps differ

    def _tap(self, graph: torch.fx.Graph) -> None:
        from torch._guards import detect_fake_mode

        nodes = [n for n in graph.nodes if _tapped(n)]
        if not nodes:
            return
        fake_mode = detect_fake_mode([n.meta["val"] for n in nodes])
        if fake_mode is None:
            return
        add = _Builder(graph, fake_mode)
        backward = any(n.op == "placeholder" and str(n.target).startswith("tangents") for n in graph.nodes)
        rows = []
        for node in nodes:
            with graph.inserting_before(node.next):  # right after the node, in the order they are made
                rows.append(_reductions(add, node))
        value = nodes[0].meta["val"]
        with _lock:
            spec_id = len(_specs)
            _specs.append({"backward": backward, "device": str(value.device), "rows": [
                {"node": n.name, "op": str(n.target), "stack": _stack(n), "dtype": str(n.meta["val"].dtype),
                 "shape": [str(d) for d in n.meta["val"].shape]} for n in nodes]})
        first = next(iter(graph.nodes))
        while first.op == "placeholder":
            first = first.next
        with graph.inserting_before(first):
            graph.call_function(torch.ops.obs.graph_begins.default, (spec_id,))
        output = next(n for n in reversed(graph.nodes) if n.op == "output")
        with graph.inserting_before(output):
            table = add(torch.ops.aten.cat.default, rows)  # [8 * nodes]: row i is table[8 i : 8 i + 8]
            graph.call_function(torch.ops.obs.graph_stats.default, (table, spec_id))


def listen(on: bool) -> None:
    """Publish GRAPH_STATS from graphs that have the pass (or not)."""
    _listening[0] = on
