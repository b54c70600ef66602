"""What the profiler's tests read back from a rank's local trace files."""

from __future__ import annotations


def steps_with_spans(folder) -> dict[str, set[int]]:
    """{span kind: the steps that have spans of that kind} in the local trace files of ``folder`` (one rank's)."""
    from exporters.trace_reader import read_folder

    spans = [s for f in read_folder(str(folder)).files for s in f.spans]
    step_of = {s.trace_id: s.attributes["ml.step"] for s in spans if s.kind == "step"}
    found: dict[str, set[int]] = {}
    for s in spans:
        found.setdefault(s.kind, set()).add(step_of[s.trace_id])
    return found
