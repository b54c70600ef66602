"""Follow a ring file as its writer fills it: new slots in seq order, gathered into finished steps.

:class:`RingFollower` maps the file read-only and returns, per :meth:`poll`, the slots it had not
returned before.  A slot is returned once it is settled: its seq was already visible at the previous
poll (the writer finished it long since), or the writer is gone (``final=True``); each ring's slots in idx order,
without a hole (:meth:`RingFollower._run`).  Slots overwritten before they were read are counted in :attr:`lost`
(per ring): the exporter fell further behind than the ring holds.

:class:`StepAssembler` turns slots into :class:`exporters.spans.StepRecord` objects: a step is
finished when the next one begins, when nothing was written for ``settle_ns`` after its end, or at
the final drain (a trainer that died mid-step gives an incomplete last step).  A step the trainer timed
on the device then waits (bounded) for its device times (:mod:`exporters.device_join`).
"""

from __future__ import annotations

import mmap
import os
import struct
from typing import Any

import numpy as np

from exporters.device_join import DeviceJoin
from exporters.spans import ModuleCall, OpCall, Phase, StepRecord
from obs._core import safe_files
from recorder.layout import PHASE_NAMES, STEP_TIMED, STRINGS_USED_AT, Header, Kind
from recorder.ring_reader import SLOT_DTYPE, read_blobs, read_strings

__all__ = ["PHASE_NAMES", "RingFollower", "StepAssembler"]
_U64 = struct.Struct("<Q")
_HOLE_POLLS = 10  # a missing slot whose place still holds an older one is waited for this many polls (1 s)


class RingFollower:
    """Reads ``path`` (a ring being written by another process) incrementally."""

    def __init__(self, path: str) -> None:
        fd = safe_files.open_private(path)
        try:
            size = os.fstat(fd).st_size
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        self.path = path
        self.header = Header.decode(self._mm, path=path)
        self.strings: list[str] = []
        self._strings_at = 0
        self._last_idx = {r.name: 0 for r in self.header.rings}
        self._settled_seq = 0
        self._last_seq = {r.name: 0 for r in self.header.rings}  # seq of the last slot returned, per ring
        self._hole: dict[str, tuple[int, int]] = {}  # per ring: the missing idx waited for, and for how many polls
        self._last_blob = 0
        self.lost = {r.name: 0 for r in self.header.rings}
        self.markers: list[dict[str, Any]] = []  #: marker blobs read so far (the trainer's identity, once known)

    def wall(self, t: Any) -> Any:
        return t + (self.header.wall_ns - self.header.mono_ns)

    def _read_strings(self) -> None:
        used = _U64.unpack_from(self._mm, STRINGS_USED_AT)[0]  # the live count, not the header's at open
        new, self._strings_at = read_strings(self._mm, self.header, start=self._strings_at, used=used)
        self.strings += new

    def string(self, sid: int) -> str:
        return self.strings[sid] if 0 <= sid < len(self.strings) else "?"

    def _read_markers(self) -> None:
        """Marker blobs not read before (a blob's seq is written last: 0 while it is being written)."""
        for idx, _, _, kind, payload in read_blobs(self._mm, self.header):
            if idx > self._last_blob and kind == Kind.MARKER and isinstance(payload, dict):
                self.markers.append(payload)
                self._last_blob = idx

    def poll(self, *, final: bool = False) -> np.ndarray:
        """The settled slots not returned before, sorted by seq (``final``: every written slot)."""
        self._read_strings()
        self._read_markers()
        parts, top = [], self._settled_seq
        for region in self.header.rings:
            # The live slots, not a copy: a copy of every ring per poll is 17 MiB allocated and freed 10 times a
            # second, which leaves the exporter's heap in pieces.  Only the new slots are copied (``slots[where]``).
            slots = np.frombuffer(self._mm, SLOT_DTYPE, region.capacity, region.offset)
            where = np.nonzero(slots["idx"] > np.uint64(self._last_idx[region.name]))[0]
            if not len(where):
                continue
            new = slots[where]
            top = max(top, int(new["seq"].max()))
            # A slot sits at (idx - 1) % capacity; anything else is torn or damaged: skipped.
            new = new[(new["seq"] > 0) & ((new["idx"] - np.uint64(1)) % np.uint64(region.capacity)
                                          == where.astype(np.uint64))]
            ready = new if final else new[new["seq"] <= np.uint64(self._settled_seq)]
            ready = self._run(region, slots, ready[np.argsort(ready["idx"], kind="stable")], final)
            if len(ready):
                parts.append(ready)
        self._settled_seq = top
        if not parts:
            return np.empty(0, SLOT_DTYPE)
        merged = np.concatenate(parts)
        return merged[np.argsort(merged["seq"], kind="stable")]

    def _run(self, region: Any, slots: np.ndarray, ready: np.ndarray, final: bool) -> np.ndarray:
        """Of one ring's settled slots (sorted by idx), those that follow the last one returned, each once.

        The run stops at a missing idx, and at a slot whose seq is a ring older than the slot before it: the slot
        being written, read as its new idx with the seq of the slot it replaces (the writer packs field by field,
        and a copy of the region need not read a slot's bytes in order).  Returning the slots after it would skip
        it, and the unsettled slots before it, for good.  What stops the run is waited for; it is lost (counted in
        :attr:`lost`, with the idx after it up to the next slot returned) once its place holds a later slot
        (overwritten: the exporter fell a ring behind), after ``_HOLE_POLLS`` polls, or at the final poll."""
        name = region.name
        if not len(ready):
            return ready
        idx, seq = ready["idx"].astype(np.int64), ready["seq"].astype(np.int64)
        prev_idx = np.concatenate(([self._last_idx[name]], idx[:-1]))
        prev_seq = np.concatenate(([self._last_seq[name]], seq[:-1]))
        # Another writer thread can put a slot's seq a little below its predecessor's; a ring's worth is a stale one.
        breaks = np.nonzero((idx != prev_idx + 1) | (seq <= prev_seq - (region.capacity - 1)))[0]
        for at in breaks.tolist():
            missing = int(prev_idx[at]) + 1
            if not final and int(slots["idx"][(missing - 1) % region.capacity]) <= missing:
                hole, polls = self._hole.get(name, (0, 0))
                polls = polls + 1 if hole == missing else 1
                self._hole[name] = (missing, polls)
                if polls < _HOLE_POLLS:
                    ready = ready[:at]
                    break
            self.lost[name] += int(idx[at]) - missing
        if len(ready):
            self._last_idx[name] = int(ready["idx"][-1])
            self._last_seq[name] = int(ready["seq"][-1])
        return ready

    def close(self) -> None:
        self._mm.close()


