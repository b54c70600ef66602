"""Which steps to trace: ``"0-100|200"`` (ranges and single steps, ``|``-separated) or every N-th step.

Pure and small: the settings validate with :func:`parse_steps` (clear errors naming the part), the
exporter filters with :meth:`StepSelection.selected`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["StepSelection", "parse_steps"]

_PART = re.compile(r"\s*(\d+)\s*(?:-\s*(\d*)\s*)?")


@dataclass(frozen=True)
class StepSelection:
    """Inclusive ranges (``end`` None: open) and/or ``every`` N-th step; empty: every step."""

    ranges: tuple[tuple[int, int | None], ...] = ()
    every: int = 0

    def selected(self, step: int) -> bool:
        if self.every:
            return step % self.every == 0
        if not self.ranges:
            return True
        return any(lo <= step and (hi is None or step <= hi) for lo, hi in self.ranges)


def parse_steps(value: object) -> StepSelection:
    """``""`` every step; an int N >= 1 every N-th step; ``"0-100|200|500-"`` those steps.

    Raises ValueError with the expectation and the part that is wrong.
    """
    if isinstance(value, bool):
        raise ValueError(f"expected a step list like \"0-100|200\" or a whole number N (every N-th step), "
                         f"got {value!r}")
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"every N-th step needs N >= 1 (got {value})")
        return StepSelection(every=value)
    if not isinstance(value, str):
        raise ValueError(f"expected a step list like \"0-100|200\" or a whole number N, got {type(value).__name__}")
    if not value.strip():
        return StepSelection()
    ranges = []
    for part in value.split("|"):
        match = _PART.fullmatch(part)
        if match is None:
            raise ValueError(f"{part!r} in {value!r} is not a step (200) or a range (0-100, or 500- for every step "
                             "from 500 on)")
        lo = int(match.group(1))
        hi = None if match.group(2) == "" else int(match.group(2)) if match.group(2) is not None else lo
        if hi is not None and hi < lo:
            raise ValueError(f"range {part.strip()!r} in {value!r} ends before it starts")
        ranges.append((lo, hi))
    return StepSelection(tuple(ranges))
