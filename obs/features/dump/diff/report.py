"""Compare two dumps (two versions, CPU against GPU, bf16 against fp32, compiled against eager) and name the op that
produced the difference.

Steps are matched by rank and iteration.  Within a step, the two runs' ops are lined up by a sequence alignment
of their type, module scope, output shapes and coarse values (:mod:`obs.features.dump.diff.align`): an op inserted
or removed on one side moves nothing else, and is listed.  Each aligned op's inputs and outputs are compared
(:mod:`obs.features.dump.diff.compare`), by their tensors where both runs dumped them (one pair in memory at a time)
and by their ``statistic.csv`` rows otherwise (:mod:`obs.features.dump.diff.metrics`), and the op gets a status:

- ``producer``: its inputs agree within the tolerance and its outputs do not; the first is *the* producer;
- ``carried``: inputs and outputs differ (it only carried a difference on);
- ``absorbed``: its inputs differ and its outputs agree (a ReLU's zeros, a copy over a dropped value);
- ``same``; ``removed`` (only in A) and ``inserted`` (only in B).

An op with no inputs dumped (a parameter's row; every op of an outputs-only dump) is a producer when nothing
diverged before it, and carried after.  An op outside every module in forward (an optimizer's update) names the
parameter whose value is its first input (``OpDiff.parameter``), none where that is ambiguous.  Pure: readers in, a
:class:`DiffReport` out.

``diff_dumps`` keeps the earlier answer, the first tensor that diverges, as a :class:`DiffResult`.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from obs.features.dump.diff.align import align
from obs.features.dump.diff.compare import SAME_STATISTICS, Parameters, StepComparer, TensorDiff
from obs.features.dump.diff.metrics import Tolerance
from obs.features.dump.diff.records import OpRecord, read_step
from obs.features.dump.reader import Step

__all__ = ["DiffReport", "DiffResult", "Divergence", "OpDiff", "TensorDiff", "Tolerance", "compare_dumps",
           "diff_dumps"]

DIVERGENT = ("producer", "carried")


#: Ops a compiled graph runs where eager runs another: the eager op's type and its outputs.  AOT autograd
#: functionalizes BatchNorm (two more outputs: the new running statistics eager writes in place, which the graph
#: copies into the buffers at its end) and runs eval's without statistics.
EAGER_TWIN = {"NativeBatchNormLegitFunctional": ("NativeBatchNorm", 3), "NativeBatchNormLegit": ("NativeBatchNorm", 3),
              "NativeBatchNormLegitNoTraining": ("NativeBatchNorm", 3)}


def _key(op: OpRecord) -> tuple[Hashable, Hashable, Hashable, Hashable]:
    """An op's alignment key: kind (phase and type, a compiled graph's op as its eager twin), place (module scope, or
    a parameter's name), output shapes, and a fingerprint of its first output's statistics (None from tensor
    files)."""
    op_type, shapes = op.op_type, op.shapes
    twin = EAGER_TWIN.get(op_type)
    if twin is not None:
        op_type, shapes = twin[0], shapes and shapes[:twin[1]]
    return (op.phase, op_type), op.scope, shapes, op.fingerprint


@dataclass(slots=True)
class OpDiff:
    """One aligned op (or an op of one run only); ``index``: its position among all aligned ops of the comparison.

    Metrics are the worst of its outputs' (of its inputs' where it has no output compared): the largest errors, the
    smallest cosine; None where nothing gives them (a cosine from statistics)."""

    index: int
    rank: int
    iteration: int
    status: str
    op_type: str
    name_a: str | None
    name_b: str | None
    phase: str
    inputs_agree: bool | None = None
    outputs_agree: bool | None = None
    source: str | None = None  #: "tensors", "statistics", "tensors+statistics", or None (nothing compared)
    max_abs: float | None = None
    max_rel: float | None = None
    cosine: float | None = None
    mean_rel: float | None = None
    l2_rel: float | None = None
    tensors: tuple[TensorDiff, ...] = ()
    parameter: str | None = None  #: the parameter it is (a Parameter row) or updates (an optimizer's op)

    @property
    def name(self) -> str:
        return self.name_a or self.name_b or ""

    @property
    def divergent(self) -> bool:
        return self.status in DIVERGENT

    @property
    def renamed(self) -> bool:
        """Whether B names the op otherwise than A, its index in the step (``-op12``) aside."""
        return bool(self.name_a and self.name_b) and _unindexed(self.name_a or "") != _unindexed(self.name_b or "")


def _unindexed(name: str) -> str:
    cut = name.rfind("-op")
    return name[:cut] if cut > 0 and name[cut + 3:].isdigit() else name


@dataclass(frozen=True)
class Divergence:
    """Where A and B first disagree: the op, which tensor, what differs."""

    rank: int
    iteration: int
    index: int  #: position of the tensor's row in A's step (execution order)
    op_type: str
    op_name: str
    io: str
    slot: int
    what: str  #: the statistic ("max", "l2norm"), "values" or "shape"
    a: Any
    b: Any


@dataclass(frozen=True)
class DiffReport:
    """What ``obs dump diff`` found: every aligned op of every shared step, in order, and the producer."""

    tolerance: Tolerance
    steps: list[tuple[int, int]]  #: (rank, iteration) compared
    only_in_a: list[tuple[int, int]]
    only_in_b: list[tuple[int, int]]
    mode: str  #: how tensors were compared: "tensors", "statistics", "tensors+statistics" (or "none")
    compared: int  #: tensors compared
    ops: list[OpDiff] = field(repr=False)
    producer: OpDiff | None
    first: Divergence | None  #: the first tensor outside the tolerance, in execution order

    @property
    def diverged(self) -> bool:
        return self.first is not None

    @property
    def divergent(self) -> list[OpDiff]:
        return [op for op in self.ops if op.status in DIVERGENT]

    @property
    def inserted(self) -> list[OpDiff]:
        """Ops only in B."""
        return [op for op in self.ops if op.status == "inserted"]

    @property
    def removed(self) -> list[OpDiff]:
        """Ops only in A."""
        return [op for op in self.ops if op.status == "removed"]


@dataclass(frozen=True)
class DiffResult:
    """:func:`diff_dumps`' answer: the first divergent tensor."""

    compared: int  #: tensors compared
    steps: list[tuple[int, int]]  #: (rank, iteration) compared
    only_in_a: list[tuple[int, int]]
    only_in_b: list[tuple[int, int]]
    mode: str  #: "statistics", "tensors" or "tensors+statistics"
    first: Divergence | None


