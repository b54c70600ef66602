"""Capture windows: detail (module spans, and op spans where asked) for chosen steps only, in the session in force.

Two sources: the env config's ``profiler.window`` (``{"start": S, "steps": N, "level": ...}``, steps S..S+N-1,
hot-reloaded) and ``capture`` requests (``obs trace capture``: the next N steps after the rank sees the request),
read by the session's own :class:`recorder.requests.RequestWatcher` on the profiler's output folder.  The
training thread asks :meth:`Windows.level` at each step boundary which detail the next step gets; the session then
subscribes (or drops) the module and op events, so outside every window no module event is published and the op
interceptor is not installed.  A request is placed (its steps fixed) on the training thread at the next boundary;
the watcher's thread waits for that, bounded, to answer with the steps.
"""

from __future__ import annotations

import threading
from typing import Any

from obs.settings.profiler_options import WINDOW_LEVELS, CaptureWindow, capture_params
from recorder.requests import Request

__all__ = ["ANSWER_WAIT_S", "CAPTURE", "Windows", "deeper"]

CAPTURE = "capture"  #: the request kind
ANSWER_WAIT_S = 5.0  #: a capture's answer waits this long for the next step boundary, then says it is queued


def deeper(a: str | None, b: str | None) -> str | None:
    """The more detailed of two window levels (None: no detail)."""
    if a is None or b is None:
        return a or b
    return a if WINDOW_LEVELS.index(a) >= WINDOW_LEVELS.index(b) else b


class _Pending:
    __slots__ = ("steps", "level", "placed", "window", "cancelled")

    def __init__(self, steps: int, level: str) -> None:
        self.steps, self.level = steps, level
        self.placed = threading.Event()
        self.window: CaptureWindow | None = None
        self.cancelled = False


class Windows:
    """The windows of one session: the env config's and the captures asked for.  :meth:`place` and :meth:`level`
    run on the training thread; :meth:`ask` / :meth:`handle` on any thread."""

    def __init__(self, config: CaptureWindow | None = None) -> None:
        self._lock = threading.Lock()
        self.config = config
        self.captures: list[CaptureWindow] = []  #: placed capture windows not yet over
        self._pending: list[_Pending] = []
        self._closed = False

    def configure(self, window: CaptureWindow | None) -> None:
        """The env config's window in force (a hot reload)."""
        self.config = window

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def place(self, next_step: int) -> None:
        """Requests seen since the last boundary begin at ``next_step`` (the step about to begin)."""
        with self._lock:
            pending, self._pending = self._pending, []
        for ask in pending:
            ask.window = CaptureWindow(next_step, ask.steps, ask.level)
            self.captures.append(ask.window)
            ask.placed.set()

    def level(self, step: int) -> str | None:
        """The detail ``step`` gets: None (step and phase spans only), ``task_trace`` or ``op_trace``."""
        if self.captures:
            self.captures = [w for w in self.captures if w.last >= step]
        level = self.config.level if self.config is not None and self.config.covers(step) else None
        for window in self.captures:
            if window.covers(step):
                level = deeper(level, window.level)
        return level

    def ask(self, steps: int, level: str) -> _Pending:
        ask = _Pending(steps, level)
        with self._lock:
            if self._closed:
                ask.cancelled = True
                ask.placed.set()
            else:
                self._pending.append(ask)
        return ask

    def close(self) -> None:
        """The session ends: every capture still waiting for a boundary is answered as cancelled."""
        with self._lock:
            self._closed = True
            pending, self._pending = self._pending, []
        for ask in pending:
            ask.cancelled = True
            ask.placed.set()

    def handle(self, request: Request, *, step: int, wait_s: float = ANSWER_WAIT_S) -> dict[str, Any]:
        """A ``capture`` request (on the watcher's thread): its params checked, the window asked for, and the answer:
        ``steps`` [first, last] once the training thread placed it, else ``queued`` (it begins at the first step
        boundary after ``after_step``)."""
        try:
            steps, level = capture_params(request.params, "capture")
        except (TypeError, ValueError) as exc:  # the asker's mistake, answered (not one of ours to report)
            return {"error": str(exc)}
        ask = self.ask(steps, level)
        ask.placed.wait(wait_s)
        if ask.cancelled:
            return {"error": "the profiling session ended before the window began"}
        window = ask.window
        if window is None:
            return {"queued": True, "after_step": step, "level": level, "count": steps,
                    "note": f"no step boundary within {wait_s:g} s: the {steps} steps begin at the next one"}
        return {"steps": [window.start, window.last], "level": level, "count": steps}
