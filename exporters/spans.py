"""Spans of one training step, built from its recorded timings: step → phases → modules → ops, within a budget.

Pure: a :class:`StepRecord` (wall-clock ns) in, :class:`Span` dataclasses out, parents before children.

- One trace per step: the trace id is derived from the run id and the step, so every rank's spans of a
  step share it; span ids from run id, rank, step and position (a re-export sends the same ids).
- ``step`` (``ml.step``, ``ml.rank``, ``ml.world_size``, ``ml.run_id``) holds ``data``, ``forward``
  (consecutive root calls merged), ``backward`` and ``optimizer``.
- task_trace: module spans down to ``module_depth``; op_trace: the most expensive ops as spans.
- At most ``budget`` spans: phases first (in order), then shallow modules, then the longest; what does
  not fit is aggregated into the attributes of the span that holds it (``ml.phases.*`` on the step,
  ``obs.aggregated.*``, ``ml.ops.*``), never dropped silently.  The step span says how many were
  aggregated (``obs.spans.aggregated``).
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ModuleCall", "OpCall", "Phase", "Span", "StepRecord", "build_spans", "span_id", "trace_id"]

_OPS_SHOWN = 16  # distinct op names listed in a parent's aggregate attributes (the rest summed as "other")


@dataclass(frozen=True)
class Phase:
    name: str
    start_ns: int
    end_ns: int


@dataclass(frozen=True)
class ModuleCall:
    """``depth``: 1 for a root call, 2 for a module its forward called, ...: calls, not scope levels (a
    ModuleList or ModuleDict that is never called adds no level)."""

    scope: str
    start_ns: int
    end_ns: int
    error: bool = False
    depth: int = 0

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


@dataclass
class StepRecord:
    """What the ring held for one step, in wall-clock ns; ``complete`` False when the trainer died in it."""

    step: int
    start_ns: int
    end_ns: int
    phases: list[Phase] = field(default_factory=list)
    modules: list[ModuleCall] = field(default_factory=list)
    ops: list[OpCall] = field(default_factory=list)
    complete: bool = True


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
    """Consecutive forward phases (the model, then a loss module) are one forward."""
    out: list[Phase] = []
    for phase in sorted(phases, key=lambda p: p.start_ns):
        if out and phase.name == "forward" and out[-1].name == "forward":
            out[-1] = Phase("forward", out[-1].start_ns, max(out[-1].end_ns, phase.end_ns))
        else:
            out.append(phase)
    return out


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
                             "ml.run_id": run_id}
    if not record.complete:
        attrs["ml.step.incomplete"] = True
    root = b.add("step", "step", None, start, end, attrs)
    phase_spans = [b.add(p.name, "phase", root, p.start_ns, p.end_ns, {"ml.phase": p.name})
                   for p in phases[:max(0, budget - 1)]]
    aggregated = len(phases) - len(phase_spans)  # gradient accumulation: many forward/backward pairs
    if aggregated:
        per_name: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for p in phases[len(phase_spans):]:
            per_name[p.name][0] += 1
            per_name[p.name][1] += p.end_ns - p.start_ns
        root.attributes.update({"ml.phases.names": list(per_name), "ml.phases.counts": [v[0] for v in
                                per_name.values()], "ml.phases.total_ns": [v[1] for v in per_name.values()]})
    room = max(0, budget - len(b.spans))
    modules = [m for m in record.modules if m.depth <= module_depth] if "task_trace" in levels else []
    ops = list(record.ops) if "op_trace" in levels else []
    op_room = min(len(ops), room // 2) if modules else min(len(ops), room)
    chosen_modules = sorted(modules, key=lambda m: (m.depth, m.start_ns - m.end_ns))[:room - op_room]
    op_room = min(len(ops), room - len(chosen_modules))
    chosen = set(map(id, chosen_modules))
    module_spans: list[Span] = []
    for module in sorted(chosen_modules, key=lambda m: (m.start_ns, -m.end_ns)):
        parent = _holder(module_spans, module.start_ns, module.end_ns,
                         _holder(phase_spans, module.start_ns, module.end_ns, root))
        module_spans.append(b.add(module.scope.rsplit("/", 1)[-1], "module", parent, module.start_ns, module.end_ns,
                                  {"ml.module.scope": module.scope, "ml.module.depth": module.depth}, module.error))
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


def _op_attributes(per_name: dict[str, list[int]]) -> dict[str, Any]:
    """Aggregated ops of one parent as parallel arrays (names, counts, total ns), longest first."""
    items = sorted(per_name.items(), key=lambda kv: -kv[1][1])
    if len(items) > _OPS_SHOWN:
        other = [sum(v[0] for _, v in items[_OPS_SHOWN:]), sum(v[1] for _, v in items[_OPS_SHOWN:])]
        items = items[:_OPS_SHOWN] + [("(other)", other)]
    return {"ml.ops.names": [k for k, _ in items], "ml.ops.counts": [v[0] for _, v in items],
            "ml.ops.total_ns": [v[1] for _, v in items]}
