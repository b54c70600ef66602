"""Statistics of the tensors inside Inductor-compiled graphs, computed as the graphs run: GRAPH_STATS.

A post-grad graph pass (``torch._inductor.config.post_grad_custom_post_pass``, the hook Inductor offers for it)
adds, for each node whose output is a floating tensor (views left out: they read what their base holds), a call of
``obs::tap``: the statistics the features ask for (``demands.graph_stats``, :mod:`obs._core.demands`: max, min and
sum over finite elements, the count of finite elements, the L2 norm, and how many elements are NaN, +Inf, -Inf and
zero), computed eagerly by torch's own kernels on the tensor's device.  Every node is tapped where a feature asks for
all (the data dump, the NaN check at op granularity), else only the nodes whose value leaves their module (the NaN
check at module granularity: a module's own masks, such as attention's ``-inf``, are not its output).

Same bits: the statistics are never lowered into the graph's kernels.  Fused into a producer's loop they changed its
code, and with it the user's numbers (a Conv-BatchNorm model's loss moved in its last bits, a ResNet-18's at every
step).  A tap is an extern call placed after the last node that reads its tensor, once Inductor has lowered every
reader (they keep their code and the layouts they chose), so the user's kernels compute what they compute without
obs; a value Inductor kept in registers is also stored for the tap (the same float32 expression, stored: the same
bits).  Each graph starts with a call of ``obs::graph_begins`` and ends with one of ``obs::graph_stats`` taking the
taps' vectors; both publish GRAPH_STATS while someone listens.  On CUDA the statistics are not read back there (a
host sync per graph call): GRAPH_STATS carries them on the device (:class:`DeviceRows`), for the features to read
with the step's other device values.  ``spec`` says which columns, and per row the node's op, its module stack (as
Dynamo recorded it), dtype and shape, and whether the graph is a backward graph.

The pass is in place only while GRAPH_STATS has subscribers; graphs compiled meanwhile keep their taps (they
cost an extern call each, which returns at once while nobody listens).  Where torch.compile uses no Inductor
(``aot_eager``, ``eager``), ops still run one by one and the op dispatch mode sees them.
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
_VERSION = "obs-graph-stats-2"
_lock = threading.Lock()
_specs: list[dict[str, Any]] = []  # spec id -> what the rows of that graph's tensor are
_kept: dict[int, tuple[dict[str, Any], list[int]]] = {}  # spec id -> as published, once its graph is compiled
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


def _row(x: torch.Tensor, columns: Sequence[str]) -> torch.Tensor:
    """``columns`` (COLUMNS names) of ``x`` as one float32 vector on its device: max, min and sum over the finite
    elements, their count, the L2 norm, and the counts of NaN, +Inf, -Inf and zeros.  Nothing is read back on a
    device; on the CPU one sum says whether the tensor is all finite (the common case), and then one pass or two
    give the rest."""
    f = x if x.dtype in (torch.float32, torch.float64) else x.float()
    if f.device.type == "cpu":
        total = f.sum()
        if torch.isfinite(total):  # a NaN or an Inf makes the sum NaN or Inf (and so, rarely, does an overflow)
            return _finite_row(f, total, columns)
    finite = torch.isfinite(f) if {"max", "min", "sum", "finite"} & set(columns) else None
    make = {
        "max": lambda: torch.where(finite, f, -math.inf).amax(),
        "min": lambda: torch.where(finite, f, math.inf).amin(),
        "sum": lambda: torch.where(finite, f, 0.0).sum(),
        "finite": lambda: finite.sum(),
        "l2norm": lambda: (f * f).sum().sqrt(),
        "nan": lambda: torch.isnan(f).sum(),
        "pos_inf": lambda: torch.isposinf(f).sum(),
        "neg_inf": lambda: torch.isneginf(f).sum(),
        "zero": lambda: (f == 0).sum(),
    }
    return torch.stack([make[c]().to(torch.float32) for c in columns])


def _finite_row(f: torch.Tensor, total: torch.Tensor, columns: Sequence[str]) -> torch.Tensor:
    """:func:`_row` of a tensor with no NaN and no Inf, whose sum is ``total``."""
    low, high = torch.aminmax(f) if {"max", "min"} & set(columns) else (None, None)
    make = {
        "max": lambda: high, "min": lambda: low, "sum": lambda: total, "finite": lambda: float(f.numel()),
        "l2norm": lambda: torch.linalg.vector_norm(f), "nan": lambda: 0.0, "pos_inf": lambda: 0.0,
        "neg_inf": lambda: 0.0, "zero": lambda: (f == 0).sum(),
    }
    return torch.tensor([float(make[c]()) for c in columns], dtype=torch.float32)


def _columns(mask: int) -> tuple[str, ...]:
    return tuple(c for i, c in enumerate(COLUMNS) if mask >> i & 1)


@torch.library.custom_op("obs::tap_stats", mutates_args=())
def tap_stats(x: torch.Tensor, columns: int) -> torch.Tensor:
    """The statistics ``columns`` (a bit per COLUMNS entry) of one tensor of a compiled graph, as a float32 vector
    on its device, computed eagerly by torch's kernels, outside the graph's own."""
    names = _columns(columns)
    with suppressed():
        if not _listening[0]:
            return torch.zeros(len(names), dtype=torch.float32, device=x.device)
        return _row(x.detach(), names)


@tap_stats.register_fake
def _(x: torch.Tensor, columns: int) -> torch.Tensor:
    return x.new_empty((len(_columns(columns)),), dtype=torch.float32)


@torch.library.custom_op("obs::tap_ref", mutates_args=())
def tap_ref(name: str) -> None:
    """Placed right after the node ``name``: Inductor's lowering of it keeps that node's lowered value for its tap
    (``obs.runtime.torch._tap_lowering``).  The node is named, not passed: a use would change how Inductor treats
    it (a value with more users is written to memory rather than recomputed in its readers' loops)."""
    raise RuntimeError("obs::tap_ref runs only inside an Inductor-compiled graph")


@tap_ref.register_fake
def _(name: str) -> None:
    return None


@torch.library.custom_op("obs::tap", mutates_args=())
def tap(name: str, columns: int, spec: int, row: int, device: torch.device) -> torch.Tensor:
    """Row ``row`` of spec ``spec``: the statistics ``columns`` of the node ``name``, lowered by Inductor into a call
    of ``obs::tap_stats`` where the node's value is in memory, else into a row of NaN that is no row (the spec
    says so)."""
    raise RuntimeError("obs::tap runs only inside an Inductor-compiled graph")


@tap.register_fake
def _(name: str, columns: int, spec: int, row: int, device: torch.device) -> torch.Tensor:
    return torch.empty((len(_columns(columns)),), dtype=torch.float32, device=device)


def mark_absent(spec: int, row: int) -> None:
    """Row ``row`` of spec ``spec`` has no values: its tensor lives only inside a kernel's loop."""
    with _lock:
        _specs[spec]["rows"][row]["absent"] = True


def _published(spec: int) -> tuple[dict[str, Any], list[int]]:
    """Spec ``spec`` as GRAPH_STATS gives it (its rows with values) and the indices of those rows."""
    found = _kept.get(spec)
    if found is None:
        with _lock:
            full = _specs[spec]
            kept = [i for i, r in enumerate(full["rows"]) if not r.get("absent")]
            found = _kept[spec] = ({**full, "rows": [full["rows"][i] for i in kept]}, kept)
    return found


@torch.library.custom_op("obs::graph_stats", mutates_args=())
def graph_stats(rows: list[torch.Tensor], spec: int) -> None:
    """Publish one compiled graph's statistics (``rows[i]``: row ``i`` of spec ``spec``, ``obs::tap``'s vectors):
    rows of floats, or on CUDA (and the CPU with :data:`DEFER_CPU`) a :class:`DeviceRows`."""
    if not _listening[0]:
        return
    try:
        with suppressed():
            published, kept = _published(spec)
            k = len(published["columns"])
            values = torch.cat([rows[i] for i in kept]) if kept else torch.empty(0)  # a tensor of its own
            if values.is_cuda or DEFER_CPU:  # no read-back
                bus.emit(Event.GRAPH_STATS, published, DeviceRows(values, k))
                return
            flat = values.tolist()
            bus.emit(Event.GRAPH_STATS, published, [flat[i:i + k] for i in range(0, len(flat), k)])
    except Exception as exc:  # noqa: BLE001 - reported; the compiled step goes on
        report_internal_error("GRAPH_STATS", exc)


@graph_stats.register_fake
def _(rows: list[torch.Tensor], spec: int) -> None:
    return None


@torch.library.custom_op("obs::graph_begins", mutates_args=())
def graph_begins(anchor: torch.Tensor, spec: int) -> None:
    """A graph with statistics starts: GRAPH_STATS with ``rows`` None (the data dump then leaves the ops this
    graph still dispatches one by one, Inductor's extern kernels, to the rows the graph computes).  ``anchor``, an
    empty tensor, is not read: it gives the call a device, which Inductor's scheduler needs to keep the call in its
    place among that device's kernels (a call with no tensor was emitted after the wrapper had freed the inputs of
    a CPU kernel still to come).  Not one of the graph's inputs: those may require grad, and the call would then
    dispatch a detach of its own."""
    if not _listening[0]:
        return
    try:
        with suppressed():
            bus.emit(Event.GRAPH_STATS, _specs[spec], None)
    except Exception as exc:  # noqa: BLE001 - reported; the compiled step goes on
        report_internal_error("GRAPH_STATS", exc)


@graph_begins.register_fake
def _(anchor: torch.Tensor, spec: int) -> None:
    return None


torch.fx.node.has_side_effect(torch.ops.obs.graph_stats.default)
torch.fx.node.has_side_effect(torch.ops.obs.tap_ref.default)
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


def _last_reader(node: torch.fx.Node) -> torch.fx.Node | None:
    """The last node that reads ``node``'s value as it was made (None: the graph's output reads it): its tap goes
    right after, where Inductor has already lowered every reader (they keep their own code, and the layouts they
    chose) and the value is still alive.  A reader that writes into the value, or that Inductor may make write into
    it, ends the search: the tap must see it before."""
    from torch._inductor.fx_passes.reinplace import inplaceable_ops

    last = node
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    for user in sorted(node.users, key=order.__getitem__):
        if user.op == "output":
            return None
        target = user.target
        if target in inplaceable_ops or (isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable):
            break
        last = user
    return last


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
        mask = sum(1 << COLUMNS.index(c) for c in columns)
        output = next(n for n in reversed(graph.nodes) if n.op == "output")
        with _lock:
            spec_id = len(_specs)
            _specs.append({})
        rows = []
        for i, node in enumerate(nodes):
            with graph.inserting_after(node):
                ref = graph.call_function(torch.ops.obs.tap_ref.default, (node.name,))
            after = _last_reader(node)
            after = ref if after is node else after
            with graph.inserting_before(output) if after is None else graph.inserting_after(after):
                rows.append(add(torch.ops.obs.tap.default, node.name, mask, spec_id, i, node.meta["val"].device))
        value = nodes[0].meta["val"]
        with _lock:
            _specs[spec_id] = ({"backward": backward, "device": str(value.device), "columns": list(columns), "rows": [
                {"node": n.name, "op": str(n.target), "stack": _stack(n), "dtype": str(n.meta["val"].dtype),
                 "shape": [str(d) for d in n.meta["val"].shape]} for n in nodes]})
        from obs.runtime.torch import _tap_lowering

        _tap_lowering.install(mark_absent)
        first = next(n for n in graph.nodes if n.op != "placeholder")
        with graph.inserting_before(first):
            anchor = add(torch.ops.aten.empty.memory_format, [0], dtype=torch.float32, device=value.device)
            graph.call_function(torch.ops.obs.graph_begins.default, (anchor, spec_id))
        with graph.inserting_before(output):
            graph.call_function(torch.ops.obs.graph_stats.default, (rows, spec_id))


def listen(on: bool) -> None:
    """Publish GRAPH_STATS from graphs that have the pass (or not)."""
    _listening[0] = on
