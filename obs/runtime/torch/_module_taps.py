"""Graph taps of chosen modules' inputs and outputs in compiled training graphs: activations without module hooks.

A module hook inside a compiled model is traced into its graph (or breaks it); these taps are added after AOT
autograd instead, to the forward graph of training (backward and inference graphs are left as they are), so Dynamo
compiles the same frames into the same graphs.  Which values are a module's inputs and outputs:
:mod:`._module_io`.  A value that is two modules' (one's output, the next one's input) is tapped once.

Each tapped value gets a row: ``stats(tensor)`` (the caller's statistics, one float32 vector of ``width``) computed
by ``obs::xy_stats``, an op of its own outside the graph's kernels; the graph's end hands every row of the call to
``on_rows(rows, values)`` (``values``: one tensor, a row per tap, on the graph's device; nothing read back).

* **Inductor** (``post_grad_custom_post_pass``): placed as the graph taps of :mod:`._graph_taps` are, after the
  value's last reader, and lowered only where Inductor holds the value in memory anyway (an extern kernel's output,
  a reduction, a value saved for backward): the user's kernels stay as they are.  A value Inductor keeps inside its
  readers' loops has no row (``absent``).
* **aot_eager** (its compilers, ``boxed_nop``, wrapped while taps are on): the graph runs op by op; each value is
  tapped right after it is made (a graph input at the graph's start).

Graphs compiled before :meth:`ModuleTaps.install` have no taps; graphs compiled while taps are on keep them (an op
call that returns a row of zeros once the taps are removed).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from obs._core.internal import report_internal_error, suppressed
from obs.runtime.torch._module_io import select

__all__ = ["ModuleTaps"]

_VERSION = "obs-module-taps-1"
_lock = threading.Lock()
_specs: list[tuple[ModuleTaps, list[dict[str, Any]]]] = []  # spec id -> its owner and the rows of its graph
_told: set[int] = set()  # specs whose values Inductor fused away were said on stderr
logger = logging.getLogger("obs")
_active: list[ModuleTaps] = []
_patched: list[Any] = []  # aot_eager's boxed_nop, as it was, while it is wrapped


@torch.library.custom_op("obs::xy_stats", mutates_args=())
def xy_stats(x: torch.Tensor, spec: int, row: int, width: int) -> torch.Tensor:
    """Row ``row`` of spec ``spec``: its owner's statistics of ``x``, computed eagerly, outside the graph's kernels."""
    owner = _specs[spec][0]
    if owner.removed:
        return torch.zeros(width, dtype=torch.float32, device=x.device)
    with suppressed(), torch.no_grad():
        return owner.stats(x.detach()).to(torch.float32)


@xy_stats.register_fake
def _(x: torch.Tensor, spec: int, row: int, width: int) -> torch.Tensor:
    return x.new_empty((width,), dtype=torch.float32)


@torch.library.custom_op("obs::xy_ref", mutates_args=())
def xy_ref(name: str) -> None:
    """Right after the node ``name`` (Inductor): its lowering keeps the node's lowered value for the tap."""
    raise RuntimeError("obs::xy_ref runs only inside an Inductor-compiled graph")


@xy_ref.register_fake
def _(name: str) -> None:
    return None


@torch.library.custom_op("obs::xy_tap", mutates_args=())
def xy_tap(name: str, spec: int, row: int, width: int, device: torch.device) -> torch.Tensor:
    """Row ``row`` of spec ``spec`` of the node ``name`` (Inductor): ``obs::xy_stats`` where its value is in memory."""
    raise RuntimeError("obs::xy_tap runs only inside an Inductor-compiled graph")


@xy_tap.register_fake
def _(name: str, spec: int, row: int, width: int, device: torch.device) -> torch.Tensor:
    return torch.empty((width,), dtype=torch.float32, device=device)


@torch.library.custom_op("obs::xy_rows", mutates_args=())
def xy_rows(rows: list[torch.Tensor], spec: int) -> None:
    """The graph's end: its rows (those with values) to the owner of spec ``spec``."""
    owner, specs = _specs[spec]
    if owner.removed:
        return
    try:
        with suppressed():
            kept = [i for i, r in enumerate(specs) if not r.get("absent")]
            if len(kept) < len(specs) and spec not in _told:
                _told.add(spec)
                _say_fused([r for r in specs if r.get("absent")], len(specs))
            if kept:
                owner.on_rows([specs[i] for i in kept], torch.stack([rows[i] for i in kept]))
    except Exception as exc:  # noqa: BLE001 - reported; the compiled step goes on
        report_internal_error("monitor: compiled activations", exc)


