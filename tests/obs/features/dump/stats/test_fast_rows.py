"""The C++ row recorder (obs/features/dump/stats/_fast_rows.cpp) writes statistic.csv byte for byte as the Python
recorder does: dtypes, layouts it hands back to Python, shared memory, in-place writes, slots and gaps, whole dumps."""

from __future__ import annotations

import sys
import threading

import pytest
import torch

import obs
from obs._core.events import Event, bus
from obs.features.dump.stats import native_rows
from obs.features.dump.stats.statistic_csv import StatisticRows
from obs.runtime.steps import tracker

pytest.importorskip("obs.features.dump.stats._stats", reason="the C extension is not built")

ALL = ("max", "min", "avg", "count", "l2norm", "nan count", "positive inf count", "negative inf count",
       "zero count", "positive zero count", "negative zero count")


class Tagged(torch.Tensor):
    """A tensor subclass: the C++ recorder hands it to the Python path."""


def pair(categories):
    """(C++ recorder, Python recorder) over the same categories; the C++ one must exist."""
    fast, slow = StatisticRows(categories), StatisticRows(categories, native=False)
    assert fast.native is not None, f"the native statistic recorder is off: {native_rows.unavailable_reason()}"
    assert slow.native is None
    return fast, slow


def feed(rows, ops):
    for i, (io, values) in enumerate(ops):
        rows.add_values(("Op", f"Default_Op-op{i}", 1_700_000_000_000_000 + i), io, values)


def same_text(fast, slow):
    text = fast.text()
    assert text == slow.text()
    return text


@pytest.fixture(autouse=True)
def both_paths(monkeypatch):
    """These tests compare the two paths: a switch in the environment (OBS_NATIVE=0, OBS_NATIVE_DUMP=0) keeps both."""
    monkeypatch.delenv("OBS_NATIVE", raising=False)
    monkeypatch.delenv("OBS_NATIVE_DUMP", raising=False)


def test_the_native_recorder_is_built_and_used():
    fast, _ = pair(("max",))
    assert fast.add_values == fast.native.add_values


@pytest.mark.parametrize("categories", [ALL, ("max", "min", "l2norm"), ("count", "zero count", "avg")], ids=str)
def test_every_dtype_and_layout_gives_the_python_rows(categories):
    fast, slow = pair(categories)
    torch.manual_seed(0)
    base = torch.randn(6, 5)
    with torch.inference_mode():
        inference = torch.randn(3)
    param = torch.nn.Parameter(torch.randn(2, 3))
    values = [torch.randn(4, 3), torch.randn(3, dtype=torch.float64), torch.randn(7).half(), torch.randn(7).bfloat16(),
              torch.tensor([1, -5, 2**40]), torch.tensor([3, -3], dtype=torch.int32),
              torch.tensor([9], dtype=torch.int16),
              torch.tensor([-8, 0], dtype=torch.int8), torch.tensor([0, 255], dtype=torch.uint8),
              torch.tensor([True, False, True]), torch.empty(0, 4), torch.tensor(2.5),
              torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), -0.0, 0.0]),
              base.t(), base[:, 1], torch.randn(3, 1).expand(3, 4), torch.randn(2, 2, dtype=torch.complex64),
              torch.randn(4).as_subclass(Tagged), inference, param, torch.randn(2, 2).to_sparse(),
              torch.randn(1, 1, 1, 1, 1, 1, 1, 1, 1, 2)]
    ops = [("input", (v,)) for v in values] + [("output", (v,)) for v in values]
    for rows in (fast, slow):
        feed(rows, ops)
    text = same_text(fast, slow)
    assert len(text.splitlines()) == 1 + 2 * (len(values) - 1)  # the sparse tensor has no row


def test_slots_follow_positions_with_gaps_lists_and_nones():
    fast, slow = pair(("max", "min"))
    a, b, c = torch.randn(2), torch.randn(3), torch.randn(4)
    ops = [("input", (a, 3, [b, None, c], (), "x", torch.Size([2, 2]), (a,), [1, 2], b)),
           ("output", ([a, b],)), ("output", ((None, c),)), ("input", ())]
    for rows in (fast, slow):
        feed(rows, ops)
    text = same_text(fast, slow)
    slots = [line.split(",")[6] for line in text.splitlines()[1:]]
    assert slots == ["0", "2", "4", "8", "10", "0", "1", "1"]


