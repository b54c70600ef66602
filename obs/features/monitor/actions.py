"""What an anomaly does besides its stderr line and ring marker: ``monitor.on_anomaly``'s actions.

A sink of the worker (it runs on the ``obs-monitor`` thread, after the ring region's sink, so a bundle holds the step
that was flagged):

- ``bundle``: a non-fatal RDR bundle, reason ``anomaly`` (its manifest's ``fault`` names the first anomaly of the
  step, in causal order: :func:`first_of`); at most one per ``ring_steps`` steps, so the bundles of one excursion
  do not repeat each other.
- ``raise``: :class:`MonitorAnomalyError` in the training thread, at the end of the next optimizer step (the worker
  cannot raise there: it sets a flag that an optimizer step post-hook of this module checks).
- ``capture``: the next ``capture_steps`` steps get the data dump's statistics (``statistic.csv`` per step) and a
  profiler capture window (``task_trace``) while the profiler is on; at most one per ``ring_steps`` steps too.  The
  dump starts at the next step boundary on the training thread (:mod:`obs.features.monitor.capture`).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from obs._core.internal import report_internal_error

__all__ = ["Actions", "MonitorAnomalyError", "describe", "first_of"]

logger = logging.getLogger("obs")


class MonitorAnomalyError(RuntimeError):
    """Raised in the training loop at the end of an optimizer step, after the monitor flagged a value
    (``monitor.on_anomaly: ["raise"]``).  ``step`` is the step flagged, ``anomaly`` its first anomaly (kind, name,
    statistic, value, baseline, rule) as a dict."""

    def __init__(self, message: str, step: int, anomaly: dict[str, Any]) -> None:
        super().__init__(message)
        self.step = step
        self.anomaly = anomaly


def describe(anomaly: Any) -> str:
    """One anomaly in the words of the worker's stderr line."""
    where = anomaly.name if anomaly.micro is None else f"{anomaly.name} (call {anomaly.micro})"
    return (f"step {anomaly.step}: {where} {anomaly.prefix}/{anomaly.stat} = {anomaly.value:.4g}, baseline "
            f"{anomaly.baseline:.4g} ({anomaly.rule}, score {anomaly.score:.3g})")


def _as_dict(anomaly: Any) -> dict[str, Any]:
    return {"step": anomaly.step, "series": anomaly.prefix, "name": anomaly.name, "micro": anomaly.micro,
            "stat": anomaly.stat, "value": anomaly.value, "baseline": anomaly.baseline, "rule": anomaly.rule,
            "score": anomaly.score}


def first_of(found: list[Any]) -> Any:
    """The first of a step's anomalies in causal order, as ``obs monitor explain`` orders them (the module and
    parameter order taken from the order the worker found them in)."""
    if len(found) == 1:
        return found[0]
    from obs.features.monitor.explain import explain
    from obs.features.monitor.reader import MonitorRun
    from recorder.monitor_part import RingAnomaly

    params = list(dict.fromkeys(a.name for a in found if a.prefix not in ("actv", "scalars")))
    modules = [a.name.rpartition(".")[0] for a in found if a.prefix == "actv"] + [p.rpartition(".")[0] for p in params]
    run = MonitorRun("", None, {"params": params, "modules": list(dict.fromkeys(modules))}, [], recorded=tuple(
        RingAnomaly(a.step, a.prefix, a.name, a.micro, a.stat, a.value, a.baseline, a.rule, a.score) for a in found))
    first = explain(run).first
    if first is None:
        return found[0]
    return next((a for a in found if (a.prefix, a.name, a.micro, a.stat, a.rule) ==
                 (first.series, first.name, first.micro_step, first.stat, first.rule)), found[0])


class Actions:
    """The sink of ``on_anomaly``'s actions for one monitor run; :meth:`close` removes its hook."""

    def __init__(self, actions: list[str], *, capture_steps: int, ring_steps: int, folder: str,
                 recorder: Any = None, capture: Any = None) -> None:
        self.actions = frozenset(actions)
        self.folder = folder  #: where a capture's data dump goes
        self.capture_steps, self.ring_steps = capture_steps, ring_steps
        self._recorder = recorder  # a callable giving the live RDR recorder (default: the RDR feature's)
        self._capture = capture  # a callable(step, steps, folder) starting a capture (default: capture.start)
        self.captures: list[Any] = []  #: the captures started (capture.DumpWindow)
        self._lock = threading.Lock()
        self._error: MonitorAnomalyError | None = None
        self._raised_step = -1
        self._next_bundle = -(1 << 62)
        self._next_capture = -(1 << 62)
        self.bundles: list[str] = []  #: the bundles written
        self._warned: set[str] = set()
        self._handle: Any = None
        if "raise" in self.actions:
            from torch.optim import optimizer

            self._handle = optimizer.register_optimizer_step_post_hook(self._check)

    def close(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.remove()
        for window in self.captures:
            if not window.done:
                window.close()

    # -- the training thread ------------------------------------------------------------------------------------
    def _check(self, opt: Any, args: Any, kwargs: Any) -> None:
        """The optimizer step's post-hook: raise what the worker flagged (once per flagged step)."""
        if self._error is None:
            return
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise error

    # -- the worker thread --------------------------------------------------------------------------------------
    def wants_values(self) -> bool:
        return False  # the step's anomalies only

    def __call__(self, step_values: Any) -> None:
        found = step_values.anomalies
        if not found:
            return
        step = step_values.step
        first = first_of(found) if self.actions & {"raise", "bundle"} else found[0]
        if "raise" in self.actions and step > self._raised_step:
            self._raised_step = step
            with self._lock:
                self._error = MonitorAnomalyError(
                    f"obs monitor: anomaly at {describe(first)} (monitor.on_anomaly: raise; "
                    f"{len(found)} anomal{'y' if len(found) == 1 else 'ies'} in the step)", step, _as_dict(first))
        if "bundle" in self.actions and step >= self._next_bundle:
            self._next_bundle = step + self.ring_steps
            self._bundle(step, first, len(found))
        if "capture" in self.actions and step >= self._next_capture:
            self._next_capture = step + max(self.ring_steps, self.capture_steps)
            try:
                start = self._capture
                if start is None:
                    from obs.features.monitor.capture import start
                self.captures.append(start(step, self.capture_steps, self.folder))
            except Exception as exc:  # noqa: BLE001 - reported; a capture that cannot start stops nothing
                report_internal_error("monitor: capture action", exc)

    def _bundle(self, step: int, first: Any, count: int) -> None:
        if self._recorder is None:
            from obs.features.rdr.feature import recorder

            self._recorder = recorder
        live = self._recorder()
        if live is None:
            self._warn_once("bundle", "obs: monitor: on_anomaly 'bundle' needs the Running Data Recorder on "
                                      '({"rdr": {"enable": true, ...}}); no bundle written')
            return
        fault = {"kind": "anomaly", "where": f"monitor: {describe(first)}", "monitor_step": step,
                 "anomalies": count, "anomaly": _as_dict(first)}
        path = live.dump("anomaly", fault=fault)
        if path:
            self.bundles.append(path)

    def _warn_once(self, key: str, text: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(text)
