"""The parts of `obs dump diff` on their own: the sequence alignment, the metrics and the tolerance presets."""

from __future__ import annotations

import math

import numpy as np
import pytest

from obs.features.dump.diff import metrics as diff_metrics
from obs.features.dump.diff.align import align
from obs.features.dump.diff.metrics import Tolerance, close, statistic_metrics, statistic_metrics_many, tensor_metrics
from obs.features.dump.diff.records import _parse


def key(op):
    """Test ops are ``(type, scope, shape, value)`` tuples; the phase is always forward."""
    return ("forward", op[0]), op[1], op[2], op[3]


def ops(*names, scope="m", shape="(2)"):
    return [(n, scope, shape, n) for n in names]


def test_an_inserted_and_a_removed_op_move_nothing_else():
    a = ops("A", "B", "C", "D", "E")
    b = ops("A", "X", "B", "C", "E")
    assert align(a, b, key) == [(0, 0), (None, 1), (1, 2), (2, 3), (3, None), (4, 4)]
    assert align([], b[:2], key) == [(None, 0), (None, 1)] and align(a[:1], [], key) == [(0, None)]


def test_ops_pair_by_scope_first_then_by_type_and_order():
    eager = [("Mm", "layer0", "(2)", None), ("Relu", "layer0", "(2)", None), ("Mm", "layer1", "(2)", None)]
    compiled = [("Detach", "net", "(2)", None), ("Mm", "net", "(2)", None), ("Relu", "net", "(2)", None),
                ("Mm", "net", "(2)", None)]
    assert align(eager, compiled, key) == [(None, 0), (0, 1), (1, 2), (2, 3)]
    # within one scope, a removed Mm pairs the remaining one by its scope, not by position
    a = [("Mm", "layer0", "(2)", None), ("Mm", "layer1", "(2)", None)]
    assert align(a, a[1:], key) == [(0, None), (1, 0)]


def test_shapes_must_agree_where_both_are_known():
    a = [("Add", "s", "(2)", None), ("Add", "s", "(3)", None)]
    b = [("Add", "s", "(3)", None)]
    assert align(a, b, key) == [(0, None), (1, 0)]
    either = align(a, [("Add", "s", None, None)], key)  # unknown: either
    assert sorted(either, key=str) in ([(0, 0), (1, None)], [(0, None), (1, 0)])


def test_ops_that_ran_in_another_order_pair_by_value_not_by_position():
    # the gradients a compiled backward hands over at its end: same kind and shape, values tell them apart
    a = [("Mm", "l1", "(2)", "g1"), ("Detach", "root", "(2)", "v1"), ("Mm", "l0", "(2)", "g0"),
         ("Detach", "root", "(2)", "v0")]
    b = [("Mm", "l1", "(2)", "g1"), ("Mm", "l0", "(2)", "g0"), ("Detach", "root", "(2)", "v0"),
         ("Detach", "root", "(2)", "v1")]
    pairs = align(a, b, key)
    assert sorted(p for p in pairs if None not in p) == [(0, 0), (1, 3), (2, 1), (3, 2)]
    assert [i for i, _ in pairs] == [0, 1, 2, 3]  # in A's order


def test_a_large_alignment_of_similar_runs_is_linear():
    a = [("Op", f"layer{i // 10}", "(2)", i) for i in range(20_000)]
    b = a[:5_000] + [("Extra", "layer500", "(2)", -1)] + a[5_000:15_000] + a[15_001:]
    pairs = align(a, b, key)
    assert (15_000, None) in pairs and (None, 5_000) in pairs and len(pairs) == 20_001


def test_tensor_metrics():
    b = np.linspace(-1, 1, 11, dtype=np.float32)
    same = tensor_metrics(b, b.copy(), 1e-5, 1e-8)
    assert same.within and same.max_abs == 0 and same.cosine == pytest.approx(1.0)
    a = b.copy()
    a[3] += 1e-3
    m = tensor_metrics(a, b, 1e-5, 1e-8)
    assert not m.within and m.what == "values" and m.max_abs == pytest.approx(1e-3, rel=1e-3)
    assert m.max_rel == pytest.approx(1e-3 / 0.4, rel=1e-3) and 0.999 < m.cosine < 1
    assert tensor_metrics(a, b, 1e-2, 1e-2).within
    zero = np.zeros(3, np.float32)
    assert tensor_metrics(zero + 1e-9, zero, 0, 0).max_rel == math.inf  # relative to a zero
    nan = np.array([np.nan, 1.0])
    assert tensor_metrics(nan, nan.copy(), 0, 0).within  # NaN agrees with NaN
    one_sided = tensor_metrics(np.array([np.nan, 1.0]), np.array([0.0, 1.0]), 1, 1)
    assert not one_sided.within and one_sided.max_abs == math.inf
    assert tensor_metrics(np.arange(4), np.arange(4), 0, 0).within  # integers: exact
    assert not tensor_metrics(np.arange(4), np.arange(4)[::-1].copy(), 0, 0).within