def test_shared_memory_in_place_writes_and_reused_addresses_give_the_python_rows():
    fast, slow = pair(ALL)
    torch.manual_seed(1)
    t = torch.randn(5, 4)
    ops = [("output", (t,)), ("input", (t.view(20),)), ("input", (t[0],)), ("input", (t,))]
    for rows in (fast, slow):
        feed(rows, ops)
    t.mul_(2)  # a new version: new values
    for rows in (fast, slow):
        feed(rows, [("input", (t,))])
    for _ in range(3):  # freed tensors whose memory the allocator hands to the next one
        u = torch.full((5, 4), float(_))
        for rows in (fast, slow):
            feed(rows, [("output", (u,))])
        del u
    text = same_text(fast, slow)
    lines = text.splitlines()[1:]
    stats_of = [line.split(",")[-len(ALL):] for line in lines]  # the shape's commas are quoted: count from the end
    assert stats_of[0] == stats_of[3] != stats_of[4]
    assert [s[0] for s in stats_of[5:]] == ["0.0", "1.0", "2.0"]


def test_clear_starts_a_new_step():
    fast, slow = pair(("max",))
    t = torch.ones(3)
    for rows in (fast, slow):
        feed(rows, [("output", (t,))])
        rows.clear()
        assert len(rows) == 0
    with torch.no_grad():
        t.data.fill_(4.0)  # unseen by the version counter: a new step reads it again
    for rows in (fast, slow):
        feed(rows, [("output", (t,))])
    assert same_text(fast, slow).splitlines()[1].endswith(",4.0")


def test_rows_kept_in_cpp_count_place_and_interleave_with_python_rows():
    """The C++ recorder keeps its rows itself: add() places a tensor at its slot, the rows it hands to Python keep
    their place among its own, len() counts both, and a cleared step starts empty."""
    fast, slow = pair(("max", "count"))
    plain, tagged = torch.arange(4.0), torch.arange(3.0).as_subclass(Tagged)
    for rows in (fast, slow):
        rows.add(("Mul", "Default_Mul-op0", 5), "input", 3, plain)
        feed(rows, [("input", (tagged, plain, tagged)), ("output", (plain,))])
        rows.add(("Mul", "Default_Mul-op9", 9), "output", 0, tagged)
    text = same_text(fast, slow)
    assert len(fast) == len(slow) == 6 and len(fast._rows) == 3  # its Python rows: the subclass's three
    assert [line.split(",")[6] for line in text.splitlines()[1:]] == ["3", "0", "1", "2", "0", "0"]
    fast.clear()
    assert len(fast) == 0 and fast.text() == fast.header + "\n"