def _steps(reader: Any) -> dict[tuple[int, int], Step]:
    out: dict[tuple[int, int], Step] = {}
    for step in reader.steps():
        out.setdefault((step.rank, step.iteration), step)
    return out


_Worst = tuple[float | None, float | None, float | None, float | None, float | None]  # max abs, max rel, cosine, ...


def _worst(diffs: list[TensorDiff]) -> _Worst:
    def largest(values: list[float | None]) -> float | None:
        found = [v for v in values if v is not None]
        return max(found) if found else None

    ms = [d.metrics for d in diffs]
    cosines = [m.cosine for m in ms if m.cosine is not None]
    return (largest([m.max_abs for m in ms]), largest([m.max_rel for m in ms]), min(cosines) if cosines else None,
            largest([m.mean_rel for m in ms]), largest([m.l2_rel for m in ms]))


def _status(inputs: bool | None, outputs: bool | None, diverged_before: bool) -> str:
    if outputs is False and inputs is True:
        return "producer"
    if outputs is False and inputs is False:
        return "carried"
    if outputs is False or (outputs is None and inputs is False):  # one side of the op only
        return "carried" if diverged_before else "producer"
    return "absorbed" if inputs is False else "same"


_SAME: _Worst = (0.0, 0.0, None, 0.0, 0.0)  # the metrics of an op whose tensors' statistics are all the same text


def _op_diff(oa: OpRecord, ob: OpRecord, diffs: list[TensorDiff], index: int, key: tuple[int, int],
             diverged_before: bool) -> OpDiff:
    in_ok: bool | None = None
    out_ok: bool | None = None
    same = True
    sources = set()
    for t in diffs:
        within = t.metrics.within
        if t.io == "input":
            in_ok = within if in_ok is None else in_ok and within
        else:
            out_ok = within if out_ok is None else out_ok and within
        if t.metrics is not SAME_STATISTICS:
            same = False
        sources.add(t.source)
    source = ("tensors+statistics" if len(sources) == 2 else next(iter(sources))) if sources else None
    worst = _SAME if same else _worst([t for t in diffs if t.io != "input"] or diffs)
    max_abs, max_rel, cosine, mean_rel, l2_rel = worst
    return OpDiff(index, key[0], key[1], _status(in_ok, out_ok, diverged_before), oa.op_type, oa.name, ob.name,
                  oa.phase, in_ok, out_ok, source, max_abs, max_rel, cosine, mean_rel, l2_rel, tuple(diffs),
                  oa.name if oa.phase == "parameter" else None)


