"""Statistics of the tensors inside Inductor-compiled graphs, computed by the graphs themselves: GRAPH_STATS.

A post-grad graph pass (``torch._inductor.config.post_grad_custom_post_pass``, the hook Inductor offers
for it) adds, after each node whose output is a floating tensor (views left out: they read what their
base holds), the reductions the features ask for (``obs._core.demands.graph_stats``), in ops Inductor lowers
itself: max, min and sum over finite elements, the count of finite elements, the L2 norm, and how many
elements are NaN, +Inf, -Inf and zero.  Inductor fuses them into the kernels it generates, so a compiled
step reads each tensor once more at most, inside its own loops, instead of the dump reading every tensor
back.  Every node is tapped where a feature asks for all (the data dump, the NaN check at op granularity),
else only the nodes whose value leaves their module (the NaN check at module granularity: a module's own
masks, such as attention's ``-inf``, are not its output).  Each graph starts with a call of
``obs::graph_begins`` and ends with one of ``obs::graph_stats`` (custom ops with side effects) taking the
reductions as one tensor; both publish GRAPH_STATS while someone listens.  On CUDA the statistics are not read
back there (a host sync per graph call): GRAPH_STATS carries them on the device (:class:`DeviceRows`), for the
features to read with the step's other device values.  ``spec`` says which columns,
and per row the node's op, its module stack (as Dynamo recorded it), dtype and shape, and whether the
graph is a backward graph.

The pass is in place only while GRAPH_STATS has subscribers; graphs compiled meanwhile keep their
reductions (they cost a flag test per graph call while nobody listens).  Where torch.compile uses no
Inductor (``aot_eager``, ``eager``), ops still run one by one and the op dispatch mode sees them.
"""

from __future__ import annotations

import hashlib
import math
import os
import threading
from collections.abc import Sequence
from typing import Any

import torch

from obs._core.demands import demands
from obs._core.events import Event, bus
from obs._core.internal import report_internal_error, suppressed

__all__ = ["COLUMNS", "DEFER_CPU", "DeviceRows", "GraphStatsPass", "listen", "wanted"]

#: the reductions a tapped output can have, in the order of GRAPH_STATS' values (``spec["columns"]`` says which)
COLUMNS = ("max", "min", "sum", "finite", "l2norm", "nan", "pos_inf", "neg_inf", "zero")
_VERSION = "obs-graph-stats-1"
_lock = threading.Lock()
_specs: list[dict[str, Any]] = []  # spec id -> what the rows of that graph's tensor are
_listening = [False]


#: whether CPU graphs' statistics stay on their device too, as CUDA ones do (the tests drive that path on the CPU)
DEFER_CPU = False


class DeviceRows:
    """One graph call's statistics, still on its device: ``values`` (float32, ``width`` per row, row after row) is a
    copy of the graph's own, which nothing writes again.  Nothing is read back: a subscriber keeps ``values`` to read
    them later, with its other device values, and makes the rows of them with :meth:`split`."""

    __slots__ = ("values", "width")

    def __init__(self, values: torch.Tensor, width: int) -> None:
        self.values, self.width = values, width

    def split(self, flat: Sequence[float]) -> list[list[float]]:
        """The rows of ``values`` once read back (``flat``: its elements, in order)."""
        k = self.width
        return [list(flat[i:i + k]) for i in range(0, len(flat), k)]

    def read(self) -> list[list[float]]:
        """The rows, read back now (on CUDA: a host sync), for a subscriber that checks where the graph runs."""
        return self.split(self.values.tolist())


@torch.library.custom_op("obs::graph_stats", mutates_args=())
def graph_stats(values: torch.Tensor, spec: int) -> None:
    """Publish one compiled graph's statistics (``values[k i : k i + k]`` is row ``i`` of spec ``spec``, ``k`` the
    number of its columns): rows of floats, or on CUDA (and the CPU with :data:`DEFER_CPU`) a :class:`DeviceRows`."""
    if not _listening[0]:
        return
    try:
        with suppressed():
            k = len(_specs[spec]["columns"])
            if values.is_cuda or DEFER_CPU:  # no read-back: the graph's buffer may be reused once it returns
                bus.emit(Event.GRAPH_STATS, _specs[spec], DeviceRows(values.detach().clone(), k))
                return
            flat = values.tolist()
            rows = [flat[i:i + k] for i in range(0, len(flat), k)]
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
        self._constants: dict[tuple[Any, ...], torch.fx.Node] = {}

    def constant(self, value: float, like: torch.fx.Node) -> torch.fx.Node:
        """A 0-dim tensor of ``value`` with ``like``'s dtype and device, made once per graph (at its start)."""
        dtype, device = like.meta["val"].dtype, like.meta["val"].device
        key = (value, dtype, str(device))
        if key not in self._constants:
            first = next(n for n in self.graph.nodes if n.op != "placeholder")
            with self.graph.inserting_before(first):
                self._constants[key] = self(torch.ops.aten.full.default, [], value, dtype=dtype, device=device,
                                            pin_memory=False)
        return self._constants[key]

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


def _module_path(node: torch.fx.Node) -> str:
    """The innermost module the node ran in, as Dynamo recorded its path ('' for the compiled module itself)."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    for entry in reversed(list(stack.values())):
        try:
            return str(entry[0])
        except (TypeError, IndexError):
            continue
    return ""


def _leaves_its_module(node: torch.fx.Node) -> bool:
    """Whether the node's value is an output of its module: used by a node outside it.  The graph's output is
    no such use: in a forward graph it also holds what backward saves (an attention mask, say), and the compiled
    module's own output is checked where it returns."""
    path = _module_path(node)
    for user in node.users:
        if user.op == "output":
            continue
        inside = _module_path(user)
        if not (inside == path or (path and inside.startswith(path + "."))):
            return True
    return False


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


