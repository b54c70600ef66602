"""The metrics' values, from the profiler's ring: what each finished step took, and the latest readings.

Pure (no OpenTelemetry): :class:`MetricState` is fed the slots :class:`exporters.follow.RingFollower` returns
(scalars, memory readings, collectives) and the steps :class:`exporters.follow.StepAssembler` finished; it
hands back one :class:`StepValues` per finished step (what histograms record) and keeps the latest value of
each gauge (throughput over the last steps, memory, each scalar).

- A step's duration runs from its data phase's begin (the wait for its batch, as its span does) to its end.
- A collective's time counts to the step it finished in (after that step's begin, before the next one's).
- Throughput is over the last ``window`` finished steps: their count over the time from the first one's
  begin to the last one's end (the time between steps included).
- Memory: the bytes in use at the last step end, and the highest peak read so far, per device.
- The training-health monitor's scalars (names starting ``obs.monitor.``) are not ``obs.scalar`` gauges: the last
  global gradient norm, the last largest update ratio and its parameter, the anomaly counts per kind.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from exporters.spans import StepRecord
from recorder.layout import Kind

__all__ = ["MONITOR", "MetricState", "StepValues"]

MONITOR = "obs.monitor."  #: the training-health monitor's scalar names start so; served as metrics of their own

_KINDS = np.array([Kind.STEP_BEGIN, Kind.SCALAR, Kind.MEMORY, Kind.COLLECTIVE], dtype=np.uint16)


@dataclass(frozen=True)
class StepValues:
    """One finished step, in seconds; ``duration_s`` None for a step the trainer died in."""

    step: int
    duration_s: float | None
    phases: dict[str, float] = field(default_factory=dict)  #: per phase name, summed (gradient accumulation)
    collectives_s: float = 0.0


class MetricState:
    """Slots and finished steps in; per-step values and the gauges' latest values out.

    ``name(sid)`` turns an interned string id into its text (the follower's :meth:`string`).  The gauge
    getters may be called from another thread (a metric reader's) while the exporter feeds.
    """

    def __init__(self, name: Callable[[int], str], *, batch_size: int = 0, tokens_per_step: int = 0,
                 window: int = 20) -> None:
        self._name = name
        self.batch_size, self.tokens_per_step = batch_size, tokens_per_step
        self._lock = threading.Lock()
        self._step = 0  # the step the slots being fed belong to (the last STEP_BEGIN seen)
        self._collectives: dict[int, int] = {}  # step → ns spent in finished collectives
        self._scalars: dict[str, float] = {}
        self._memory: dict[str, tuple[int, int]] = {}  # device → (bytes in use, peak bytes)
        self._window: deque[tuple[int, int]] = deque(maxlen=max(1, window))  # (begin ns, end ns) of steps
        self.scalar_count = 0  #: SCALAR slots read
        self._last: tuple[int, int] | None = None  # (step, wall ns of its end) of the last finished step
        self._grad_norm: float | None = None  # the training-health monitor's values (its reserved scalar names)
        self._ratio_max: tuple[str, float] | None = None
        self._anomalies: dict[str, float] = {}

    # -- in ------------------------------------------------------------------------------------
    def feed(self, slots: np.ndarray) -> None:
        """Read the scalar, memory and collective slots of ``slots`` (sorted by seq)."""
        if not len(slots):
            return
        chosen = slots[np.isin(slots["kind"], _KINDS)]
        if not len(chosen):
            return
        values = chosen["d"].astype(np.int64).view(np.float64).tolist()  # a SCALAR's d is a float64
        rows = zip(chosen["kind"].tolist(), chosen["a"].tolist(), chosen["b"].tolist(), chosen["c"].tolist(),
                   chosen["d"].tolist(), values)
        with self._lock:
            for kind, a, b, c, d, value in rows:
                if kind == Kind.STEP_BEGIN:
                    self._step = b
                elif kind == Kind.SCALAR:
                    name = self._name(a)
                    if name.startswith(MONITOR):
                        self._monitor_value(name, value)
                    else:
                        self._scalars[name] = value
                    self.scalar_count += 1
                elif kind == Kind.MEMORY:
                    device = self._name(a)
                    peak = max(d, c, self._memory.get(device, (0, 0))[1])
                    self._memory[device] = (c, peak)
                else:  # a finished collective: c is its duration
                    self._collectives[self._step] = self._collectives.get(self._step, 0) + max(0, c)

    def finish(self, records: Iterable[StepRecord]) -> list[StepValues]:
        """The values of each finished step (feed the slots that finished them first)."""
        out = []
        with self._lock:
            for record in records:
                phases: dict[str, float] = {}
                for phase in record.phases:
                    phases[phase.name] = phases.get(phase.name, 0.0) + max(0, phase.end_ns - phase.start_ns) / 1e9
                spent = self._collectives.pop(record.step, 0)
                for old in [s for s in self._collectives if s < record.step]:
                    del self._collectives[old]  # late slots of steps already finished
                duration = None
                if record.complete:
                    start = min([record.start_ns] + [p.start_ns for p in record.phases if p.name == "data"])
                    duration = max(0, record.end_ns - start) / 1e9
                    self._window.append((record.start_ns, record.end_ns))
                    self._last = (record.step, record.end_ns)
                out.append(StepValues(record.step, duration, phases, spent / 1e9))
        return out

    def _monitor_value(self, name: str, value: float) -> None:
        """One of the monitor's scalars (obs.features.monitor.metrics): ``obs.monitor.grad_norm``,
        ``obs.monitor.update_ratio.max|{parameter}``, ``obs.monitor.anomalies|{kind}`` (a count so far)."""
        base, _, label = name.partition("|")
        if base == "obs.monitor.grad_norm":
            self._grad_norm = value
        elif base == "obs.monitor.update_ratio.max" and label:
            self._ratio_max = (label, value)
        elif base == "obs.monitor.anomalies" and label:
            self._anomalies[label] = max(value, self._anomalies.get(label, 0.0))

    # -- the gauges' latest values ------------------------------------------------------------------
    def steps_per_s(self) -> float | None:
        """Finished steps per second over the last window (None before the first step)."""
        with self._lock:
            if not self._window:
                return None
            span = self._window[-1][1] - self._window[0][0]
            return len(self._window) * 1e9 / span if span > 0 else None

    def last_step(self) -> tuple[int, float] | None:
        """The last finished step and when it ended (Unix seconds); None before the first."""
        with self._lock:
            return None if self._last is None else (self._last[0], self._last[1] / 1e9)

    def samples_per_s(self) -> float | None:
        rate = self.steps_per_s()
        return rate * self.batch_size if rate is not None and self.batch_size else None

    def tokens_per_s(self) -> float | None:
        rate = self.steps_per_s()
        return rate * self.tokens_per_step if rate is not None and self.tokens_per_step else None

    def scalars(self) -> dict[str, float]:
        with self._lock:
            return dict(self._scalars)

    def monitor(self) -> tuple[float | None, tuple[str, float] | None, dict[str, float]]:
        """The monitor's last global gradient norm, its last largest update ratio (parameter, value), and its anomaly
        counts per kind."""
        with self._lock:
            return self._grad_norm, self._ratio_max, dict(self._anomalies)

    def memory(self) -> dict[str, tuple[int, int]]:
        """Per device: (bytes in use at the last reading, the highest peak so far)."""
        with self._lock:
            return dict(self._memory)
