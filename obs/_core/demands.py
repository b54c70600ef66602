"""What the features ask of the runtime adapters, published here: an adapter reads a demand, never a feature.

A feature sets its entry when it is imported (the wiring imports every feature before any adapter
runs); the defaults are what the adapters do with no feature loaded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["demands"]


def _no_graphs() -> int:
    return 0


def _no_print_sink(values: tuple[Any, ...], source: str) -> Any:
    raise RuntimeError("obs.Print ran inside a compiled graph, but the print feature is not loaded")


class Demands:
    """The demands in force (one process-wide instance, :data:`demands`)."""

    def __init__(self) -> None:
        #: The save_graphs level in force; ``obs.compile`` captures the graphs after AOT autograd from level 2.
        self.graph_level: Callable[[], int] = _no_graphs
        #: Where a Print call that was compiled into a graph goes when the graph runs: ``(values, "file:line")``.
        self.print_sink: Callable[[tuple[Any, ...], str], Any] = _no_print_sink
        #: What Inductor-compiled graphs compute of their own tensors, per feature that asks: the columns
        #: (``obs.runtime.torch._graph_taps.COLUMNS`` names) and whether every node (else module outputs only).
        self.graph_stats: dict[object, tuple[frozenset[str], bool]] = {}


demands = Demands()