class StepAssembler:
    """Slots in, finished :class:`StepRecord` objects out (wall-clock ns)."""

    def __init__(self, follower: RingFollower, *, settle_ns: int = 300_000_000, device_wait_ns: int = 2_000_000_000,
                 kernel_wait_ns: int = 10_000_000_000) -> None:
        self.f = follower
        self.settle_ns = settle_ns
        self.current: StepRecord | None = None
        self.ended = False
        self._open: list[tuple[int, int, int]] = []  # module enters: (scope id, t, seq)
        self.last_t = 0
        #: device times joined to the steps they time (steps timed on the device wait for them here)
        self.device = DeviceJoin(follower.string, wait_ns=device_wait_ns, kernel_wait_ns=kernel_wait_ns)

    def feed(self, slots: np.ndarray) -> list[StepRecord]:
        """Steps finished by these slots."""
        done: list[StepRecord] = []
        if not len(slots):
            return done
        wall = self.f.wall(slots["t"].astype(np.int64))
        kinds, a, b, c, d, flags, seqs = (slots[k].tolist() for k in ("kind", "a", "b", "c", "d", "flags", "seq"))
        offset = self.f.header.wall_ns - self.f.header.mono_ns
        for kind, ai, bi, ci, di, fl, t, seq in zip(kinds, a, b, c, d, flags, wall.tolist(), seqs):
            self.last_t = t
            if kind == Kind.STEP_BEGIN:
                if self.current is not None:
                    done += self._finish(complete=self.ended)
                self.current, self.ended = StepRecord(bi, t, t, timed=bool(fl & STEP_TIMED)), False
                self._open = []
            elif kind == Kind.DEVICE_TIME:  # comes after its step (may be finished by now): joined by seq or step
                self.device.device(fl, ai, bi, ci, di)
            elif kind == Kind.MEMORY_PEAK:
                self.device.memory(self.f.string(ai), bi, ci, di)
            elif self.current is None:
                continue  # before the first step began (or between a lost begin and the next)
            elif kind == Kind.STEP_END:
                self.current.end_ns, self.ended = t, True
            elif kind == Kind.PHASE:
                name = PHASE_NAMES[ai] if 0 <= ai < len(PHASE_NAMES) else f"phase_{ai}"
                self.current.phases.append(Phase(name, ci + offset, di + offset, seq))
            elif kind == Kind.MODULE_ENTER:
                self._open.append((ai, t, seq))
            elif kind == Kind.MODULE_EXIT:
                for i in range(len(self._open) - 1, -1, -1):
                    if self._open[i][0] == ai:
                        _, began, entered = self._open.pop(i)
                        self.current.modules.append(ModuleCall(self.f.string(ai), began, t, bool(fl & 1), i + 1,
                                                               entered))
                        break
            elif kind == Kind.OP:
                self.current.ops.append(OpCall(self.f.string(ai), self.f.string(bi), t - ci, t, bool(fl & 1)))
        return done + self.device.release(self.last_t)  # device times just read may let held steps go

    def idle(self, now_wall_ns: int) -> list[StepRecord]:
        """A step that ended and was followed by nothing for ``settle_ns``: finished."""
        if self.current is not None and self.ended and now_wall_ns - self.last_t >= self.settle_ns:
            return self._finish(complete=True, now_ns=now_wall_ns)
        return self.device.release(now_wall_ns)

    def drain(self) -> list[StepRecord]:
        """The writer is gone: whatever step is open is finished (incomplete if it never ended), and every step
        waiting for device times goes with what it has."""
        done = self._finish(complete=self.ended) if self.current is not None else []
        return done + self.device.release(self.last_t, final=True)

    def _finish(self, *, complete: bool, now_ns: int | None = None) -> list[StepRecord]:
        """The current step is finished: it and every step before it that may go now (see ``device``)."""
        record, self.current = self.current, None
        assert record is not None
        if not complete:
            record.complete = False
            record.end_ns = max([record.end_ns, self.last_t] + [p.end_ns for p in record.phases])
        self.ended = False
        return self.device.finish(record, self.last_t if now_ns is None else now_ns)
