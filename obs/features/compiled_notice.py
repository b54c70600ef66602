"""What a feature cannot see inside torch.compile'd code, said once, when the process first compiles.

A feature that works at a coarser level inside compiled code (a compiled module is one module; fused
kernels have no per-op tensors) holds a :class:`CompiledNotice` while it is on.  At the first compile
Dynamo starts (COMPILE_RECORD ``dynamo_start``), or for what only Inductor hides at the first graph Inductor
compiles (:data:`INDUCTOR`), each notice held logs one warning on the ``obs`` logger naming the feature, what
it cannot see there and how to get it; then it stops listening.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from obs._core.events import Event, Subscription, bus

__all__ = ["INDUCTOR", "CompiledNotice"]

#: The COMPILE_RECORD kinds only an Inductor compile gives (a graph compiled or loaded from its cache).
INDUCTOR = frozenset({"inductor_post_grad_graph", "inductor_output_code"})

logger = logging.getLogger("obs")
_said: set[str] = set()  # once per process and text
_lock = threading.Lock()


class CompiledNotice:
    """Logs ``f"obs: {feature}: {text}"`` once at the first torch.compile (at the first record of a kind in
    ``when``) while held; ``remove()`` drops it."""

    def __init__(self, feature: str, text: str, when: frozenset[str] = frozenset({"dynamo_start"})) -> None:
        self.message = f"obs: {feature} with torch.compile: {text}"
        self._when = when
        self._sub: Subscription | None = None
        if self.message not in _said:
            self._sub = bus.subscribe(Event.COMPILE_RECORD, self._on_record)

    def _on_record(self, compile_id: str, kind: str, meta: dict[str, Any], payload: str) -> None:
        if kind not in self._when:
            return
        with _lock:
            first = self.message not in _said
            _said.add(self.message)
        if first:
            logger.warning("%s", self.message)
        self.remove()

    def remove(self) -> None:
        if self._sub is not None:
            self._sub.remove()
            self._sub = None
