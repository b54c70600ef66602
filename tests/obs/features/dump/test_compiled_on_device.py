"""The statistics of compiled graphs kept on their device until the step's end (issue 31), driven on the CPU.

On CUDA ``obs::graph_stats`` hands GRAPH_STATS its values still on the device (``DeviceRows``); the data dump and the
NaN check put them into the step's device batch, read after the step by their poller.  Here
``_graph_taps.DEFER_CPU`` sends CPU values down that path, and a "graph" is the two custom ops called as Inductor's
code calls them, around a table of statistics computed eagerly: no Inductor compile, same events.  What the step
reads back on the training thread is counted (never timed), and the files must be the immediate path's.
"""

from __future__ import annotations

import csv
import functools
import json

import pytest
import torch

import obs
from obs._core.demands import demands
from obs._core.events import Event, bus
from obs._core.internal import suppressed
from obs.features.dump.feature import feature
from obs.features.dump.nan import check as nan_check
from obs.features.dump.nan.check import NonFiniteError
from obs.features.dump.nan.device_flags import DeviceFlags
from obs.runtime.steps import tracker
from obs.runtime.torch import _graph_taps
from tests.obs.features.dump.nan.test_device_flags import ReadBacks

NAN, INF = float("nan"), float("inf")


def column(t: torch.Tensor, name: str) -> torch.Tensor:
    """One graph column of ``t`` (obs.runtime.torch._graph_taps.COLUMNS), as the graph's reductions compute it."""
    finite = torch.isfinite(t)
    return {"max": lambda: torch.where(finite, t, -INF).amax(), "min": lambda: torch.where(finite, t, INF).amin(),
            "sum": lambda: torch.where(finite, t, 0.0).sum(), "finite": lambda: finite.sum().float(),
            "l2norm": lambda: (t * t).sum().sqrt(), "nan": lambda: t.isnan().sum().float(),
            "pos_inf": lambda: (t == INF).sum().float(), "neg_inf": lambda: (t == -INF).sum().float(),
            "zero": lambda: (t == 0).sum().float()}[name]()


def node(name: str, op: str, module: str, tensor: torch.Tensor) -> dict:
    stack = [["L['self']", "Net"]] + ([[f"L['self'].{module}", module.capitalize()]] if module else [])
    return {"node": name, "op": op, "stack": stack, "dtype": str(tensor.dtype), "shape": [str(d) for d in tensor.shape]}


def graph(bad: bool = False, backward: bool = False) -> tuple[dict, list[torch.Tensor]]:
    """A graph's spec (its columns filled in at the call) and the tensors of its nodes; ``bad``: NaN and -Inf in the
    second node, +Inf in the third."""
    g = torch.Generator().manual_seed(1)
    with suppressed():  # the graph's own values: no op of the step
        tensors = [torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g).relu(),
                   torch.randn(4, 2, generator=g)]
        if bad:
            tensors[1][0, :3], tensors[1][1, 1] = NAN, -INF
            tensors[2][2, 0] = INF
    nodes = [node("addmm", "aten.addmm.default", "fc1", tensors[0]),
             node("relu", "aten.relu.default", "", tensors[1]),
             node("addmm_1", "aten.addmm.default", "fc2", tensors[2])]
    return {"backward": backward, "device": "cpu", "columns": [], "rows": nodes}, tensors


def run_graph(spec: dict, tensors: list[torch.Tensor]) -> None:
    """The graph's custom ops, as Inductor's code calls them: its start, a tap per node, its statistics."""
    columns, _ = _graph_taps.wanted()
    spec = {**spec, "columns": list(columns)}
    with _graph_taps._lock:
        spec_id = len(_graph_taps._specs)
        _graph_taps._specs.append(spec)
    with suppressed():  # the graph's own allocation: no op of the step
        anchor = torch.empty(0)
    torch.ops.obs.graph_begins(anchor, spec_id)
    mask = sum(1 << _graph_taps.COLUMNS.index(c) for c in columns)
    rows = [torch.ops.obs.tap_stats(t, mask) for t in tensors]
    torch.ops.obs.graph_stats(rows, spec_id)
    with suppressed():
        for row in rows:
            row.fill_(-7.0)  # the graph's buffers, reused once the op returned: what the features keep must not change


def arm(tmp_path, sections: dict) -> None:
    path = tmp_path / "env.json"
    tmp_path.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(sections))
    obs.set_context(env_config_path=str(path))


@pytest.fixture
def defer(monkeypatch):
    """Whether CPU graphs' statistics stay on their device (as CUDA ones do); the training thread's read-backs are
    counted from then on."""
    monkeypatch.setenv("OBS_NATIVE_DUMP", "0")

    def on(deferred: bool) -> ReadBacks:
        monkeypatch.setattr(_graph_taps, "DEFER_CPU", deferred)
        return ReadBacks(monkeypatch)

    yield on
    obs.reset_context()
    tracker.reset()


