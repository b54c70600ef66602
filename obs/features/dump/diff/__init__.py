"""``obs dump diff``: compare two dumps and name the op that produced the difference (``obs.dump.diff``).

The room: :mod:`.report` pairs the two runs' steps and gives each aligned op a status (``compare_dumps``, its
:class:`DiffReport`; ``diff_dumps``, the first divergent tensor); :mod:`.align` lines the ops of two steps up;
:mod:`.records` reads a step's ops from a dump; :mod:`.compare` compares a pair of ops' tensors, by their values or
their statistics; :mod:`.metrics` says how far apart two tensors are, and within what tolerance; :mod:`.render`
gives a report as JSON and as an HTML page.  Pure: dump readers in, dataclasses and text out.
"""

from __future__ import annotations

from obs.features.dump.diff.metrics import DiffMetrics, Tolerance
from obs.features.dump.diff.report import (
    DiffReport,
    DiffResult,
    Divergence,
    OpDiff,
    TensorDiff,
    compare_dumps,
    diff_dumps,
)

__all__ = ["DiffMetrics", "DiffReport", "DiffResult", "Divergence", "OpDiff", "TensorDiff", "Tolerance",
           "compare_dumps", "diff_dumps"]