def test_threads_adding_rows_at_once_keep_each_row_once(monkeypatch):
    """Tensors handed to Python from several threads: each thread appends its own row, while a large buffer is read
    with the GIL released and another thread's Python code runs (once, every line was claimed by two threads)."""
    monkeypatch.setattr(sys, "getswitchinterval", sys.getswitchinterval)
    sys.setswitchinterval(1e-6)
    try:
        rows, threads_n, calls = StatisticRows(("max", "min")), 4, 40
        tagged = [torch.randn(50_000).as_subclass(Tagged) for _ in range(threads_n)]
        plain = [torch.randn(300_000) for _ in range(threads_n)]  # read with the GIL released

        def work(k):
            for i in range(calls):
                rows.add_values(("Op", f"T{k}_Op-op{i}", 1_700_000_000_000_000 + i), "input", (tagged[k], plain[k]))

        threads = [threading.Thread(target=work, args=(k,)) for k in range(threads_n)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(0.005)
    lines = rows.text().splitlines()[1:]
    assert len(rows) == len(lines) == 2 * threads_n * calls and len(rows._rows) == threads_n * calls
    assert len(set(lines)) == len(lines)
    for k in range(threads_n):  # each op's two rows, the Python one first, under its own name
        mine = [line.split(",") for line in lines if line.split(",")[1].startswith(f"T{k}_")]
        assert [(f[1], f[6]) for f in mine] == [(f"T{k}_Op-op{i}", slot) for i in range(calls) for slot in "01"]


def test_the_native_recorder_refuses_a_malformed_op_or_io():
    rows = StatisticRows(("max",))
    for op, io in [(("Op", "x"), "input"), ((1, "x", 1), "input"), (("Op", "x", "soon"), "input"),
                   (("Op", "x", 1), "in"), (("Op", "x", 1), None)]:
        with pytest.raises(TypeError):
            rows.native.add_values(op, io, (torch.ones(1),))
    assert len(rows) == 0


def test_a_hash_category_and_the_switch_keep_the_python_path(monkeypatch):
    assert StatisticRows(("md5", "max")).native is None
    monkeypatch.setenv("OBS_NATIVE_DUMP", "0")
    assert StatisticRows(("max",)).native is None


def test_a_failing_python_path_raises_through_the_native_recorder():
    rows = StatisticRows(("max",))
    assert rows.native is not None

    class Broken(torch.Tensor):
        @property
        def dtype(self):
            raise RuntimeError("no dtype here")

    with pytest.raises(RuntimeError, match="no dtype here"):
        rows.add_values(("Op", "x", 1), "input", (torch.randn(2).as_subclass(Broken),))
    with pytest.raises(TypeError):
        rows.native.add_values(("Op", "x", 1), "input")
    with pytest.raises(TypeError, match="was not called"):
        type(rows.native).__new__(type(rows.native)).add_values(("Op", "x", 1), "input", ())


def test_nested_tensors_take_the_python_path():
    fast, slow = pair(("max", "min"))
    nested = torch.nested.nested_tensor([torch.randn(2), torch.randn(3)])
    for rows in (fast, slow):
        feed(rows, [("output", (nested, torch.ones(2)))])
    assert same_text(fast, slow).count("\n") == 2  # the nested tensor has no row (no strided values to read)


def test_a_whole_dump_writes_the_same_statistic_csv_on_both_paths(tmp_path, monkeypatch):
    def dump(folder):
        cfg = {"common_dump_settings": {
            "dump_mode": 0, "path": str(folder), "net_name": "Net", "iteration": "0-1", "saved_data": "statistic",
            "input_output": 0, "kernels": [], "support_device": [0], "statistic_category": list(ALL)}}
        (tmp_path / "env.json").write_text(__import__("json").dumps({"dump": cfg}))
        obs.set_context(env_config_path=str(tmp_path / "env.json"))
        consumers = [getattr(h, "__qualname__", "") for h in bus.handlers(Event.OP_OUTPUT)]
        try:
            torch.manual_seed(0)
            net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                                      torch.nn.Flatten(), torch.nn.Linear(36, 2))
            opt = torch.optim.SGD(net.parameters(), lr=0.1)
            for _ in range(2):
                torch.nn.functional.cross_entropy(net(torch.randn(4, 3, 8, 8)), torch.tensor([0, 1, 1, 0])).backward()
                opt.step()
                opt.zero_grad()
        finally:
            obs.reset_context()
            tracker.reset()
        texts = []
        for iteration in ("0", "1"):
            lines = (folder / "rank_0" / "Net" / "0" / iteration / "statistic.csv").read_text().splitlines()
            texts.append([",".join(line.split(",")[:4] + line.split(",")[5:]) for line in lines])  # no timestamps
            stamps = [int(line.split(",")[4]) for line in lines[1:]]
            assert stamps == sorted(stamps)  # one stamp per op, increasing (parameters' rows first)
        for name in ("ms_execution_order_graph_0.csv", "ms_global_execution_order_graph_0.csv"):
            texts.append((folder / "rank_0" / "execution_order" / name).read_text())
        return consumers, texts

    (native_by,), native = dump(tmp_path / "native")
    monkeypatch.setenv("OBS_NATIVE_DUMP", "0")
    (python_by,), python = dump(tmp_path / "python")
    assert (native_by, python_by) == ("Rows.on_op", "DataDump._on_op")  # each path did consume the ops
    assert native == python
    assert len(native[1]) > 40
    assert any(",Gradients_" in line for line in native[1])  # backward ops, named after their forward modules
    assert any(line.startswith("Parameter,") for line in native[1])
    assert "Gradients/Default/net-Sequential/0-Conv2d/ConvolutionBackward-op" in native[2]
    assert native[3] == "0\n1\n"