def _say_fused(absent: list[dict[str, Any]], total: int) -> None:
    """Once per graph: which chosen values got no statistics, because Inductor computes them inside a kernel."""
    names = sorted({f"{r['module']}.{r['io']}" for r in absent})
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    logger.warning("obs: monitor: %d of the %d module inputs/outputs chosen in a graph Inductor compiled are "
                   "computed inside its fused kernels, never in memory, so they get no activation statistics (tapping "
                   "them would change the kernels): %s. Their submodules' values may be in memory; "
                   "backend=\"aot_eager\" keeps every one.", len(absent), total, shown)


@xy_rows.register_fake
def _(rows: list[torch.Tensor], spec: int) -> None:
    return None


torch.fx.node.has_side_effect(torch.ops.obs.xy_ref.default)
torch.fx.node.has_side_effect(torch.ops.obs.xy_rows.default)

class ModuleTaps:
    """Taps on the modules ``chosen(name)`` accepts, in graphs compiled from :meth:`install` to :meth:`remove`."""

    def __init__(self, chosen: Callable[[str], bool], stats: Callable[[torch.Tensor], torch.Tensor], width: int,
                 on_rows: Callable[[list[dict[str, Any]], torch.Tensor], None]) -> None:
        self.chosen, self.stats, self.width, self.on_rows = chosen, stats, width, on_rows
        self.removed = False
        self.graphs = 0  #: graphs tapped

    # -- install / remove ---------------------------------------------------------------------------
    def install(self) -> ModuleTaps:
        from torch._dynamo.backends import debugging
        from torch._inductor import config

        with _lock:
            _active.append(self)
            if not _patched:
                _patched.append(debugging.boxed_nop)
                debugging.boxed_nop = _boxed_nop
        config.post_grad_custom_post_pass = [*_passes(config.post_grad_custom_post_pass), self]
        return self

    def remove(self) -> None:
        from torch._dynamo.backends import debugging
        from torch._inductor import config

        self.removed = True
        self.on_rows = _drop  # compiled graphs keep their taps (and this object): they hold on to nothing more
        passes = [p for p in _passes(config.post_grad_custom_post_pass) if p is not self]
        config.post_grad_custom_post_pass = passes[0] if len(passes) == 1 else (passes or None)
        with _lock:
            if self in _active:
                _active.remove(self)
            if not _active and _patched:
                debugging.boxed_nop = _patched.pop()

    # -- Inductor's post-grad pass (CustomGraphPass: __call__(graph), uuid()) -------------------------
    def __call__(self, graph: torch.fx.Graph) -> None:
        try:
            if not self.removed:
                self._inductor(graph)
        except Exception as exc:  # noqa: BLE001 - reported; the graph compiles without taps
            report_internal_error("monitor: compiled activations (Inductor)", exc)

    def uuid(self) -> bytes:
        # Inductor's caches key on this: graphs with these taps (spec ids of this process) are graphs of their own
        return hashlib.sha256(f"{_VERSION}/{id(self)}/{os.getpid()}".encode()).digest()

    def _spec(self, rows: list[dict[str, Any]]) -> int:
        with _lock:
            _specs.append((self, rows))
            self.graphs += 1
            return len(_specs) - 1

    def _inductor(self, graph: torch.fx.Graph) -> None:
        from obs.runtime.torch._graph_taps import _Builder, _last_reader

        chosen = select(graph, self.chosen)
        if not chosen:
            return
        from torch._guards import detect_fake_mode

        fake_mode = detect_fake_mode([n.meta["val"] for n, _ in chosen])
        if fake_mode is None:
            return
        _lowerings()
        add = _Builder(graph, fake_mode)
        spec = self._spec([row for _, row in chosen])
        output = next(n for n in reversed(graph.nodes) if n.op == "output")
        first = next(n for n in graph.nodes if n.op != "placeholder")
        rows, made = [], {}
        for i, (node, _) in enumerate(chosen):
            if node not in made:  # a value that is two modules' (one's output, the next one's input): one tap
                with graph.inserting_before(first) if node.op == "placeholder" else graph.inserting_after(node):
                    ref = graph.call_function(torch.ops.obs.xy_ref.default, (node.name,))
                after = _last_reader(node)
                after = ref if after is node or (after is not None and after.op == "placeholder") else after
                with graph.inserting_before(output) if after is None else graph.inserting_after(after):
                    made[node] = add(torch.ops.obs.xy_tap.default, node.name, spec, i, self.width,
                                     node.meta["val"].device)
            rows.append(made[node])
        with graph.inserting_before(output):
            graph.call_function(torch.ops.obs.xy_rows.default, (rows, spec))

    # -- aot_eager's compilers --------------------------------------------------------------------------
    def _eager(self, gm: torch.fx.GraphModule) -> None:
        graph = gm.graph
        chosen = select(graph, self.chosen)
        if not chosen:
            return
        spec = self._spec([row for _, row in chosen])
        output = next(n for n in reversed(graph.nodes) if n.op == "output")
        first = next(n for n in graph.nodes if n.op != "placeholder")
        rows, made = [], {}
        for i, (node, _) in enumerate(chosen):  # right after the value is made: as its module returned it
            if node not in made:
                with graph.inserting_before(first) if node.op == "placeholder" else graph.inserting_after(node):
                    made[node] = graph.call_function(torch.ops.obs.xy_stats.default, (node, spec, i, self.width))
            rows.append(made[node])
        with graph.inserting_before(output):
            graph.call_function(torch.ops.obs.xy_rows.default, (rows, spec))
        gm.recompile()


