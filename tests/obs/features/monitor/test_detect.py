"""The anomaly rules: the robust default (both directions, warm-up ignored) and msprobe's two rules."""

from __future__ import annotations

import math

from obs.features.monitor.detect import Detector, NanRule, Robust, Turbulence, rules_from


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