def compare_dumps(a: Any, b: Any, *, tolerance: Tolerance | None = None, iterations: list[int] | None = None,
                  progress: Callable[[int, int], None] | None = None) -> DiffReport:
    """Every shared step of ``a`` and ``b`` (two :class:`~obs.features.dump.reader.DumpReader`, or objects with
    their ``steps``, ``statistics`` and ``tensors``), aligned and compared op by op."""
    collecting = gc.isenabled()
    gc.disable()  # hundreds of thousands of small objects and no cycle: the collector would walk them again and again
    try:
        return _compare(a, b, tolerance or Tolerance(), iterations, progress)
    finally:
        if collecting:
            gc.enable()


def _compare(a: Any, b: Any, tolerance: Tolerance, iterations: list[int] | None,
             progress: Callable[[int, int], None] | None) -> DiffReport:
    sa, sb = _steps(a), _steps(b)
    keys = sorted(k for k in sa if k in sb and (iterations is None or k[1] in iterations))
    tolerances: dict[tuple[str, str], tuple[float, float]] = {}
    ops: list[OpDiff] = []
    sources: set[str] = set()
    compared = 0
    producer: OpDiff | None = None
    first: Divergence | None = None
    diverged = False
    for n, key in enumerate(keys):
        ra, rb = read_step(a, sa[key]), read_step(b, sb[key])
        pairs = align(ra.ops, rb.ops, _key)
        comparer = StepComparer(ra, rb, tolerance, tolerances)
        both = [(ra.ops[i], rb.ops[j]) for i, j in pairs if i is not None and j is not None]
        compared_ops = iter(comparer.compare(both))
        sources |= comparer.sources
        updates: list[tuple[OpRecord, OpDiff]] = []  # divergent ops that may update a parameter
        for i, j in pairs:
            if j is None and i is not None:
                op = ra.ops[i]
                ops.append(OpDiff(len(ops), key[0], key[1], "removed", op.op_type, op.name, None, op.phase))
                continue
            if i is None and j is not None:
                op = rb.ops[j]
                ops.append(OpDiff(len(ops), key[0], key[1], "inserted", op.op_type, None, op.name, op.phase))
                continue
            oa, ob = ra.ops[i], rb.ops[j]  # type: ignore[index]
            tensors = next(compared_ops)
            compared += len(tensors)
            diff = _op_diff(oa, ob, tensors, len(ops), key, diverged)
            if diff.divergent:
                diverged = True
                if diff.parameter is None:
                    updates.append((oa, diff))
                if diff.status == "producer" and producer is None:
                    producer = diff
            if first is None:
                bad = next((t for t in tensors if not t.metrics.within), None)
                if bad is not None:
                    m = bad.metrics
                    first = Divergence(key[0], key[1], bad.row, oa.op_type, oa.name, bad.io, bad.slot, m.what, m.a,
                                       m.b)
            ops.append(diff)
        for (_, diff), name in zip(updates, Parameters(ra).updated_by([op for op, _ in updates])):
            diff.parameter = name
        if progress is not None:
            progress(n + 1, len(keys))
    mode = "+".join(s for s in ("tensors", "statistics") if s in sources) or "none"
    return DiffReport(tolerance, keys, sorted(k for k in sa if k not in sb), sorted(k for k in sb if k not in sa),
                      mode, compared, ops, producer, first)


def diff_dumps(a: Any, b: Any, *, rtol: float = 1e-5, atol: float = 1e-8, iterations: list[int] | None = None,
               progress: Callable[[int, int], None] | None = None) -> DiffResult:
    """The first tensor, in execution order, whose values (or statistics) differ beyond the tolerance; see
    :func:`compare_dumps` for the producer and every op's metrics."""
    report = compare_dumps(a, b, tolerance=Tolerance(None, rtol, atol), iterations=iterations, progress=progress)
    return DiffResult(report.compared, report.steps, report.only_in_a, report.only_in_b, report.mode, report.first)

