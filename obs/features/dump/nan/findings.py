"""What the NaN/Inf check does with a finding: at most one per step, ``limit`` in all, each a fault folder and a FAULT.

A finding is made either where the check read the tensor (:meth:`Findings.report`: exact counts, the inputs and the
bad tensor in its folder, ``action="raise"`` raises right there), or from a step's device gates read after the step
(:meth:`Findings.report_later`, on the poller's thread: :mod:`obs.features.dump.nan.device_flags`), or from the counts a
compiled graph computed on the device, read after the step (:meth:`Findings.report_counted_later`: exact counts, no
tensors, no Python stack, raised as late findings are).  A late finding
knows the place, the step and which of NaN, +Inf, -Inf the tensor held (a NaN hides the infinities), not how many:
the tensors are gone, so its folder has ``meta.json`` alone, says so (``counted``: false, ``tensors``), and its
counts are null.  With ``action="raise"`` its error is kept and raised on the training thread by the next check
that runs there (:meth:`Findings.raise_pending`): in the step after the bad one, or later when the host runs ahead
of the device by more than a step.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from obs._core.events import Event, bus
from obs._core.internal import report_internal_error, suppressed
from obs.features.dump.fault_folder import python_stack, write_fault_folder
from obs.settings.parallel import rank

__all__ = ["Findings", "NonFiniteError"]

_NOT_KEPT = ("not kept: on this device the check reads each step's gates once, after the step, when its tensors are "
             "gone (nan_check 'sync': true checks each one as it is made, with a host sync, and keeps them)")


class NonFiniteError(FloatingPointError):
    """Raised (``action="raise"``) where the first NaN/Inf appeared; ``folder`` is its fault folder (``capture``, the
    name it had before, still answers)."""

    def __init__(self, message: str, folder: str | None) -> None:
        super().__init__(message)
        self.folder = folder

    @property
    def capture(self) -> str | None:
        """The fault folder, by its former name."""
        return self.folder


def kinds(low: float, high: float) -> list[str]:
    """What a tensor whose minimum and maximum are ``low`` and ``high`` holds: NaN, or +Inf and/or -Inf."""
    if math.isnan(low) or math.isnan(high):
        return ["NaN"]  # aminmax gives NaN for both: the infinities cannot be told
    return [name for name, bad in (("+Inf", high == math.inf), ("-Inf", low == -math.inf)) if bad]


def _counted(counts: tuple[int, int, int]) -> tuple[dict[str, Any], str]:
    """A finding's fields and message tail from its NaN, +Inf and -Inf counts."""
    return {"nan": counts[0], "pos_inf": counts[1], "neg_inf": counts[2]}, \
        f"{counts[0]} NaN, {counts[1]} +Inf, {counts[2]} -Inf"


class Findings:
    """The findings of one check; ``on_report(step, late)`` is called (under a lock) when one is made (``late``:
    by :meth:`report_later`)."""

    def __init__(self, root: str, action: str, limit: int, on_report: Callable[[int, bool], None]) -> None:
        self.root, self.action, self.limit = root, action, limit
        self.findings: list[dict[str, Any]] = []
        self.step_reported = -1
        self._on_report = on_report
        self._lock = threading.Lock()
        self.pending: NonFiniteError | None = None  # a late finding's error, for the training thread to raise

    @property
    def done(self) -> bool:
        return bool(self.limit) and len(self.findings) >= self.limit

    def report(self, step: int, phase: str, kind: str, scope: str, op: str, counts: tuple[int, int, int],
               where: str, groups: list[tuple[str, Any]], frame: FrameType | None) -> None:
        """A finding where the tensor was read (``frame``: the user's code that made it): its folder, FAULT, and the
        raise of ``action="raise"``."""
        made = self._make(step, phase, kind, scope, op, where, *_counted(counts), groups, frame, False)
        if made is not None:
            error, place = made
            bus.emit(Event.FAULT, "nan_inf", place, error)
            if self.action == "raise":
                raise error

    def report_counted_later(self, step: int, phase: str, kind: str, scope: str, op: str,
                             counts: tuple[int, int, int], where: str) -> bool:
        """A finding with exact counts made off the training thread (a compiled graph's statistics, read after the
        step): :meth:`report`'s, without a Python stack, its error raised as :meth:`report_later`'s; False once no
        more can be made."""
        if self.done:
            return False
        made = self._make(step, phase, kind, scope, op, where, *_counted(counts), [], None, True)
        self._raise_later(made)
        return not self.done

    def report_later(self, step: int, label: tuple[str, str, str, str, str], low: float, high: float) -> bool:
        """A finding from a step's device gates (``label``: phase, kind, scope, op, where); False once no more
        can be made."""
        if self.done:
            return False
        if step == self.step_reported:
            return True
        phase, kind, scope, op, where = label
        found = kinds(low, high)
        fields = {"nan": None, "pos_inf": None, "neg_inf": None, "found": found, "counted": False,
                  "tensors": _NOT_KEPT}
        tail = " and ".join(found) + " (read at the step's end, not counted)"
        made = self._make(step, phase, kind, scope, op, where, fields, tail, [], None, True)
        self._raise_later(made)
        return not self.done

    def _raise_later(self, made: Any) -> None:
        """A late finding's FAULT, and its error kept for :meth:`raise_pending` (``action="raise"``)."""
        if made is not None:
            error, place = made
            bus.emit(Event.FAULT, "nan_inf", place, error)
            if self.action == "raise":
                self.pending = error

    def raise_pending(self) -> None:
        """Raise a late finding's error (``action="raise"``) on the calling thread, once."""
        error, self.pending = self.pending, None
        if error is not None:
            raise error

    def _make(self, step: int, phase: str, kind: str, scope: str, op: str, where: str, fields: dict[str, Any],
              tail: str, groups: list[tuple[str, Any]],
              frame: FrameType | None, late: bool) -> tuple[NonFiniteError, str] | None:
        """The fault folder and the record of a finding, and its error and place for the FAULT; None where it is not
        made (one a step, ``limit`` in all)."""
        with self._lock:
            if self.done or self.step_reported == step:
                return None
            self.step_reported = step
            place = f"{scope}/{op}" if kind == "op" else scope
            finding = {"phase": phase, "kind": kind, "scope": scope, "op": op, "step": step, "where": where,
                       **fields, "rank": rank()}
            message = f"first NaN/Inf in {phase} at {place} (step {step}, {where}): {tail}"
            folder = None
            try:
                meta = {**finding, "message": message, "python_stack": python_stack(None, frame) if frame else []}
                with suppressed():
                    folder = write_fault_folder(self.root, finding["rank"], "nan_check", place, meta, groups,
                                                "NaN/Inf dump")
            except Exception as exc:  # noqa: BLE001 - reported; the finding is kept without its folder
                report_internal_error("nan_check write", exc)
            finding["folder"] = folder
            self.findings.append(finding)
            self._on_report(step, late)
        return NonFiniteError(message, folder), place  # the recorder's event and bundle say what was found
