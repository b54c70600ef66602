"""The C statistics pass agrees with the torch path (dtypes, special values, layouts), and the torch path stands in
when the extension is absent."""

from __future__ import annotations

import math

import pytest
import torch

from obs.features.dump.stats import tensor_stats

native = pytest.importorskip("obs.features.dump.stats._stats", reason="the C extension is not built")

ALL = ("max", "min", "avg", "count", "l2norm", "nan count", "positive inf count", "negative inf count",
       "zero count", "positive zero count", "negative zero count")
COUNTS = {"count", "nan count", "positive inf count", "negative inf count", "zero count", "positive zero count",
          "negative zero count"}
#: relative tolerance of avg and l2norm: the torch path rounds to the dtype (float16's sum is a float16)
RTOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def both(tensor, categories=ALL):
    """(C pass, torch path) of ``tensor``: the C pass must have taken it."""
    assert tensor_stats._native_values(tensor, True) is not None, "the C pass declined this tensor"
    run = tensor_stats.compile_statistics(tuple(categories))
    got = dict(zip(categories, run(tensor)))
    saved = tensor_stats.native
    tensor_stats.native = None
    try:
        want = dict(zip(categories, run(tensor)))
    finally:
        tensor_stats.native = saved
    return got, want


def agree(got, want, dtype):
    assert got.keys() == want.keys()
    for key, value in want.items():
        if key in COUNTS or value is None:
            assert got[key] == value, key
            assert got[key] is None or type(got[key]) is int, key
        elif key in ("max", "min"):
            assert got[key] == value, key  # an element, exactly
        elif math.isnan(value):
            assert math.isnan(got[key]), key
        else:
            assert got[key] == pytest.approx(value, rel=RTOL.get(dtype, 1e-12), abs=1e-12), key


def sample(dtype, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.randn(n, generator=gen, dtype=torch.float64) * 30).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=gen).bool()
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), (n,), generator=gen).to(dtype)


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [0, 1, 7, 255, 256, 257, 511, 512, 513, 1023, 1024, 1025, 2049, 40_000])
def test_every_dtype_and_length_agrees_with_torch(dtype, n):
    t = sample(dtype, n, seed=n)
    if n > 3 and dtype.is_floating_point:
        t[1], t[2] = 0.0, -0.0
    got, want = both(t)
    agree(got, want, dtype)
    assert got["count"] == n


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("where", ["start", "block", "tail"])
@pytest.mark.parametrize("specials", [("nan",), ("inf",), ("-inf",), ("nan", "inf", "-inf"), ("inf", "-inf")])
def test_nan_and_inf_are_counted_exactly_and_left_out_of_min_max_avg(dtype, where, specials):
    t = sample(dtype, 3000)
    at = {"start": 0, "block": 600, "tail": 2999}[where]
    for i, s in enumerate(specials):
        t[(at + 7 * i) % 3000] = float(s)
    got, want = both(t)
    agree(got, want, dtype)
    assert got["nan count"] == specials.count("nan") and got["positive inf count"] == specials.count("inf")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str)
def test_no_finite_element_leaves_max_min_avg_empty(dtype):
    for fill in ("nan", "inf"):
        got, want = both(torch.full((700,), float(fill), dtype=dtype))
        agree(got, want, dtype)
        assert got["max"] is got["min"] is got["avg"] is None


def test_float16_subnormals_and_extremes_convert_exactly():
    bits = torch.tensor([0x0001, 0x03FF, 0x0400, 0x7BFF, 0x8001, 0xFBFF, 0x3C00, 0x8000, 0x0000] * 40,
                        dtype=torch.int32).to(torch.int16).view(torch.float16)
    got, want = both(bits)
    assert want.pop("l2norm") == math.inf  # torch's float16 norm overflows; the C pass's does not
    assert got.pop("l2norm") == pytest.approx(torch.linalg.vector_norm(bits.double()).item(), rel=1e-6)
    agree(got, want, torch.float16)
    assert got["max"] == 65504.0 and got["min"] == -65504.0
    assert got["negative zero count"] == 40 and got["zero count"] == 80


def test_integer_zeros_are_not_confused_with_the_most_negative_value():
    for dtype in (torch.int64, torch.int32, torch.int16, torch.int8):
        info = torch.iinfo(dtype)
        t = torch.tensor([0, info.min, info.max, 0, -1] * 300, dtype=dtype)
        got, want = both(t)
        assert got.pop("avg") == -0.4  # an exact sum (torch's float64 sum of int64 extremes is not)
        want.pop("avg")
        agree(got, want, dtype)
        assert got["zero count"] == 600 and got["negative zero count"] == 0
    got, want = both(torch.tensor([0, 128, 255] * 300, dtype=torch.uint8))
    agree(got, want, torch.uint8)
    assert got["zero count"] == 300 and got["min"] == 0 and got["max"] == 255


