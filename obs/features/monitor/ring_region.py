"""The monitor's region of the RDR ring: every judged step's values and anomalies, so that every bundle (a crash, a
hang, a snapshot, a ring recovered after SIGKILL) carries the run's recent health.

A sink of the worker (:class:`obs.features.monitor.writer.StepValues`), on the ``obs-monitor`` thread, never on the
training thread.  While the recorder runs with the ``monitor`` rings laid out (the RDR lays them out while the
``monitor`` section is on: :func:`obs.settings.monitor_options.ring_capacity`), each value is one slot of the
``monitor`` ring and each anomaly one slot of ``monitor_anomaly`` (:mod:`recorder.monitor_part` gives the layout and
reads them back).  The slots are written into the ring's shared
map as the recorder's own are, so a process killed the next instant leaves them in the file.
"""

from __future__ import annotations

import math
import struct
import time
from typing import Any

import numpy as np

from recorder.layout import MONITOR_SLOT, Kind
from recorder.monitor_part import SEP, series_key
from recorder.ring_reader import SLOT_DTYPE

__all__ = ["RingRegion"]

_HALF = struct.Struct("<e")
_U16 = struct.Struct("<H")
_U64 = struct.Struct("<Q")

def _half(score: float) -> int:
    """The score as float16 bits (3 significant digits; above 65504 it reads as infinity)."""
    try:
        packed = _HALF.pack(score if math.isnan(score) or abs(score) <= 65504.0 else math.copysign(math.inf, score))
    except (OverflowError, struct.error):
        packed = _HALF.pack(math.inf)
    value: int = _U16.unpack(packed)[0]
    return value


class RingRegion:
    """The sink: writes each step's values and anomalies into the live recorder's ring (bound again whenever the
    recorder restarts on a new ring)."""

    def __init__(self, steps: int, recorder: Any = None) -> None:
        self.steps = steps
        self._recorder = recorder  # a callable giving the live recorder (tests); default: the RDR feature's
        self._ring: Any = None
        self._values: Any = None
        self._next = 0  # slots of the monitor ring written, and of monitor_anomaly
        self._flagged = 0
        self._anomalies: Any = None
        self._ids: dict[Any, int] = {}

    def _live_ring(self) -> Any:
        if self._recorder is None:
            from obs.features.rdr.feature import recorder

            self._recorder = recorder
        live = self._recorder()
        ring = getattr(live, "ring", None)
        if ring is None or ring.closed:
            return None
        if ring is not self._ring:
            # This sink is the rings' only writer: it numbers their slots itself and writes a step's at once.  What an
            # earlier monitor run of the process left there (a hot reload restarted the monitor, not the recorder)
            # is wiped: a bundle holds the run in force, whose steps count from 0 again.
            self._ring, self._ids, self._next, self._flagged = ring, {}, 0, 0
            self._values = ring.rings.get("monitor")
            self._anomalies = ring.rings.get("monitor_anomaly")
            for region in (self._values, self._anomalies):
                if region is not None and _U64.unpack_from(ring.buffer(), region.offset)[0]:
                    ring.buffer()[region.offset:region.offset + region.capacity * SLOT_DTYPE.itemsize] = \
                        bytes(region.capacity * SLOT_DTYPE.itemsize)
        return ring

    def wants_values(self) -> bool:
        """The step's values only while a recorder runs with the ``monitor`` ring laid out."""
        return self._live_ring() is not None and self._values is not None

    def __call__(self, step_values: Any) -> None:
        ring = self._live_ring()
        if ring is None:
            return
        try:
            self._write(ring, step_values)
        except (ValueError, BufferError, TypeError, AssertionError):  # the ring closed under us (recorder stopped)
            if not ring.closed:
                raise

    def _id(self, ring: Any, key: Any, text: str) -> int:
        sid = self._ids.get(key)
        if sid is None:
            sid = self._ids[key] = ring.intern(text)  # -1 when the string table is full: the reader skips it
        return sid

    def _write(self, ring: Any, step_values: Any) -> None:
        step, values = step_values.step, step_values.values
        if self._values is not None and values:
            base, cap = self._values.offset, self._values.capacity
            get = self._ids.get
            sids = [get(v[:4]) for v in values]
            if None in sids:
                sids = [self._id(ring, v[:4], series_key(*v[:4])) if sid is None else sid
                        for sid, v in zip(sids, values)]
            n, first = len(values), self._next
            self._next = first + n
            rows = np.empty(n, SLOT_DTYPE)
            rows["seq"] = next(ring.seq)  # one draw for the step: these slots are not events, they are not ordered
            rows["idx"] = np.arange(first + 1, first + n + 1)
            rows["t"] = time.perf_counter_ns()
            rows["kind"] = int(Kind.MONITOR_VALUE)
            rows["flags"] = 0
            rows["a"] = sids
            rows["b"] = step
            rows["c"] = self.steps
            rows["d"] = np.array([v[4] for v in values], dtype="<f8").view("<i8")
            if n > cap:
                rows, first = rows[n - cap:], first + n - cap
            # Slice assignments into the map (a copy under the GIL, as the recorder's own pack_into): no view of
            # the map outlives the call, so the recorder can always close it.
            data, at, size = rows.tobytes(), first % cap, SLOT_DTYPE.itemsize
            mm = ring.buffer()
            head = min(len(rows), cap - at) * size
            mm[base + at * size:base + at * size + head] = data[:head]
            if head < len(data):
                mm[base:base + len(data) - head] = data[head:]
        region = self._anomalies
        if region is not None and step_values.anomalies:
            mm, base, cap, size = ring.buffer(), region.offset, region.capacity, SLOT_DTYPE.itemsize
            now, number, kind = time.perf_counter_ns(), next(ring.seq), int(Kind.MONITOR_ANOMALY)
            for a in step_values.anomalies:
                key = (a.prefix, a.name, a.micro, a.stat, a.rule)
                sid = self._id(ring, key, series_key(a.prefix, a.name, a.micro, a.stat) + SEP + a.rule)
                idx, self._flagged = self._flagged, self._flagged + 1
                MONITOR_SLOT.pack_into(mm, base + (idx % cap) * size, number, idx + 1, now, kind,
                                       _half(float(a.score)), sid, step, float(a.baseline), float(a.value))
