"""Device times to the steps they belong to: DEVICE_TIME and MEMORY_PEAK slots joined to finished steps.

The trainer writes a step's DEVICE_TIME slots once the device has run it, after the step's own slots, so a step
the trainer timed on the device (STEP_BEGIN flag ``STEP_TIMED``) is held here once finished, in order, until
its STEP record has come (the trainer writes it after every other record of the step), or, where the step is in a
kernel capture, until that capture's KERNELS_END has come too.  A step is let go without them (``device_missing``)
once it has waited ``wait_ns`` (``kernel_wait_ns`` in a capture) after it finished, when more than ``max_held`` steps
wait, and at the final drain; device slots that come later are counted in :attr:`DeviceJoin.late`.

Where the device ran a step: the device measures times between its own events only, so each step is placed at
``G(k) = max(host time of step k's begin, G(k-1) + device time from step k-1's reference to step k's)``: its reference
event ran after the host recorded it, and exactly that long after the previous one.  ``G(k)`` is the earliest time
consistent with both; it is the true time when the device was idle as the step began (it waited for the host) and
earlier than the truth by the device's backlog otherwise.  Every span of the step is placed at ``G(k)`` plus its
start's device time after the reference; kernels at the times CUPTI gave them.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable

from exporters.spans import DeviceCall, DeviceTime, StepRecord
from recorder.layout import DeviceTarget

__all__ = ["DeviceJoin"]

_STEP, _PHASE, _MODULE = DeviceTarget.STEP, DeviceTarget.PHASE, DeviceTarget.MODULE
_COLLECTIVE, _KERNEL = DeviceTarget.COLLECTIVE, DeviceTarget.KERNEL
_BEGIN, _END = DeviceTarget.KERNELS_BEGIN, DeviceTarget.KERNELS_END


class DeviceJoin:
    """Device slots in (:meth:`device`, :meth:`memory`); finished steps in (:meth:`finish`) and out, in order, with
    their device times (:meth:`release`).  ``name(sid)`` turns a string id into its text."""

    def __init__(self, name: Callable[[int], str], *, wait_ns: int = 2_000_000_000,
                 kernel_wait_ns: int = 10_000_000_000, max_held: int = 64) -> None:
        self._name = name
        self.wait_ns, self.kernel_wait_ns, self.max_held = wait_ns, kernel_wait_ns, max_held
        self._by_seq: dict[int, tuple[int, int]] = {}  # a phase's or module's begin seq → (after ref, duration)
        self._steps: dict[int, tuple[int, int, int]] = {}  # step → (after the previous ref, duration, skipped)
        self._calls: dict[int, list[tuple[str, str, int, int, bool]]] = {}  # step → (name, kind, start, dur, wall)
        self._memory: dict[int, dict[str, object]] = {}
        self._kernels_from: int | None = None  # the first step of the last kernel capture begun
        self._kernels_done = -1  # the last step of the last kernel capture ended
        self._held: deque[tuple[StepRecord, int]] = deque()  # (record, when it finished)
        self._anchor: tuple[int, int] | None = None  # (step, G) of the last step let go
        self._released = 0  # the last step let go
        self._released_seq = 0  # the highest begin seq of a phase or module of a step let go
        self.late = 0  #: device slots that came after their step was let go

    # -- slots in ------------------------------------------------------------------------------------------------
    def device(self, target: int, a: int, b: int, c: int, d: int) -> None:
        """One DEVICE_TIME slot (``target`` its flags)."""
        if target in (_PHASE, _MODULE):
            if b <= self._released_seq:
                self.late += 1
            else:
                self._by_seq[b] = (c, d)
        elif target == _BEGIN:
            self._kernels_from = b
        elif target == _END:
            self._kernels_done = max(self._kernels_done, b)
        elif b <= self._released:
            self.late += 1
        elif target == _STEP:
            self._steps[b] = (c, d, a)
        elif target in (_COLLECTIVE, _KERNEL) and d >= 0:
            self._calls.setdefault(b, []).append((self._name(a), "collective" if target == _COLLECTIVE else "kernel",
                                                  c, d, target == _KERNEL))

    def memory(self, device: str, step: int, allocated: int, reserved: int) -> None:
        """One MEMORY_PEAK slot."""
        if step > self._released:
            self._memory[step] = {"device": device, "peak_allocated_bytes": allocated,
                                  "peak_reserved_bytes": reserved}

    # -- steps through ---------------------------------------------------------------------------------------------
    def finish(self, record: StepRecord, now_ns: int) -> list[StepRecord]:
        """A finished step: held if it waits for device times, then every step that may go, in order."""
        self._held.append((record, now_ns))
        return self.release(now_ns)

    def release(self, now_ns: int, *, final: bool = False) -> list[StepRecord]:
        """The held steps that may go now (all of them when ``final``), in order, their device times joined."""
        out = []
        while self._held:
            record, since = self._held[0]
            if record.timed and not final and len(self._held) <= self.max_held:
                awaiting = self._awaits_kernels(record.step)
                ready = record.step in self._steps and not awaiting
                if not ready and now_ns - since < (self.kernel_wait_ns if awaiting else self.wait_ns):
                    break
            self._held.popleft()
            out.append(self._join(record) if record.timed else record)
        return out

    @property
    def held(self) -> int:
        return len(self._held)

    def _awaits_kernels(self, step: int) -> bool:
        begun = self._kernels_from
        return begun is not None and begun <= step and self._kernels_done < begun

    def _join(self, record: StepRecord) -> StepRecord:
        k = record.step
        came = k in self._steps
        chain, duration, skipped = self._steps.pop(k, (-1, -1, 0))
        anchor = record.start_ns
        if self._anchor is not None and self._anchor[0] == k - 1 and chain >= 0:
            anchor = max(anchor, self._anchor[1] + chain)
        self._anchor = (k, anchor)

        def place(seq: int) -> DeviceTime | None:
            after, length = self._by_seq.pop(seq, (-1, -1))
            return DeviceTime(anchor + after, length) if after >= 0 and length >= 0 else None

        phases = [dataclasses.replace(p, device=place(p.seq)) for p in record.phases]
        modules = [dataclasses.replace(m, device=place(m.seq)) for m in record.modules]
        calls = [DeviceCall(name, kind, start if wall else anchor + start, (start if wall else anchor + start) + length)
                 for name, kind, start, length, wall in self._calls.pop(k, []) if wall or start >= 0]
        joined = dataclasses.replace(
            record, phases=phases, modules=modules, calls=calls, memory=self._memory.pop(k, {}),
            device=DeviceTime(anchor, duration) if duration >= 0 else None, device_skipped=skipped,
            device_missing=not came)
        self._released = max(self._released, k)
        seqs = [p.seq for p in record.phases] + [m.seq for m in record.modules]
        if seqs:
            self._released_seq = max(self._released_seq, max(seqs))
        self._forget()
        return joined

    def _forget(self) -> None:
        """Drop what belongs to steps let go (a span aggregated away, a late slot's siblings)."""
        done, seq = self._released, self._released_seq
        for table in (self._steps, self._calls, self._memory):
            for step in [s for s in table if s <= done]:
                del table[step]
        for key in [s for s in self._by_seq if s <= seq]:
            del self._by_seq[key]