def test_large_integers_take_the_exact_double_path():
    t = torch.tensor([2**40, -(2**40), 3, 2**30] * 600, dtype=torch.int64)
    got, want = both(t)
    agree(got, want, torch.int64)
    assert got["avg"] == pytest.approx((3 + 2**30) / 4)


#: each choice of sums the C pass can make: the sum (avg), the squares (l2norm), both, neither (the squares gate)
SUMS = [("max", "min", "avg"), ("max", "min", "l2norm"), ("avg", "l2norm", "nan count"), ("max", "positive inf count")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("categories", SUMS, ids=["sum", "squares", "both", "neither"])
@pytest.mark.parametrize("special", [None, "nan", "inf", "-inf"])
def test_a_pass_keeping_only_some_sums_gives_the_full_pass_values(dtype, categories, special):
    """The pass drops the sums no chosen statistic needs; the NaN/Inf gate still holds with either sum alone."""
    for n in (700, 3000):
        t = sample(dtype, n, seed=n)
        if special is not None:
            t[n - 600] = float(special)  # inside a block, not the tail
        full = dict(zip(ALL, tensor_stats.compile_statistics(ALL)(t)))
        got = dict(zip(categories, tensor_stats.compile_statistics(categories)(t)))
        assert repr(got) == repr({c: full[c] for c in categories})


@pytest.mark.parametrize("categories", SUMS, ids=["sum", "squares", "both", "neither"])
def test_sums_that_overflow_in_a_block_fall_back_to_the_exact_pass(categories):
    """float32 block sums of finite values past float32's range: the gate fails, the exact pass gives the values."""
    t = torch.full((3000,), 3e38, dtype=torch.float32)
    t[::2] = 2e19
    full = dict(zip(ALL, tensor_stats.compile_statistics(ALL)(t)))
    got = dict(zip(categories, tensor_stats.compile_statistics(categories)(t)))
    assert repr(got) == repr({c: full[c] for c in categories})
    assert full["positive inf count"] == 0 and math.isfinite(full["avg"]) and math.isfinite(full["l2norm"])


def test_finite_values_whose_squares_overflow_float32_keep_their_norm():
    """torch's float32 norm of 1e20 is inf; the C pass sums squares in double and stays exact."""
    t = torch.full((1000,), 1e20, dtype=torch.float32)
    got = dict(zip(ALL, tensor_stats.statistics(t, ALL)))
    assert got["l2norm"] == pytest.approx(math.sqrt(1000) * float(t[0]), rel=1e-6)
    assert got["nan count"] == got["positive inf count"] == 0
    assert got["avg"] == pytest.approx(float(t[0]), rel=1e-6)


@pytest.mark.parametrize("make", [
    lambda: torch.randn(4, 1, 6).expand(4, 50, 6),                        # stride 0: values repeat
    lambda: torch.randn(30, 40).t(),                                      # permuted: dense, read as it lies
    lambda: torch.randn(8, 16, 5, 5).to(memory_format=torch.channels_last),
    lambda: torch.randn(30, 40)[:, ::3],                                  # sliced: copied first
    lambda: torch.randn(30, 40)[5:9],
    lambda: torch.randn(3, 4)[0, 0],                                      # zero-dim view
    lambda: torch.empty(0, 5),
    lambda: torch.randn(5, 1, 3).expand(5, 0, 3),
], ids=["expanded", "transposed", "channels_last", "strided", "narrowed", "scalar", "empty", "empty-expanded"])
def test_layouts_agree_with_torch(make):
    t = make()
    got, want = both(t)
    agree(got, want, t.dtype)
    assert got["count"] == t.numel()


def test_other_tensors_take_the_torch_path():
    declined = [torch.randn(6, dtype=torch.complex64), torch.randn(6).to_sparse(), torch.randn(6, device="meta"),
                torch._neg_view(torch.randn(6)), torch.randn(6).to(torch.uint16)]
    for t in declined:
        assert tensor_stats._native_values(t, True) is None
    values = tensor_stats.statistics(torch._neg_view(torch.tensor([1.0, 2.0, -3.0])), ["max", "min"])
    assert values == [3.0, -2.0]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_contiguous_fast_path_gives_what_the_compiled_statistics_give(dtype):
    """What the data dump's rows call with an address it already read: the same values as per tensor."""
    categories = ALL[::-1]  # the user's order, not the C pass's
    run, fast = tensor_stats.compile_statistics(categories), tensor_stats.compile_contiguous(categories)
    specials = [torch.zeros(0, dtype=dtype), sample(dtype, 1000, seed=3)]
    if dtype.is_floating_point:
        specials.append(torch.tensor([float("nan"), 1.0, float("-inf"), -0.0], dtype=dtype))
        specials.append(torch.full((5,), float("inf"), dtype=dtype))
    for t in specials:
        code = tensor_stats.native_code(t, t.dtype)
        assert code is not None
        got, want = fast(t.data_ptr(), t.numel(), code), run(t)
        assert [type(v) for v in got] == [type(v) for v in want]
        assert [str(v) for v in got] == [str(v) for v in want]


def test_the_contiguous_fast_path_declines_what_needs_the_tensor(monkeypatch):
    assert tensor_stats.compile_contiguous(("max", "md5")) is None  # a hash reads the bytes itself
    for t in (torch.randn(4, 4).t(), torch._neg_view(torch.randn(3)), torch.randn(3, dtype=torch.complex64)):
        assert tensor_stats.native_code(t, t.dtype) is None
    monkeypatch.setattr(tensor_stats, "native", None)
    assert tensor_stats.compile_contiguous(("max",)) is None


def test_parameters_and_tensors_requiring_grad_take_the_c_pass():
    p = torch.nn.Parameter(torch.randn(300))
    got, want = both(p)
    agree(got, want, torch.float32)


def test_the_torch_path_stands_in_without_the_extension(monkeypatch):
    t = torch.tensor([1.5, float("nan"), -2.0, 0.0, -0.0, float("inf")])
    with_c = tensor_stats.statistics(t, ALL)
    monkeypatch.setattr(tensor_stats, "native", None)
    without = tensor_stats.statistics(t, ALL)
    assert with_c[:2] == without[:2] == [1.5, -2.0]  # over the finite elements
    assert with_c[2] == pytest.approx(without[2]) == -0.125
    assert with_c[3] == without[3] == 6
    assert math.isnan(with_c[4]) and math.isnan(without[4])  # the norm of all elements
    assert with_c[5:] == without[5:] == [1, 1, 0, 2, 1, 1]


def test_bad_arguments_are_refused():
    t = torch.randn(4)
    with pytest.raises(ValueError):
        native.reduce(t.data_ptr(), 4, 99, False)
    with pytest.raises(ValueError):
        native.reduce(t.data_ptr(), -1, native.F32, False)
    with pytest.raises(ValueError):
        native.reduce(0, 4, native.F32, False)
    with pytest.raises(TypeError):
        native.reduce(t.data_ptr(), 4)
    assert native.reduce(0, 0, native.F32, True)[4:] == (0, 0, 0, 0, 0)


@pytest.mark.parametrize("categories", [ALL, ("max", "min", "l2norm"), ("md5", "max", "count"), ()], ids=str)
def test_the_c_formatter_writes_statistic_csv_as_the_python_one(categories):
    from obs.features.dump.stats.statistic_csv import StatisticRows

    rows = StatisticRows(categories, native=False)  # Python rows, formatted by the C formatter
    tensors = [torch.randn(3, 4), torch.tensor([[1, -5], [7, 2**40]]), torch.tensor(3.5, dtype=torch.float64),
               torch.tensor([float("nan")] * 3, dtype=torch.float16), torch.tensor([True, False]),
               torch.empty(0, 2), torch.tensor([1.0, 2.0], dtype=torch.bfloat16), torch.randn(2, 2).to_sparse()]
    for i, t in enumerate(tensors):
        op = ("Add", f"Default_net-Net_Add-op{i}", 1_700_000_000_000_000 + i)
        rows.add(op, "input", 0, t)
        rows.add(op, "output", 2, t)
    c_text = rows.text()
    for _, _, _, record in rows._rows:
        record[3] = None
    assert c_text == rows.python_text()
    lines = c_text.splitlines()
    assert len(lines) == 1 + 2 * (len(tensors) - 1)  # the sparse tensor has no row
    assert lines[3].startswith("Add,Default_net-Net_Add-op1,0,0,1700000000000001,input,0,32,int64,\"(2,2)\"")


def test_huge_whole_numbers_print_every_digit_as_python_does():
    """An integral max or min of an integer tensor prints as an integer, however long (the values a Python row may
    hold: up to 310 digits)."""
    from obs.features.dump.stats.statistic_csv import StatisticRows

    rows = StatisticRows(("max", "min", "avg"), native=False)
    values = [1e47, -1e300, 2.0**63, -(2.0**63), 1.7976931348623157e308]
    rows._rows = [(("Op", f"Default/Op-op{i}", 1), "output", 0, [[v, -v, v], torch.int64, (), None])
                  for i, v in enumerate(values)]
    text = rows.text()
    assert text == rows.python_text() and str(int(1e47)) in text and "\x00" not in text


def test_the_c_formatter_writes_every_double_as_repr_does():
    """statistic.csv's floats come from Ryu's shortest digits, laid out as repr(): the notation's edges, subnormals,
    extremes, whole numbers, and random bit patterns, float32 values and magnitudes."""
    import random
    import struct

    from obs.features.dump.stats.statistic_csv import StatisticRows

    gen = random.Random(7)
    edges = [1e-4, 1e-5, 9.999999999999999e-05, 0.00011, 1e15, 1e16, 1e17, 9999999999999998.0, 1234567890123456.7,
             12345678901234567.0, 5e-324, 2.2250738585072014e-308, 1.7976931348623157e308, 1.0, 100.0, 2.0**53,
             2.0**53 - 1, 2.0**60, 0.1, 1 / 3, 1e22, 1e23, 1e100, 1e-100, 0.0, math.inf, math.nan]
    values = edges + [-v for v in edges]
    values += [struct.unpack("<d", struct.pack("<Q", gen.getrandbits(64)))[0] for _ in range(20_000)]
    values += [struct.unpack("<f", struct.pack("<I", gen.getrandbits(32)))[0] for _ in range(20_000)]
    values += [gen.gauss(0, 1) * 10 ** gen.randint(-8, 20) for _ in range(20_000)]
    values += [float(gen.randint(-10**18, 10**18)) for _ in range(5_000)]
    rows = StatisticRows(("max",), native=False)  # Python rows, formatted by the C formatter
    records = [[[v], torch.float64, (1,), None] for v in values]
    rows._rows = [(("Add", "Default/Add-op0", 1), "output", 0, record) for record in records]
    lines = rows.text().splitlines()[1:]
    assert [line.rsplit(",", 1)[1] for line in lines] == [repr(v) for v in values]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str)