def _reductions(add: _Builder, x: torch.fx.Node, columns: tuple[str, ...]) -> torch.fx.Node:
    """One ``[len(columns)]`` float32 node: those COLUMNS of ``x`` (in ops Inductor lowers itself)."""
    aten, prims = torch.ops.aten, torch.ops.prims
    value = x.meta["val"]
    f = x if value.dtype in (torch.float32, torch.float64) else add(prims.convert_element_type.default, x,
                                                                    torch.float32)
    counts = {"dtype": torch.float32}
    made: dict[str, torch.fx.Node] = {}

    def once(key: str, make: Any) -> torch.fx.Node:
        if key not in made:
            made[key] = make()
        return made[key]

    def not_nan() -> torch.fx.Node:
        return once("not_nan", lambda: add(aten.eq.Tensor, f, f))

    def finite() -> torch.fx.Node:
        return once("finite", lambda: add(aten.logical_and.default, not_nan(),
                                          add(aten.ne.Scalar, add(aten.abs.default, f), math.inf)))

    def masked(fill: float) -> torch.fx.Node:
        return add(aten.where.self, finite(), f, add.constant(fill, f))

    make = {
        "max": lambda: add(aten.amax.default, masked(-math.inf)),
        "min": lambda: add(aten.amin.default, masked(math.inf)),
        "sum": lambda: add(aten.sum.default, masked(0.0)),
        "finite": lambda: add(aten.sum.default, finite(), **counts),
        "l2norm": lambda: add(aten.sqrt.default, add(aten.sum.default, add(aten.mul.Tensor, f, f))),
        "nan": lambda: add(aten.sum.default, add(aten.logical_not.default, not_nan()), **counts),
        "pos_inf": lambda: add(aten.sum.default, add(aten.eq.Scalar, f, math.inf), **counts),
        "neg_inf": lambda: add(aten.sum.default, add(aten.eq.Scalar, f, -math.inf), **counts),
        "zero": lambda: add(aten.sum.default, add(aten.eq.Scalar, f, 0.0), **counts),
    }
    parts = [make[c]() for c in columns]
    parts = [p if p.meta["val"].dtype == torch.float32 else add(prims.convert_element_type.default, p,
                                                                 torch.float32) for p in parts]
    return add(aten.cat.default, [add(aten.view.default, p, [1]) for p in parts])


def wanted() -> tuple[tuple[str, ...], bool]:
    """The columns the features ask for (in COLUMNS' order) and whether every node is tapped (else only the
    nodes whose value leaves their module)."""
    asks = list(demands.graph_stats.values())
    names = frozenset().union(*(columns for columns, _ in asks)) if asks else frozenset()
    return tuple(c for c in COLUMNS if c in names), any(every for _, every in asks)


class GraphStatsPass:
    """The post-grad pass (Inductor's CustomGraphPass protocol: ``__call__(graph)`` and ``uuid()``)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        try:
            self._tap(graph)
        except Exception as exc:  # noqa: BLE001 - reported; the graph compiles without statistics
            report_internal_error("graph statistics pass", exc)

    def uuid(self) -> bytes:
        # Inductor's FX graph cache keys on this: graphs with other taps are other graphs.  The spec ids in a
        # graph are this process's, so a graph with taps is never taken from another process's cache either.
        return hashlib.sha256(f"{_VERSION}/{wanted()}/{id(self)}/{os.getpid()}".encode()).digest()

    def _tap(self, graph: torch.fx.Graph) -> None:
        from torch._guards import detect_fake_mode

        columns, every = wanted()
        if not columns:
            return
        if every:
            nodes = [n for n in graph.nodes if _tapped(n)]
        else:  # module outputs computed from the graph's inputs (a causal mask built from iota is no data of the step)
            fed: set[torch.fx.Node] = set()
            for n in graph.nodes:
                if n.op == "placeholder" or any(a in fed for a in n.all_input_nodes):
                    fed.add(n)
            nodes = [n for n in graph.nodes if n in fed and _tapped(n) and _leaves_its_module(n)]
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
                rows.append(_reductions(add, node, columns))
        value = nodes[0].meta["val"]
        with _lock:
            spec_id = len(_specs)
            _specs.append({"backward": backward, "device": str(value.device), "columns": list(columns), "rows": [
                {"node": n.name, "op": str(n.target), "stack": _stack(n), "dtype": str(n.meta["val"].dtype),
                 "shape": [str(d) for d in n.meta["val"].shape]} for n in nodes]})
        first = next(iter(graph.nodes))
        while first.op == "placeholder":
            first = first.next
        with graph.inserting_before(first):
            graph.call_function(torch.ops.obs.graph_begins.default, (spec_id,))
        output = next(n for n in reversed(graph.nodes) if n.op == "output")
        with graph.inserting_before(output):
            table = add(torch.ops.aten.cat.default, rows)  # row i: table[k i : k i + k], k = len(columns)
            graph.call_function(torch.ops.obs.graph_stats.default, (table, spec_id))


def listen(on: bool) -> None:
    """Publish GRAPH_STATS from graphs that have the pass (or not)."""
    _listening[0] = on