def test_the_native_op_consumer_needs_its_state_and_records_only_while_active():
    rows = StatisticRows(("max",))
    t = torch.ones(2)
    assert rows.native.on_op("add.Tensor", (t, t), {}, t) is None  # not active: nothing
    rows.native.active = True
    with pytest.raises(TypeError, match="name_ops were not called"):
        rows.native.on_op("add.Tensor", (t, t), {}, t)
    with pytest.raises(TypeError):
        rows.native.on_op("add.Tensor", (t, t), {})
    with pytest.raises(ValueError):
        rows.native.count = -1


def test_without_a_compiler_the_dump_says_why_once_and_records_in_python(tmp_path, monkeypatch, caplog):
    import logging

    monkeypatch.setattr(native_rows.EXTENSION, "module", None)
    monkeypatch.setattr(native_rows.EXTENSION, "reason", None)
    monkeypatch.setenv("OBS_NATIVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger="obs"):
        first, second = StatisticRows(("max",)), StatisticRows(("max",))
    assert first.native is None and second.native is None
    assert "could not be built" in native_rows.unavailable_reason()
    said = [r.getMessage() for r in caplog.records if "native statistic recorder" in r.getMessage()]
    assert len(said) == 2 and "building" in said[0] and "recorded in Python" in said[1], said
    first.add_values(("Op", "x", 1), "output", (torch.tensor([2.0, -1.0]),))
    assert first.text().splitlines()[1].endswith(",2.0")


def test_dense_permutations_are_read_here_in_memory_order_as_python_reads_them(monkeypatch):
    handed_back = []
    real_row = StatisticRows._row  # the Python recorder's, and the C++ one's slow path
    monkeypatch.setattr(StatisticRows, "_row", lambda self, op, io, slot, t: handed_back.append(tuple(t.shape))
                        or real_row(self, op, io, slot, t))
    fast, slow = pair(ALL)
    torch.manual_seed(0)
    dense = [torch.randn(6, 5).t(), torch.randn(2, 3, 4).permute(2, 0, 1),
             torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last), torch.randn(1, 4, 1, 3).transpose(1, 3)]
    gapped = [torch.randn(6, 5)[:, 1:], torch.randn(4, 4)[::2]]  # not dense: a copy, in Python
    ops = [("output", (v,)) for v in dense + gapped]
    for rows in (fast, slow):
        feed(rows, ops)
    same_text(fast, slow)
    # The C++ recorder handed back the gapped ones only; the Python recorder then took all six itself.
    assert handed_back == [(6, 4), (2, 4)] + [tuple(v.shape) for v in dense + gapped]


class Swapped(torch.nn.Module):
    """Two linears, called in the other order from the second step: the same ops at the same positions."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        first, second = (self.a, self.b) if self.calls == 1 else (self.b, self.a)
        return second(first(x))


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_an_op_at_the_same_position_in_another_module_is_named_after_that_module(tmp_path, monkeypatch, native):
    if not native:
        monkeypatch.setenv("OBS_NATIVE_DUMP", "0")
    cfg = {"common_dump_settings": {"dump_mode": 0, "path": str(tmp_path / "d"), "net_name": "Net",
                                    "iteration": "0-1", "saved_data": "statistic", "input_output": 2, "kernels": [],
                                    "support_device": [0], "statistic_category": ["max"]}}
    (tmp_path / "env.json").write_text(__import__("json").dumps({"dump": cfg}))
    obs.set_context(env_config_path=str(tmp_path / "env.json"))
    try:
        net = Swapped()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)  # its step ends each training step
        for _ in range(2):
            net(torch.randn(2, 4)).sum().backward()
            opt.step()
    finally:
        obs.reset_context()
        tracker.reset()
    for iteration, (first, second) in (("0", ("a", "b")), ("1", ("b", "a"))):
        lines = (tmp_path / "d" / "rank_0" / "Net" / "0" / iteration / "statistic.csv").read_text().splitlines()
        names = [line.split(",")[1] for line in lines[1:]]
        # the names are escaped: "/" reads "_"
        assert [n for n in names if "Addmm" in n] == [f"Default_net-Swapped_{first}-Linear_Addmm-op1",
                                                      f"Default_net-Swapped_{second}-Linear_Addmm-op3"], names
        grads = [n for n in names if n.startswith("Gradients_") and "_Mm-" in n]
        assert grads[0].startswith(f"Gradients_Default_net-Swapped_{second}-Linear_Mm-op"), grads
        assert grads[-1].startswith(f"Gradients_Default_net-Swapped_{first}-Linear_Mm-op"), grads
