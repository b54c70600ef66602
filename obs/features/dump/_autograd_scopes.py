"""Which forward module created an autograd node: module calls record autograd sequence numbers.

Autograd numbers the nodes it creates on a thread in order (``_sequence_nr``).  At a module's
enter and exit the next number is read (one C call each), so a module's nodes are the interval
``[enter, exit)``; the innermost interval holding a node's number is its forward module.  Intervals
are kept in exit order, so their ends never decrease and the first one ending after a node's number
that also starts at or before it is the innermost (a module that exits first is nested in those
exiting later, or started after the node): a bisection, then a short scan.  A bounded window of
intervals is kept (older steps' nodes are gone by then anyway).
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Any

import torch

from obs._core.events import Event, Subscription, bus

__all__ = ["ModuleSpans"]

_KEPT = 1 << 14


class ModuleSpans:
    """Subscribes to MODULE_ENTER/EXIT while installed; ``module_of(node)`` answers."""

    def __init__(self) -> None:
        self._ends: list[int] = []
        self._spans: list[tuple[int, str]] = []  # (start, scope), beside their ends
        self._starts: list[int] = []
        self._subs: list[Subscription] = []
        self._cache: dict[int, str] = {}

    def install(self) -> ModuleSpans:
        seq = torch._C._autograd._get_sequence_nr
        starts, ends, spans, cache = self._starts, self._ends, self._spans, self._cache

        def enter(scope: str, module: Any) -> None:
            starts.append(seq())

        def leave(scope: str, module: Any, error: Any) -> None:
            if starts:
                end = seq()
                if ends and end < ends[-1]:  # another thread's numbers: keep the order bisection needs
                    end = ends[-1]
                ends.append(end)
                spans.append((starts.pop(), scope))
                if len(ends) > 2 * _KEPT:
                    del ends[:_KEPT], spans[:_KEPT]
                if cache:
                    cache.clear()

        self._subs = [bus.subscribe(Event.MODULE_ENTER, enter), bus.subscribe(Event.MODULE_EXIT, leave)]
        return self

    def remove(self) -> None:
        for sub in self._subs:
            sub.remove()
        self._subs = []

    def module_of(self, node: Any) -> str:
        """Scope of the innermost module whose forward created autograd ``node`` ('' when none did)."""
        try:
            nr = int(node._sequence_nr())
        except Exception:  # noqa: BLE001 - a node without a sequence number has no scope
            return ""
        found = self._cache.get(nr)
        if found is not None:
            return found
        best, spans = "", self._spans
        for i in range(bisect_right(self._ends, nr), len(spans)):
            if spans[i][0] <= nr:
                best = spans[i][1]
                break
        self._cache[nr] = best
        return best