def test_the_nan_checks_c_gate_agrees_with_the_torch_gate(dtype):
    cases = [sample(dtype, 5000), torch.full((300,), float("nan"), dtype=dtype), torch.empty(0, dtype=dtype),
             torch.tensor([1.0, float("inf"), -float("inf"), float("nan")] * 70, dtype=dtype),
             torch.tensor([2.0, float("nan")], dtype=dtype).reshape(2, 1).expand(2, 40),
             torch.tensor([torch.finfo(dtype).max] * 600, dtype=dtype),  # finite: the torch sum overflows
             sample(dtype, 900).reshape(30, 30)[:, ::2]]
    for t in cases:
        got = tensor_stats.nonfinite_counts(t)
        saved, tensor_stats.native = tensor_stats.native, None
        try:
            want = tensor_stats.nonfinite_counts(t)
        finally:
            tensor_stats.native = saved
        assert got == want
    assert tensor_stats.nonfinite_counts(cases[3]) == (70, 70, 70)
    assert tensor_stats.nonfinite_counts(cases[4]) == (40, 0, 0)
    with pytest.raises(ValueError):
        native.finite(0, 3, native.F32)


def test_a_data_dump_through_the_torch_path_matches_the_c_path(tmp_path, monkeypatch):
    """The same three training steps dumped twice: with the C pass, then with the extension absent."""
    import csv

    from tests.obs.features.dump.test_data_dump import run

    categories = list(ALL)

    def rows(folder):
        out = []
        for step in ("0", "1", "2"):
            with open(folder / "Net" / "0" / step / "statistic.csv") as fh:
                out += list(csv.reader(fh))[1:]
        return out

    with_c = rows(run(tmp_path / "c", steps=3, saved_data="statistic", statistic_category=categories))
    monkeypatch.setattr(tensor_stats, "native", None)
    without = rows(run(tmp_path / "torch", steps=3, saved_data="statistic", statistic_category=categories))
    assert len(with_c) == len(without) > 60
    for a, b in zip(with_c, without):
        assert a[:4] == b[:4] and a[5:10] == b[5:10]  # names, io, slot, size, dtype, shape (not the µs)
        for x, y in zip(a[10:], b[10:]):
            assert x == y or float(x) == pytest.approx(float(y), rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str)
def test_the_gate_sees_one_nan_or_inf_at_any_position(dtype):
    """The gate's lanes and its tail: a single bad element anywhere in 32 lanes and a partial block is found."""
    for n in (1, 15, 16, 17, 31, 32, 33, 95, 130):
        for i in range(n):
            for bad in (float("nan"), float("inf"), -float("inf")):
                t = torch.ones(n, dtype=dtype)
                t[i] = bad
                assert not native.finite(t.data_ptr(), n, tensor_stats._CODES[dtype]), (n, i, bad)
        t = torch.full((n,), torch.finfo(dtype).max, dtype=dtype)
        assert native.finite(t.data_ptr(), n, tensor_stats._CODES[dtype])