def test_tensor_metrics_read_large_tensors_a_chunk_at_a_time(monkeypatch):
    monkeypatch.setattr(diff_metrics, "_CHUNK", 7)
    rng = np.random.default_rng(0)
    b = rng.standard_normal(100).astype(np.float32)
    a = b * np.float32(1.001)
    m = tensor_metrics(a, b, 1e-5, 1e-8)
    monkeypatch.setattr(diff_metrics, "_CHUNK", 1 << 20)
    whole = tensor_metrics(a, b, 1e-5, 1e-8)
    for field in ("max_abs", "max_rel", "cosine", "mean_rel", "l2_rel"):
        assert getattr(m, field) == pytest.approx(getattr(whole, field), rel=1e-9)
    assert m.within == whole.within and m.l2_rel == pytest.approx(1e-3, rel=1e-3)


def test_statistic_metrics_say_which_statistic_differs_and_give_no_cosine():
    keys = ["max", "min", "avg", "l2norm"]
    m = statistic_metrics(keys, ["1.0", "-1.0", "0.5", "2.0"], ["1.0", "-1.0", "0.25", "2.2"], 1e-5, 1e-8)
    assert not m.within and (m.what, m.a, m.b) == ("avg", 0.5, 0.25) and m.cosine is None
    assert m.max_abs == pytest.approx(0.25) and m.mean_rel == pytest.approx(1.0)
    assert m.l2_rel == pytest.approx(0.2 / 2.2)
    assert statistic_metrics(keys, ["nan", "null", "1", "2"], ["nan", "null", "1", "2"], 0, 0).within
    assert close("abc", "abc", 0, 0) and not close(None, 1.0, 1, 1) and not close(math.inf, 1e308, 1, 1)


def test_many_rows_at_once_give_what_one_row_at_a_time_gives():
    keys = ["max", "min", "avg", "nan count", "l2norm", "md5"]
    rows_a = [["1.0", "-1.0", "0.5", "0", "2.0", "ab"], ["nan", "null", "inf", "1", "0", "ab"],
              ["1.0", "0", "0", "0", "1e-6", "cd"], ["3", "1", "2", "0", "4", "ef"]]
    rows_b = [["1.0", "-1.0", "0.25", "0", "2.2", "ab"], ["nan", "null", "inf", "1", "0", "ab"],
              ["1.0", "0", "0", "0", "0", "cd"], ["3", "1", "2", "2", "4", "gh"]]
    va, ca = _parse(rows_a, len(keys))
    vb, cb = _parse(rows_b, len(keys))
    text_same = np.array([[a == b for a, b in zip(ra, rb)] for ra, rb in zip(rows_a, rows_b)])
    many = statistic_metrics_many(keys, va, vb, ca, cb, text_same, np.full(4, 1e-5), np.full(4, 1e-8))
    for got, ra, rb in zip(many, rows_a, rows_b):
        one = statistic_metrics(keys, ra, rb, 1e-5, 1e-8)
        assert (got.within, got.what) == (one.within, one.what)
        for field in ("max_abs", "max_rel", "mean_rel", "l2_rel"):
            assert getattr(got, field) == pytest.approx(getattr(one, field)), (field, ra, rb)
    assert [m.what for m in many] == ["avg", "", "l2norm", "nan count"]


def test_tolerance_presets_per_dtype():
    assert Tolerance().of("float32", "float32") == (1e-5, 1e-8)  # the default, for every dtype
    assert Tolerance(rtol=0, atol=0).of("float16", "bfloat16") == (0, 0)
    assert Tolerance("bf16").of("float32", "float32") == diff_metrics.PRESETS["bf16"]
    auto = Tolerance("auto")
    assert auto.of("BFloat16", "Float32") == diff_metrics.PRESETS["bf16"]  # the coarser of the two
    assert auto.of("float64", "float32") == diff_metrics.PRESETS["fp32"]
    assert auto.of("int64", "int64") == (0.0, 0.0)
    assert Tolerance("fp16", rtol=1e-2).of("float16", "float16") == (1e-2, diff_metrics.PRESETS["fp16"][1])
    assert Tolerance("fp32", atol=0).describe() == "preset fp32, atol=0"
    with pytest.raises(ValueError, match="tolerance preset must be 'auto' or one of"):
        Tolerance("fp8")


def test_a_signalling_nan_compares_as_a_nan_without_a_warning():
    """0xFFBB77DD is a signalling float32 NaN whose cast to float64 numpy warns of (the fuzzer found it in a dump)."""
    a = np.array([0xFFBB77DD, 0x3F800000], dtype=np.uint32).view(np.float32)
    metrics = tensor_metrics(a, a.copy(), 1e-5, 1e-8)  # the suite turns warnings into errors
    assert metrics.within