def test_a_tap_computes_its_tensors_columns_on_its_device(monkeypatch):
    monkeypatch.setattr(_graph_taps, "_listening", [True])
    for t in graph(bad=True)[1] + [torch.tensor([[0.0, -2.5], [NAN, INF]], dtype=torch.bfloat16)]:
        for columns in (_graph_taps.COLUMNS, ("nan", "pos_inf", "neg_inf"), ("l2norm",)):
            mask = sum(1 << _graph_taps.COLUMNS.index(c) for c in columns)
            with suppressed():
                want = torch.stack([column(t.float(), c) for c in columns])
            got = torch.ops.obs.tap_stats(t, mask)
            assert got.dtype == torch.float32 and got.device == t.device
            torch.testing.assert_close(got, want, equal_nan=True)


def test_a_row_whose_tensor_inductor_never_stored_is_left_out(monkeypatch):
    """A tapped value Inductor keeps inside its readers' loops has no row: neither in the spec given nor in the
    values (its NaN placeholder would read as NaN counts)."""
    monkeypatch.setitem(demands.graph_stats, "test", (frozenset(("nan", "pos_inf", "neg_inf")), True))
    monkeypatch.setattr(_graph_taps, "_listening", [True])
    spec, tensors = graph(bad=True)
    columns, _ = _graph_taps.wanted()
    with _graph_taps._lock:
        spec_id = len(_graph_taps._specs)
        _graph_taps._specs.append({**spec, "columns": list(columns)})
    _graph_taps.mark_absent(spec_id, 1)
    mask = sum(1 << _graph_taps.COLUMNS.index(c) for c in columns)
    rows = [torch.ops.obs.tap_stats(t, mask) for t in tensors]
    rows[1] = torch.full_like(rows[1], NAN)
    got = []
    sub = bus.subscribe(Event.GRAPH_STATS, lambda spec, rows: got.append((spec, rows)))
    try:
        torch.ops.obs.graph_stats(rows, spec_id)
    finally:
        sub.remove()
    (published, values), = got
    assert [r["node"] for r in published["rows"]] == ["addmm", "addmm_1"]
    assert values == [[0.0, 0.0, 0.0], [0.0, 1.0, 0.0]]  # nan, pos_inf, neg_inf of the first and the third


def test_graph_stats_emits_a_copy_on_the_device_and_reads_nothing(monkeypatch):
    monkeypatch.setattr(_graph_taps, "DEFER_CPU", True)
    monkeypatch.setitem(demands.graph_stats, "test", (frozenset(_graph_taps.COLUMNS), True))
    monkeypatch.setattr(_graph_taps, "_listening", [True])
    got = []
    sub = bus.subscribe(Event.GRAPH_STATS, lambda spec, rows: got.append(rows))
    try:
        reads = ReadBacks(monkeypatch)
        run_graph(*graph(bad=True))
    finally:
        sub.remove()
    assert reads.count == 0
    begins, rows = got
    assert begins is None and isinstance(rows, _graph_taps.DeviceRows)
    k = rows.width
    assert k == len(rows.values) // 3 and (rows.values != -7.0).all()  # a copy: the graph's buffer was overwritten
    flat = rows.values.tolist()
    assert repr(rows.split(flat)) == repr([flat[0:k], flat[k:2 * k], flat[2 * k:]]) == repr(rows.read())  # NaN


# -- the data dump ----------------------------------------------------------------------------------------------------
CATEGORIES = ["max", "min", "avg", "count", "l2norm", "nan count", "positive inf count", "negative inf count",
              "zero count", "positive zero count", "md5"]


def dump_rows(tmp_path, defer, deferred: bool) -> tuple[list[list[str]], int]:
    arm(tmp_path, {"dump": {"common_dump_settings": {
        "dump_mode": 0, "path": str(tmp_path / "dump"), "net_name": "Net", "iteration": "all",
        "saved_data": "statistic", "input_output": 0, "kernels": [], "support_device": [0],
        "statistic_category": CATEGORIES}}})
    reads, during = defer(deferred), []
    for step in range(3):
        with obs.step():
            run_graph(*graph(bad=step == 1))
            run_graph(*graph(backward=True))
            during.append(reads.count)  # before the step's end
    assert feature.data.flush(30)
    obs.reset_context()
    tracker.reset()
    out: list[list[str]] = []
    for step in range(3):
        with open(tmp_path / "dump" / "rank_0" / "Net" / "0" / str(step) / "statistic.csv", newline="") as f:
            out += [r[:4] + r[5:] for r in list(csv.reader(f))[1:]]  # without the µs
    return out, during[-1]


