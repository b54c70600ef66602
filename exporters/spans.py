"""Spans of one training step, built from its recorded timings: step → phases → modules → ops, within a budget.

Pure: a :class:`StepRecord` (wall-clock ns) in, :class:`Span` dataclasses out, parents before children.

- One trace per step: the trace id is derived from the run id and the step, so every rank's spans of a
  step share it; span ids from run id, rank, step and position (a re-export sends the same ids).
- ``step`` (``ml.step``, ``ml.rank``, ``ml.world_size``, ``ml.run_id``) holds ``data``, ``forward``
  (consecutive root calls merged), ``backward`` and ``optimizer``.
- task_trace: module spans down to ``module_depth``; op_trace: the most expensive ops as spans.
- At most ``budget`` spans: phases first (in order), then collectives, kernels (what modules and ops
  leave, a third of the room at least), shallow modules, then the longest; what does not fit is
  aggregated into the attributes of the span that holds it (``ml.phases.*`` on the step,
  ``obs.aggregated.*``, ``ml.ops.*``, ``obs.kernels.*``), never dropped silently.  The step span says
  how many were aggregated (``obs.spans.aggregated``).
- Device time (docs/profiling.md#device-time): a step, phase or module timed on the device has
  ``obs.device.time_ns`` and ``obs.device.start_ns``; the step also its memory peaks
  (``obs.memory.*``).  Collectives timed on the device and kernels (an op_trace window's) are spans of
  their own (kind ``collective``, ``kernel``) under the step, at their times on the device.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DeviceCall", "DeviceTime", "ModuleCall", "OpCall", "Phase", "Span", "StepRecord", "build_spans", "span_id",
           "trace_id"]

_OPS_SHOWN = 16  # distinct op names listed in a parent's aggregate attributes (the rest summed as "other")


@dataclass(frozen=True)
class DeviceTime:
    """A span's time on the device: from ``start_ns`` (wall-clock ns: where the device reached the span's first
    event, estimated as docs/profiling.md#device-time says) for ``duration_ns`` (measured by the device)."""

    start_ns: int
    duration_ns: int


@dataclass(frozen=True)
class Phase:
    """``seq``: its PHASE slot's (device times are keyed by it)."""

    name: str
    start_ns: int
    end_ns: int
    seq: int = 0
    device: DeviceTime | None = None


@dataclass(frozen=True)
class ModuleCall:
    """``depth``: 1 for a root call, 2 for a module its forward called, ...: calls, not scope levels (a
    ModuleList or ModuleDict that is never called adds no level).  ``seq``: its MODULE_ENTER slot's."""

    scope: str
    start_ns: int
    end_ns: int
    error: bool = False
    depth: int = 0
    seq: int = 0
    device: DeviceTime | None = None

    def __post_init__(self) -> None:
        if not self.depth:
            object.__setattr__(self, "depth", self.scope.count("/"))  # Default/net-Net is 1: a root module


@dataclass(frozen=True)
class OpCall:
    name: str
    scope: str
    start_ns: int
    end_ns: int
    error: bool = False


@dataclass(frozen=True)
class DeviceCall:
    """Something timed on the device only: a collective (``kind`` collective) or a kernel, memcpy or memset
    (``kind`` kernel), in wall-clock ns."""

    name: str
    kind: str
    start_ns: int
    end_ns: int


@dataclass
class StepRecord:
    """What the ring held for one step, in wall-clock ns; ``complete`` False when the trainer died in it.

    ``timed``: the trainer timed the step on the device; its device times (``device``, the phases' and modules',
    ``calls``) are joined in by :class:`exporters.device_join.DeviceJoin`, ``device_missing`` when they did not
    come in time.  ``memory``: the step's peaks (``device``, ``peak_allocated_bytes``, ``peak_reserved_bytes``)."""

    step: int
    start_ns: int
    end_ns: int
    phases: list[Phase] = field(default_factory=list)
    modules: list[ModuleCall] = field(default_factory=list)
    ops: list[OpCall] = field(default_factory=list)
    complete: bool = True
    timed: bool = False
    device: DeviceTime | None = None
    calls: list[DeviceCall] = field(default_factory=list)
    memory: dict[str, Any] = field(default_factory=dict)
    device_skipped: int = 0
    device_missing: bool = False


@dataclass
class Span:
    """One span with explicit times; ``kind`` is step, phase, module or op; ids are ints (128 / 64 bit)."""

    name: str
    kind: str
    trace_id: int
    span_id: int
    parent_id: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    error: bool = False

    @property
    def duration_ns(self) -> int:
        return max(0, self.end_ns - self.start_ns)


