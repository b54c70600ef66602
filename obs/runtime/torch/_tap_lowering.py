"""Inductor's lowerings of obs's graph taps: a tap reads a tensor only where Inductor writes it to memory anyway.

``obs::tap_ref`` (right after a tapped node) keeps the node's lowered value; ``obs::tap`` (after the node's last
reader) becomes a call of ``obs::tap_stats`` on it when Inductor has made it a buffer: an extern kernel's output, a
reduction, a value saved for backward or read by more than one kernel.  A value that Inductor computes inside its
readers' loops and never stores gets no tap: storing it for us would change its readers' kernels (their loops, their
vectorization and with them the order of their sums), and so the user's numbers.  Its row is marked absent; the
NaN/Inf check then finds a NaN in the first stored value it reaches.  Imported by the graph pass when it first taps a
graph (it imports Inductor's lowering tables).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch._inductor import ir
from torch._inductor.lowering import fallback_handler, lowerings, register_lowering
from torch._inductor.virtualized import V

from obs._core.internal import report_internal_error

_stats = fallback_handler(torch.ops.obs.tap_stats.default, add_to_fallback_set=False)
_on_absent: list[Callable[[int, int], None]] = []  # what the graph pass is told of a row with no values


def install(on_absent: Callable[[int, int], None]) -> None:
    """Lower the taps from now on; ``on_absent(spec, row)`` hears of each row left without values."""
    _on_absent[:] = [on_absent]


def _values() -> dict[str, Any]:
    """The lowered values kept for taps in the graph Inductor lowers now, by node name."""
    graph = V.graph
    kept = getattr(graph, "_obs_tapped", None)
    if kept is None:
        kept = graph._obs_tapped = {}
    return kept


@register_lowering(torch.ops.obs.tap_ref.default, type_promotion_kind=None)
def _tap_ref(name: str) -> None:
    try:  # a node a later pass replaced (Inductor's reinplacing turns a scatter into a write) is gone: no row
        node = next((n for n in V.graph.current_node.graph.nodes if n.name == name), None)
        _values()[name] = V.graph.env.get(node) if node is not None else None
    except Exception as exc:  # noqa: BLE001 - reported; the graph compiles, the tap gets no row
        report_internal_error("graph tap", exc)


@register_lowering(torch.ops.obs.tap.default, type_promotion_kind=None)
def _tap(name: str, columns: int, spec: int, row: int, device: torch.device) -> Any:
    try:
        value = _values().pop(name, None)
        if isinstance(value, ir.TensorBox) and ir.is_storage_and_layout(value):
            return _stats(value, columns)
    except Exception as exc:  # noqa: BLE001 - reported; the graph compiles, the tap gets no row
        report_internal_error("graph tap", exc)
    for tell in _on_absent:
        tell(spec, row)
    return lowerings[torch.ops.aten.full.default]([columns.bit_count()], math.nan, dtype=torch.float32,
                                                   device=device, pin_memory=False)
