"""Every reader survives the mutation fuzzer: only clear errors, never a traceback or a hang (CI size)."""

from __future__ import annotations

import pytest

from tests.fuzz import all_targets, run_target

# per target, a CI-sized smoke run of every reader; `python -m tests.fuzz --cases 200000` for the README's figures
CASES = 250


@pytest.mark.parametrize("target", all_targets(), ids=lambda t: t.name)
def test_reader_survives_fuzzing(target):
    report = run_target(target, CASES, seed=1)
    assert report.cases == CASES
    assert report.rejected > 0, "no mutation was rejected: the fuzzer is not reaching the reader's checks"
    assert not report.findings, "\n\n".join(f"{k} (x{report.findings[k]}):\n{v}" for k, v in report.examples.items())