def trace_id(run_id: str, step: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{run_id}:{step}".encode(), digest_size=16).digest(), "big") or 1


def span_id(run_id: str, rank: int, step: int, index: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{run_id}:{rank}:{step}:{index}".encode(), digest_size=8).digest(),
                          "big") or 1


def _merge_forwards(phases: list[Phase]) -> list[Phase]:
    """Consecutive forward phases (the model, then a loss module) are one forward (on the device too)."""
    out: list[Phase] = []
    for phase in sorted(phases, key=lambda p: p.start_ns):
        if out and phase.name == "forward" and out[-1].name == "forward":
            first = out[-1]
            device = None
            if first.device is not None and phase.device is not None:
                end = max(first.device.start_ns + first.device.duration_ns,
                          phase.device.start_ns + phase.device.duration_ns)
                device = DeviceTime(first.device.start_ns, end - first.device.start_ns)
            out[-1] = Phase("forward", first.start_ns, max(first.end_ns, phase.end_ns), first.seq, device)
        else:
            out.append(phase)
    return out


def _device(device: DeviceTime | None) -> dict[str, Any]:
    """A span's device-time attributes (none where it was not timed)."""
    if device is None:
        return {}
    return {"obs.device.time_ns": device.duration_ns, "obs.device.start_ns": device.start_ns}


class _Builder:
    def __init__(self, record: StepRecord, run_id: str, rank: int, world_size: int) -> None:
        self.record, self.run_id, self.rank = record, run_id, rank
        self.trace = trace_id(run_id, record.step)
        self.spans: list[Span] = []
        self.world_size = world_size

    def add(self, name: str, kind: str, parent: Span | None, start: int, end: int, attributes: dict[str, Any],
            error: bool = False) -> Span:
        span = Span(name, kind, self.trace, span_id(self.run_id, self.rank, self.record.step, len(self.spans)),
                    parent.span_id if parent is not None else 0, start, max(start, end), attributes, error)
        self.spans.append(span)
        return span


def _holder(candidates: list[Span], start: int, end: int, fallback: Span) -> Span:
    """The innermost (latest-started, shortest) candidate span containing [start, end], else ``fallback``."""
    best = fallback
    for span in candidates:
        if span.start_ns <= start and end <= span.end_ns and \
                (best is fallback or span.duration_ns <= best.duration_ns):
            best = span
    return best


def build_spans(record: StepRecord, *, run_id: str, rank: int, world_size: int, levels: tuple[str, ...],
                budget: int = 50, module_depth: int = 3) -> list[Span]:
    """The spans of one step (see the module's docstring); never more than ``budget``."""
    b = _Builder(record, run_id, rank, world_size)
    phases = _merge_forwards(record.phases)
    start = min([record.start_ns] + [p.start_ns for p in phases])
    end = max([record.end_ns] + [p.end_ns for p in phases])
    attrs: dict[str, Any] = {"ml.step": record.step, "ml.rank": rank, "ml.world_size": world_size,
                             "ml.run_id": run_id, **_step_device(record)}
    if not record.complete:
        attrs["ml.step.incomplete"] = True
    root = b.add("step", "step", None, start, end, attrs)
    phase_spans = [b.add(p.name, "phase", root, p.start_ns, p.end_ns, {"ml.phase": p.name, **_device(p.device)})
                   for p in phases[:max(0, budget - 1)]]
    aggregated = len(phases) - len(phase_spans)  # gradient accumulation: many forward/backward pairs
    if aggregated:
        per_name: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for p in phases[len(phase_spans):]:
            per_name[p.name][0] += 1
            per_name[p.name][1] += p.end_ns - p.start_ns
        root.attributes.update({"ml.phases.names": list(per_name), "ml.phases.counts": [v[0] for v in
                                per_name.values()], "ml.phases.total_ns": [v[1] for v in per_name.values()]})
    modules = [m for m in record.modules if m.depth <= module_depth] if "task_trace" in levels else []
    ops = list(record.ops) if "op_trace" in levels else []
    aggregated += _device_calls(b, root, record.calls, max(0, budget - len(b.spans)), len(modules) + len(ops))
    room = max(0, budget - len(b.spans))
    op_room = min(len(ops), room // 2) if modules else min(len(ops), room)
    chosen_modules = sorted(modules, key=lambda m: (m.depth, m.start_ns - m.end_ns))[:room - op_room]
    op_room = min(len(ops), room - len(chosen_modules))
    chosen = set(map(id, chosen_modules))
    module_spans: list[Span] = []
    for module in sorted(chosen_modules, key=lambda m: (m.start_ns, -m.end_ns)):
        parent = _holder(module_spans, module.start_ns, module.end_ns,
                         _holder(phase_spans, module.start_ns, module.end_ns, root))
        module_spans.append(b.add(module.scope.rsplit("/", 1)[-1], "module", parent, module.start_ns, module.end_ns,
                                  {"ml.module.scope": module.scope, "ml.module.depth": module.depth,
                                   **_device(module.device)}, module.error))
    skipped: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    by_id = {s.span_id: s for s in b.spans}
    for module in record.modules if "task_trace" in levels else ():
        if id(module) in chosen:
            continue
        aggregated += 1
        holder = _holder(module_spans, module.start_ns, module.end_ns,
                         _holder(phase_spans, module.start_ns, module.end_ns, root))
        skipped[holder.span_id][0] += 1
        skipped[holder.span_id][1] += module.end_ns - module.start_ns
    for sid, (count, total) in skipped.items():
        by_id[sid].attributes.update({"obs.aggregated.modules": count, "obs.aggregated.modules_ns": total})
    containers = module_spans or phase_spans
    top = sorted(ops, key=lambda o: o.start_ns - o.end_ns)[:op_room]
    picked = set(map(id, top))
    for op in sorted(top, key=lambda o: o.start_ns):
        parent = _holder(containers, op.start_ns, op.end_ns, _holder(phase_spans, op.start_ns, op.end_ns, root))
        b.add(op.name, "op", parent, op.start_ns, op.end_ns, {"ml.op.name": op.name, "ml.module.scope": op.scope},
              op.error)
    rest: dict[int, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for op in ops:
        if id(op) in picked:
            continue
        aggregated += 1
        holder = _holder(containers, op.start_ns, op.end_ns, _holder(phase_spans, op.start_ns, op.end_ns, root))
        rest[holder.span_id][op.name][0] += 1
        rest[holder.span_id][op.name][1] += op.end_ns - op.start_ns
    for sid, per_name in rest.items():
        by_id[sid].attributes.update(_op_attributes(per_name))
    if aggregated:
        root.attributes["obs.spans.aggregated"] = aggregated
    return b.spans


def _step_device(record: StepRecord) -> dict[str, Any]:
    """The step span's device attributes: its device time, memory peaks, collectives' time, what went untimed."""
    attrs = _device(record.device)
    memory = record.memory
    if memory:
        attrs.update({f"obs.memory.{k}": v for k, v in memory.items()})
    collectives = [c for c in record.calls if c.kind == "collective"]
    if collectives:
        attrs["obs.device.collectives_ns"] = sum(c.end_ns - c.start_ns for c in collectives)
    if record.device_skipped:
        attrs["obs.device.skipped"] = record.device_skipped
    if record.device_missing:
        attrs["obs.device.missing"] = True
    return attrs


def _device_calls(b: _Builder, root: Span, calls: list[DeviceCall], room: int, wanted: int) -> int:
    """Collective spans (the longest first), then kernel spans (what the ``wanted`` module and op spans leave of the
    room, a third of it at least), under the step; the rest aggregated on the step.  How many were aggregated."""
    collectives = sorted((c for c in calls if c.kind == "collective"), key=lambda c: c.start_ns - c.end_ns)
    kernels = sorted((c for c in calls if c.kind == "kernel"), key=lambda c: c.start_ns - c.end_ns)
    shown = collectives[:room]
    left = max(0, room - len(shown))
    shown_kernels = kernels[:max(left - wanted, left // 3)]
    for call in sorted(shown + shown_kernels, key=lambda c: c.start_ns):
        attrs: dict[str, Any] = {"ml.collective.op": call.name} if call.kind == "collective" else \
            {"ml.kernel.name": call.name}
        attrs.update(_device(DeviceTime(call.start_ns, call.end_ns - call.start_ns)))
        b.add(call.name, call.kind, root, call.start_ns, call.end_ns, attrs)
    rest = collectives[len(shown):]
    if rest:
        root.attributes.update({"obs.aggregated.collectives": len(rest),
                                "obs.aggregated.collectives_ns": sum(c.end_ns - c.start_ns for c in rest)})
    per_name: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for kernel in kernels[len(shown_kernels):]:
        per_name[kernel.name][0] += 1
        per_name[kernel.name][1] += kernel.end_ns - kernel.start_ns
    if per_name:
        root.attributes.update(_op_attributes(per_name, "obs.kernels"))
    return len(rest) + len(kernels) - len(shown_kernels)


def _op_attributes(per_name: dict[str, list[int]], prefix: str = "ml.ops") -> dict[str, Any]:
    """Aggregated ops (or kernels) of one parent as parallel arrays (names, counts, total ns), longest first."""
    items = sorted(per_name.items(), key=lambda kv: -kv[1][1])
    if len(items) > _OPS_SHOWN:
        other = [sum(v[0] for _, v in items[_OPS_SHOWN:]), sum(v[1] for _, v in items[_OPS_SHOWN:])]
        items = items[:_OPS_SHOWN] + [("(other)", other)]
    return {f"{prefix}.names": [k for k, _ in items], f"{prefix}.counts": [v[0] for _, v in items],
            f"{prefix}.total_ns": [v[1] for _, v in items]}