def _drop(rows: list[dict[str, Any]], values: torch.Tensor) -> None:
    return None


def _passes(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [] if value is None else [value]


def _boxed_nop(fx_g: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
    """aot_eager's compiler with the active taps added to its training forward graphs first."""
    for taps in list(_active):
        try:
            if not taps.removed:
                taps._eager(fx_g)
        except Exception as exc:  # noqa: BLE001 - reported; the graph runs without taps
            report_internal_error("monitor: compiled activations (aot_eager)", exc)
    original = _patched[0] if _patched else _original_boxed_nop()
    return original(fx_g, example_inputs)


def _original_boxed_nop() -> Any:
    from torch._dynamo.backends import debugging

    found = debugging.boxed_nop
    return found if found is not _boxed_nop else None


_lowered: list[bool] = []


def _lowerings() -> None:
    """Inductor's lowerings of ``obs::xy_ref`` and ``obs::xy_tap`` (registered once, at the first tapped graph)."""
    if _lowered:
        return
    _lowered.append(True)
    import math

    from torch._inductor import ir
    from torch._inductor.lowering import fallback_handler, lowerings, register_lowering
    from torch._inductor.virtualized import V

    stats = fallback_handler(torch.ops.obs.xy_stats.default, add_to_fallback_set=False)

    def values() -> dict[str, Any]:
        kept = getattr(V.graph, "_obs_xy", None)
        if kept is None:
            kept = V.graph._obs_xy = {}
        return kept

    @register_lowering(torch.ops.obs.xy_ref.default, type_promotion_kind=None)
    def _ref(name: str) -> None:
        try:
            node = next((n for n in V.graph.current_node.graph.nodes if n.name == name), None)
            values()[name] = V.graph.env.get(node) if node is not None else None
        except Exception as exc:  # noqa: BLE001 - reported; the graph compiles, the tap gets no row
            report_internal_error("monitor: compiled activations (tap)", exc)

    @register_lowering(torch.ops.obs.xy_tap.default, type_promotion_kind=None)
    def _tap(name: str, spec: int, row: int, width: int, device: torch.device) -> Any:
        try:
            value = values().get(name)
            if isinstance(value, ir.TensorBox) and ir.is_storage_and_layout(value):
                return stats(value, spec, row, width)
        except Exception as exc:  # noqa: BLE001 - reported; the graph compiles, the tap gets no row
            report_internal_error("monitor: compiled activations (tap)", exc)
        with _lock:  # every row of that value
            for entry in _specs[spec][1]:
                if entry["node"] == name:
                    entry["absent"] = True
        return lowerings[torch.ops.aten.full.default]([width], math.nan, dtype=torch.float32, device=device,
                                                       pin_memory=False)