def test_the_dump_of_a_graph_on_the_device_writes_the_immediate_paths_rows_after_the_step(tmp_path, defer):
    want, immediate_reads = dump_rows(tmp_path / "now", defer, False)
    got, reads = dump_rows(tmp_path / "later", defer, True)
    assert immediate_reads == 6 and reads == 0  # one tolist per graph call before; none now
    assert got == want and len(got) == 18
    fixed = ["Op Type", "Op Name", "Task ID", "Stream ID", "IO", "Slot", "Data Size", "Data Type", "Shape"]
    bad = dict(zip(fixed + CATEGORIES, got[7]))  # step 1's relu: 3 NaN, one -Inf
    assert (bad["Op Name"], bad["IO"], bad["Shape"]) == ("Default_Relu-op1", "output", "(4,8)")
    assert (bad["nan count"], bad["negative inf count"], bad["l2norm"], bad["md5"]) == ("3", "1", "nan", "null")
    assert (bad["count"], bad["positive zero count"]) == ("32", "null")  # what a graph does not compute: null
    assert got[3][1] == "Gradients_Default_fc1-Fc1_Addmm-op3"


# -- the NaN check ----------------------------------------------------------------------------------------------------
def nan_findings(tmp_path, defer, deferred: bool, **section) -> tuple[list[dict], int]:
    arm(tmp_path, {"nan_check": {"enable": True, "path": str(tmp_path), "granularity": "op", **section}})
    reads, during = defer(deferred), []
    with obs.step():
        run_graph(*graph())
    with obs.step():
        run_graph(*graph(bad=True))
        during.append(reads.count)
        run_graph(*graph(bad=True, backward=True))  # a second finding of the step: not reported
    assert feature.nan.flush(30)
    obs.reset_context()
    tracker.reset()
    root = tmp_path / "rank_0" / "nan_check"
    found = [json.loads((d / "meta.json").read_text()) for d in sorted(root.iterdir())]
    for meta in found:
        meta.pop("python_stack")  # the training thread's, where the graph ran: none after the step
    return found, during[-1]


def test_the_check_of_a_graph_on_the_device_finds_the_immediate_paths_finding_after_the_step(tmp_path, defer):
    want, immediate_reads = nan_findings(tmp_path / "now", defer, False)
    got, reads = nan_findings(tmp_path / "later", defer, True)
    assert immediate_reads == 2 and reads == 0  # one tolist per graph call before; none now
    assert got == want and len(got) == 1
    [found] = got
    assert (found["phase"], found["scope"], found["op"], found["step"]) == ("forward", "Default", "Relu", 2)
    assert (found["nan"], found["pos_inf"], found["neg_inf"]) == (3, 0, 1)  # exact: the graph counted them


def test_the_first_bad_place_of_the_step_is_found_in_the_order_things_ran(tmp_path, defer, monkeypatch):
    monkeypatch.setattr(nan_check, "DeviceFlags", functools.partial(DeviceFlags, cpu=True))
    arm(tmp_path, {"nan_check": {"enable": True, "path": str(tmp_path), "granularity": "op"}})
    defer(True)
    check = feature.nan
    flags = check.flags
    assert isinstance(flags, DeviceFlags)
    with suppressed():
        early = torch.tensor([1.0, INF])
    with obs.step():  # a tensor gated on the device before the graph ran: it comes first
        flags.check(early, tracker.step, ("forward", "op", "Default/early", "mul.Tensor", "output"))
        run_graph(*graph(bad=True))
    assert check.flush(30)
    [folder] = sorted((tmp_path / "rank_0" / "nan_check").iterdir())
    assert json.loads((folder / "meta.json").read_text())["scope"] == "Default/early"


def test_raise_comes_on_the_training_thread_at_the_next_check(tmp_path, defer):
    arm(tmp_path, {"nan_check": {"enable": True, "path": str(tmp_path), "granularity": "op", "action": "raise"}})
    defer(True)
    with obs.step():
        run_graph(*graph(bad=True))  # no raise here: read after the step
    assert feature.nan.flush(30)
    with pytest.raises(NonFiniteError, match=r"Relu .*3 NaN, 0 \+Inf, 1 -Inf"):
        torch.ones(2) * 2  # the next op checked on this thread


def test_sync_reads_the_graph_where_it_runs(tmp_path, defer):
    arm(tmp_path, {"nan_check": {"enable": True, "path": str(tmp_path), "granularity": "op", "sync": True}})
    reads = defer(True)
    seen = []
    with obs.step():
        run_graph(*graph(bad=True))
        seen.append(reads.count)
    assert seen == [1]  # DeviceRows.read: the check asked for a sync
    [folder] = sorted((tmp_path / "rank_0" / "nan_check").iterdir())
    meta = json.loads((folder / "meta.json").read_text())
    assert (meta["nan"], meta["neg_inf"], meta["step"], meta["python_stack"] != []) == (3, 1, 1, True)
