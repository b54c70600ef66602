"""The monitor's worker thread: each step's values to msprobe's CSV files, judged by the anomaly rules, anomalies
to stderr.  Off the training thread: the training thread hands over one :class:`Packet` per step (the values still in
one tensor) and goes on; the worker reads the tensor, writes rows and runs the rules.  A packet's layout is compiled
once (:class:`~obs.features.monitor.step_plan.StepPlan`), a step's values are judged in one call
(:meth:`Detector.judge_many`), and each file gets one write per drain.

An anomaly writes one line on stderr (at most :data:`LINES_PER_STEP` per step, then a count of the rest).

Other outputs (the RDR ring's region, TensorBoard, metrics) are *sinks*: callables given to the worker, each called on
the worker thread with every judged step as a :class:`StepValues`.  A sink with a ``wants_values()`` method that
returns False then (the recorder off, the metrics off) gets the step's anomalies only: while no sink wants them, the
step's values are not gathered.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from obs._core import safe_files
from obs._core.internal import report_internal_error
from obs._core.outputs import wrote
from obs.features.monitor.detect import Detector
from obs.features.monitor.layout import META, PREFIXES, SCHEMA_VERSION, columns
from obs.features.monitor.step_plan import StepPlan, layout_key

__all__ = ["LINES_PER_STEP", "Anomaly", "Block", "Packet", "StepValues", "Worker"]

LINES_PER_STEP = 5
DRAIN_S = 0.05  #: how often the worker takes what the training thread handed over
_PLANS = 64  #: packet layouts compiled at once
_SCALARS_HEADER = columns("scalars", ["value"])


def _always() -> bool:
    return True


@dataclass(frozen=True)
class Block:
    """Rows of one kind of values in a packet: ``stats`` per row, in the packet's order.  A prefix starting with
    ``_`` is an input of derived rows, not written itself (``_gnorm``, ``_unorm``, ``_wnorm``, ``_loss``)."""

    prefix: str
    rows: tuple[tuple[str, int | None, str, str], ...]  #: (name, micro_step or None, shape, dtype)
    stats: tuple[str, ...]
    scales: tuple[float, ...] | None = None  #: ``_unorm``: each row's factor from a sample's norm to the whole

    @property
    def size(self) -> int:
        return len(self.rows) * len(self.stats)


@dataclass
class Packet:
    """One collected step: its number, its blocks, and their values (a tensor or a list, flattened in order)."""

    step: int
    blocks: list[Block]
    values: Any
    #: the wall clock (ns) when the packet was made: on the training thread, right after the optimizer step
    t: int = field(default_factory=time.time_ns)


@dataclass
class Anomaly:
    """One flagged value, as the worker saw it."""

    step: int
    prefix: str
    name: str
    micro: int | None
    stat: str
    value: float
    baseline: float
    rule: str
    score: float


@dataclass
class StepValues:
    """One judged step, as the sinks get it: every value written (``(prefix, name, micro, stat, value)``, the CSV
    file's prefix and row) and the anomalies found in it."""

    step: int
    values: list[tuple[str, str, int | None, str, float]]
    anomalies: list[Anomaly]


@dataclass
class _Counts:
    done: int = 0
    anomalies: list[Anomaly] = field(default_factory=list)


class Worker:
    """Writes CSV rows and judges values on its own thread (``obs-monitor``)."""

    def __init__(self, folder: str | None, *, detector: Detector, ndigits: int, per_file: int,
                 stream: Any = None, on_anomaly: Any = None, sinks: list[Any] | None = None) -> None:
        self.folder, self.detector, self.ndigits, self.per_file = folder, detector, ndigits, per_file
        self.stream = stream
        self.on_anomaly = on_anomaly  #: called with each reported anomaly (the RDR ring's marker)
        self.sinks: list[Any] = list(sinks or ())  #: called with each judged step's :class:`StepValues`
        self.on_step: Any = None  #: called with each packet's (step, wall time ns) after the sinks (clock.py)
        self._step_values: list[tuple[str, str, int | None, str, float]] = []
        self._keep = False  # whether a sink wants this step's values
        self._items: collections.deque[Any] = collections.deque()  # appended by the training thread, no lock
        self._wake = threading.Event()
        self._stop = False
        self._cond = threading.Condition()
        self._counts = _Counts()
        self._submitted = 0  # only the training thread counts (itertools-free: one int add)
        self._files: dict[str, tuple[int, int]] = {}  # prefix -> (chunk start, fd)
        self._loss_from_scalar = False
        self._plans: dict[tuple[Any, ...], StepPlan] = {}  # a packet layout's compiled step
        self._queued: dict[str, tuple[int, list[str], list[str]]] = {}  # prefix -> (file's first step, header, rows)
        self._thread = threading.Thread(target=self._run, name="obs-monitor", daemon=True)
        self._thread.start()

    # -- the training thread's side ---------------------------------------------------------------
    def submit(self, item: Any) -> None:
        """Hand over one item: an append, no wake-up (the worker drains every :data:`DRAIN_S` seconds, so the
        training thread pays no thread switch per step)."""
        self._submitted += 1
        self._items.append(item)

    def flush(self, timeout: float | None = 30.0) -> bool:
        """Wait until everything submitted so far is written and judged."""
        deadline = None if timeout is None else time.monotonic() + timeout
        target = self._submitted
        self._wake.set()
        with self._cond:
            while self._counts.done < target:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                if not self._thread.is_alive():
                    return False
                self._cond.wait(left if left is not None else 1.0)
        return True

    def close(self, timeout: float = 30.0) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout)
        for _, fd in self._files.values():
            os.close(fd)
        self._files.clear()

    @property
    def anomalies(self) -> list[Anomaly]:
        with self._cond:
            return list(self._counts.anomalies)

    # -- the worker's side --------------------------------------------------------------------------
    def _run(self) -> None:
        items = self._items
        while True:
            self._wake.wait(DRAIN_S)
            self._wake.clear()
            stopping = self._stop
            done = 0
            while items:
                item = items.popleft()
                done += 1
                try:
                    if isinstance(item, Packet):
                        self._packet(item)
                    elif item[0] == "meta":
                        self._meta(item[1])
                    elif item[0] == "loss":
                        self._loss(item[1], float(item[2]))
                    elif item[0] == "struct":
                        self._struct(item[1])
                except Exception as exc:  # noqa: BLE001 - reported; the monitor's bug never reaches training
                    report_internal_error("monitor worker", exc)
            if self._queued:
                self._write_queued()
            if done:
                with self._cond:
                    self._counts.done += done
                    self._cond.notify_all()
            if stopping:
                return

    def _meta(self, meta: dict[str, Any]) -> None:
        if self.folder is None:
            return
        body = {"schema_version": SCHEMA_VERSION, "format": "obs-monitor", **meta}
        path = os.path.join(self.folder, META)
        safe_files.write_atomic(path, json.dumps(body, indent=1), fsync=False)
        wrote("monitor output", self.folder)

    def _struct(self, struct: dict[str, Any]) -> None:
        """msprobe's ``print_struct``: every module's inputs and outputs, once (training goes on)."""
        if self.folder is not None:
            safe_files.write_atomic(os.path.join(self.folder, "module_struct.json"), json.dumps(struct, indent=2),
                                    fsync=False)

    def _keeping(self) -> bool:
        self._keep = keep = any(getattr(sink, "wants_values", _always)() for sink in self.sinks)
        return keep

    def _loss(self, step: int, value: float) -> None:
        """A loss given through ``obs.scalar("loss", ...)``: from then on it replaces backward()'s value."""
        keep = self._keeping()
        self._loss_from_scalar = True
        key = ("scalars", "loss", None, "value")
        if keep:
            self._step_values.append((*key, value))
        verdict = self.detector.judge(key, value, "value")
        found = [] if verdict is None else [Anomaly(step, *key, value, verdict.baseline, verdict.rule, verdict.score)]
        if self.folder is not None:
            self._queue("scalars", step, _SCALARS_HEADER, f"0,loss,{step},{value:.{self.ndigits}g}\n")
        self._report(step, found)
        self._to_sinks(step, found)

    def _packet(self, packet: Packet) -> None:
        keep = self._keeping()
        values: list[float] = []
        for part in packet.values:  # tensors (one host read each, here, off the training thread) or numbers
            got = part.tolist() if hasattr(part, "tolist") else part
            values.extend(got if isinstance(got, list) else [got])
        key = layout_key(packet.blocks, self._loss_from_scalar)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= _PLANS:  # layouts that come and go (activations of varying calls): the newest
                self._plans.clear()
            plan = self._plans[key] = StepPlan(packet.blocks, self._loss_from_scalar, self.ndigits, self.detector)
        step, written = packet.step, plan.values(values)
        judged = written if plan.all_judged else [written[i] for i in plan.judged]
        found = []
        for at, verdict in self.detector.judge_many(plan.indices, judged, plan.stats):
            prefix, name, micro, stat = plan.keys[plan.judged[at]]
            found.append(Anomaly(step, prefix, name, micro, stat, judged[at], verdict.baseline, verdict.rule,
                                 verdict.score))
        if keep:
            self._step_values = [(*k, v) for k, v in zip(plan.keys, written)]
        if self.folder is not None:
            for prefix, header, text in plan.lines(step, written):
                self._queue(prefix, step, header, text)
        self._report(step, found)
        self._to_sinks(step, found)
        if self.on_step is not None:
            self.on_step(step, packet.t)

    def _to_sinks(self, step: int, found: list[Anomaly]) -> None:
        values, self._step_values = self._step_values, []
        for sink in self.sinks:
            try:
                sink(StepValues(step, values, found))
            except Exception as exc:  # noqa: BLE001 - reported; one output's bug never stops the others
                report_internal_error(f"monitor sink {getattr(sink, '__name__', type(sink).__name__)}", exc)

    def _queue(self, prefix: str, step: int, header: list[str], text: str) -> None:
        """Rows for ``prefix``'s file of ``step``: written with the rest of the drain's (:meth:`_write_queued`)."""
        start = step - step % self.per_file
        queued = self._queued.get(prefix)
        if queued is not None and queued[0] != start:  # the next file of the series: this one's rows first
            self._write(prefix, *queued)
            queued = None
        if queued is None:
            self._queued[prefix] = (start, header, [text])
        else:
            queued[2].append(text)

    def _write_queued(self) -> None:
        """One write per file for everything the drain queued."""
        queued, self._queued = self._queued, {}
        for prefix, (start, header, texts) in queued.items():
            try:
                self._write(prefix, start, header, texts)
            except OSError as exc:  # reported; the other files and the next drain go on
                report_internal_error(f"monitor CSV {prefix}", exc)

    def _write(self, prefix: str, start: int, header: list[str], texts: list[str]) -> None:
        assert self.folder is not None
        have = self._files.get(prefix)
        if have is None or have[0] != start:
            if have is not None:
                os.close(have[1])
                del self._files[prefix]
            path = os.path.join(self.folder, f"{prefix}_{start}-{start + self.per_file - 1}.csv")
            if os.path.lexists(path):
                fd = safe_files.open_append(path, what="monitor CSV file")
            else:
                fd = safe_files.create_file(path, append=True, folder_ready=True)
                os.write(fd, (",".join(header) + "\n").encode())
            have = self._files[prefix] = (start, fd)
        os.write(have[1], "".join(texts).encode())

    def _report(self, step: int, found: list[Anomaly]) -> None:
        if not found:
            return
        with self._cond:
            self._counts.anomalies.extend(found)
        stream = self.stream if self.stream is not None else sys.stderr
        lines = []
        for a in found[:LINES_PER_STEP]:
            kind = PREFIXES.get(a.prefix, ("", ""))[0] or ("loss" if a.name == "loss" else "wg")
            if self.on_anomaly is not None:
                self.on_anomaly(a, kind)
            where = a.name if a.micro is None else f"{a.name} (call {a.micro})"
            lines.append(f"obs: monitor: step {step}: {kind} {where} {a.prefix}/{a.stat} = {a.value:.4g}, baseline "
                         f"{a.baseline:.4g} ({a.rule}, score {a.score:.3g})\n")
        if len(found) > LINES_PER_STEP:
            lines.append(f"obs: monitor: step {step}: {len(found) - LINES_PER_STEP} more anomalies (obs monitor "
                         "explain)\n")
        try:
            stream.write("".join(lines))
            stream.flush()
        except (OSError, ValueError):  # stderr closed: the files still hold everything
            pass
