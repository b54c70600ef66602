"""The anomaly rules: the robust default (both directions, warm-up ignored), its native bank, msprobe's two rules."""

from __future__ import annotations

import math
import random

import pytest

from obs.features.monitor.detect import EXTENSION, Detector, NanRule, Robust, Turbulence, rules_from


def _feed(rule, values, stat="norm"):
    state = rule.state()
    return [rule.judge(state, v, stat) for v in values]


def test_robust_flags_both_directions_after_its_warmup():
    steady = [1.0 + 0.01 * ((i * 7) % 5) for i in range(30)]
    up = _feed(Robust(window=20, warmup=10, threshold=10), [*steady, 2.0])
    down = _feed(Robust(window=20, warmup=10, threshold=10), [*steady, 0.2])
    assert not any(up[:-1]) and not any(down[:-1])
    assert up[-1] is not None and up[-1].rule == "robust" and 1.0 <= up[-1].baseline <= 1.05
    assert down[-1] is not None and down[-1].score > 10


def test_robust_ignores_the_warmup_and_small_moves():
    early = _feed(Robust(window=20, warmup=10, threshold=10), [1.0, 1.0, 1.0, 50.0, 1.0])
    assert not any(early)  # still warming up
    noise = _feed(Robust(window=20, warmup=3, threshold=10), [1.0] * 10 + [1.04])
    assert not any(noise)  # a constant series moved by 4%: under the floor of 5% of the median


def test_robust_flags_a_nan_or_an_inf_after_finite_values():
    got = _feed(Robust(window=10, warmup=3, threshold=10), [1.0] * 5 + [math.nan, math.inf, 1.0])
    assert got[5] is not None and got[6] is not None and got[7] is None


def test_turbulence_is_msprobes_upward_rule_of_norms_and_means():
    rule = Turbulence(threshold=0.5)
    assert _feed(rule, [1.0, 1.0, 1.6])[-1] is not None
    assert _feed(rule, [1.0, 1.0, 0.1])[-1] is None  # upward only
    assert _feed(rule, [1.0, 1.0, 1.6], stat="max")[-1] is None  # norm and mean only, as msprobe
    verdict = _feed(rule, [-1.0, -1.0, -1.6])[-1]
    assert verdict is not None and verdict.baseline == 1.0  # sizes: a negative mean that grows is flagged


def test_nan_rule_and_its_threshold():
    assert _feed(NanRule(), [1.0, math.nan])[-1] is not None
    assert _feed(NanRule(), [1e9])[-1] is None
    assert _feed(NanRule(threshold=10.0), [11.0])[-1].rule == "AnomalyNan"


def test_the_detector_keeps_a_state_per_series_and_names_the_first_rule():
    detector = Detector(rules_from(10, 3, 10.0, {"rules": [{"rule_name": "AnomalyNan", "args": {}}]}))
    assert [type(r).__name__ for r in detector.rules] == ["Robust", "NanRule"]
    for _ in range(5):
        assert detector.judge("a", 1.0, "norm") is None
    assert detector.judge("b", math.nan, "norm").rule == "AnomalyNan"  # no history yet: only msprobe's rule
    assert detector.judge("a", math.nan, "norm").rule == "robust"


def _series(seed: int, steps: int, count: int) -> list[list[float]]:
    """Steps of ``count`` series: noise with rare jumps, NaNs and infinities, and series of repeated values (ties)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(steps):
        row = []
        for k in range(count):
            u = rng.random()
            v = rng.choice([1.0, 2.0, 2.0, 3.0]) if k % 3 == 0 else rng.gauss(5, 1) * (100 if u < 0.02 else 1)
            row.append(math.nan if u > 0.995 else math.inf if u > 0.99 else -math.inf if u > 0.987 else v)
        rows.append(row)
    return rows


@pytest.mark.parametrize("window,warmup,threshold", [(50, 20, 10.0), (5, 0, 3.0), (4, 2, 1.0), (3, 0, 0.5)])
def test_the_native_bank_judges_exactly_as_the_python_rule(window, warmup, threshold):
    """The worker's C rule (``_robust.c``) against the reference: the same verdicts, baselines and scores, bit for
    bit, with series judged in any order in one call."""
    if EXTENSION.load() is None:
        pytest.skip("the C extension obs.features.monitor._robust is not built")
    native = Detector([Robust(window, warmup, threshold)])
    python = Detector([Robust(window, warmup, threshold)], native=False)
    assert native._bank is not None and python._bank is None
    keys = [("grad_reduced", f"layer{k}", None, "norm") for k in range(9)]
    order = list(range(9))
    rng = random.Random(7)
    flagged = 0
    for row in _series(window, 400, 9):
        rng.shuffle(order)
        args = [keys[k] for k in order], [row[k] for k in order], ["norm"] * 9
        got = native.judge_many(native.indices(args[0]), args[1], args[2])
        want = python.judge_many(python.indices(args[0]), args[1], args[2])
        assert got == want
        flagged += len(want)
    assert flagged > 0


def test_a_detector_of_msprobes_rules_keeps_them_in_python():
    detector = Detector(rules_from(10, 3, 10.0, {"rules": [{"rule_name": "AnomalyTurbulence",
                                                             "args": {"threshold": 0.5}}]}))
    assert detector._bank is None
    found = detector.judge_many(detector.indices(["a", "b"]), [1.0, math.nan], ["norm", "norm"])
    assert found == []  # no history yet: the robust rule waits, Turbulence skips a NaN


def test_the_native_bank_refuses_bad_arguments_by_name():
    lib = EXTENSION.load()
    if lib is None:
        pytest.skip("the C extension obs.features.monitor._robust is not built")
    with pytest.raises(ValueError, match="window must be >= 1"):
        lib.Bank(0, 0, 1.0)
    bank = lib.Bank(5, 0, 3.0)
    with pytest.raises(ValueError, match="2 indices but 1 values"):
        bank.judge((0, 1), (1.0,))
    with pytest.raises(ValueError, match="negative"):
        bank.judge((-1,), (1.0,))
    with pytest.raises(TypeError):
        bank.judge((0,), ("x",))
    assert bank.judge((0, 1), [1.0, 2.0]) == [] and bank.size == 2
