"""statistic.csv's statistics kept on the device until the step's end (obs/features/dump/stats/device_stats.py), and
the tensor files copied through pinned memory (pinned_files.py), driven on CPU tensors (``cpu=True``) as on CUDA ones.

The device path computes without a branch on the data: its values must be the torch path's (tensor_stats.statistics),
and a data dump through it must write the same files as one that reads each tensor as its op returns.
"""

from __future__ import annotations

import csv
import functools
import json
import math
import os

import numpy as np
import pytest
import torch

import obs
from obs.features.dump import data_dump, pinned_files
from obs.features.dump.pinned_files import PinnedFiles
from obs.features.dump.stats import statistic_csv, tensor_stats
from obs.features.dump.stats.device_stats import DeviceStats, reductions, statistics_of
from obs.runtime.device_readback import Poller
from obs.runtime.steps import tracker
from tests.obs.features.dump.nan.test_device_flags import ReadBacks
from tests.obs.features.dump.test_data_dump import Net

ALL = ("max", "min", "avg", "count", "l2norm", "nan count", "positive inf count", "negative inf count",
       "zero count", "positive zero count", "negative zero count")
NAN, INF = float("nan"), float("inf")


def on_device(tensor, categories=ALL):
    names, values, n, floating, repeat = reductions(tensor, frozenset(categories))
    read = dict(zip(names, (v.item() for v in values)))
    got = statistics_of(read, n, floating, repeat)
    return {c: got[c] for c in categories}


def torch_path(tensor, categories=ALL, monkeypatch=None):
    saved, tensor_stats.native = tensor_stats.native, None
    try:
        return dict(zip(categories, tensor_stats.compile_statistics(tuple(categories))(tensor)))
    finally:
        tensor_stats.native = saved


def agree(got, want):
    assert got.keys() == want.keys()
    for key, value in want.items():
        if value is None or isinstance(value, int):
            assert got[key] == value and type(got[key]) is type(value), key
        elif math.isnan(value):
            assert math.isnan(got[key]), key
        else:
            assert got[key] == pytest.approx(value, rel=2e-3, abs=1e-6), key


TENSORS = {
    "float32": torch.randn(5, 7, generator=torch.Generator().manual_seed(0)),
    "with NaN and Inf": torch.tensor([1.0, NAN, -2.0, INF, INF, -INF, 0.0, -0.0]),
    "no finite element": torch.tensor([NAN, INF, -INF]),
    "float16": torch.tensor([1.5, -3.0, 0.0, 65504.0], dtype=torch.float16),
    "bfloat16 with NaN": torch.tensor([1.0, NAN, -7.0], dtype=torch.bfloat16),
    "float64": torch.tensor([1e300, -1e300, 3.0], dtype=torch.float64),
    "int64": torch.tensor([3, -4, 0, 0, 9]),
    "uint8": torch.tensor([0, 255, 7], dtype=torch.uint8),
    "bool": torch.tensor([True, False, True]),
    "complex": torch.tensor([3 + 4j, 0j, complex(NAN, 0)]),
    "empty": torch.empty(0, 3),
    "expanded": torch.tensor([[1.0, -2.0, NAN]]).expand(4, 3),
    "transposed": torch.arange(12.0).reshape(3, 4).t(),
}


@pytest.mark.parametrize("name", TENSORS)
def test_the_device_values_are_the_torch_paths(name):
    tensor = TENSORS[name]
    agree(on_device(tensor), torch_path(tensor))


@pytest.mark.parametrize("categories", [("max",), ("avg",), ("l2norm", "min"), ("nan count", "avg"),
                                        ("negative zero count",)])
def test_only_what_the_categories_need_is_reduced(categories):
    tensor = TENSORS["with NaN and Inf"]
    names, *_ = reductions(tensor, frozenset(categories))
    assert len(names) <= 4
    agree(on_device(tensor, categories), torch_path(tensor, categories))


def test_records_get_their_values_and_text_after_send(tmp_path):
    device = DeviceStats(("max", "nan count"), cpu=True)
    try:
        a = device.record(torch.tensor([1.0, NAN]), torch.float32, (2,))
        b = device.record(torch.tensor([3.0]), torch.float32, (1,))
        assert a[0] == [] and a[3] == "\x000\x00" and b[3] == "\x001\x00" and len(device) == 2
        written = []
        device.send(f"x,{a[3]}\ny,{b[3]}\n", lambda r: f"<{r[0][0]}|{r[0][1]}>", written.append)
        assert len(device) == 0
        device.flush()
        assert written == ["x,<1.0|1>\ny,<3.0|0>\n"] and a[0] == [1.0, 1] and a[3] == "<1.0|1>"
    finally:
        device.close()


def test_pinned_files_are_written_after_send(tmp_path, monkeypatch):
    poller = Poller("test-files")
    files = PinnedFiles(poller, cpu=True)
    try:
        t = torch.arange(6.0).reshape(2, 3)
        files.add(str(tmp_path / "a.npy"), t)
        t.add_(100)  # what the op left is written, not what came later
        assert not (tmp_path / "a.npy").exists()
        files.send()
        poller.drain()
        assert np.load(tmp_path / "a.npy").tolist() == [[0, 1, 2], [3, 4, 5]]
        monkeypatch.setattr(pinned_files, "BATCH_BYTES", 10)  # a big step hands its files over before its end
        files.add(str(tmp_path / "b.npy"), torch.ones(4))
        poller.drain()
        assert (tmp_path / "b.npy").exists()
    finally:
        poller.close()


# -- a data dump through the device path ------------------------------------------------------------------------------
def dump(tmp_path, saved_data, categories=ALL, check_reads=None):
    cfg = {"dump": {"common_dump_settings": {
        "dump_mode": 0, "path": str(tmp_path / "dump"), "net_name": "Net", "iteration": "all",
        "saved_data": saved_data, "input_output": 0, "kernels": [], "support_device": [0],
        "statistic_category": list(categories)}}}
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "env.json").write_text(json.dumps(cfg))
    obs.set_context(env_config_path=str(tmp_path / "env.json"))
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(3, 4)
        if step == 1:
            x[0, 0], x[1, 1] = INF, NAN  # rows with NaN and Inf, counted and left out of max/min/avg
        net(x).sum().backward()
        if check_reads is not None:
            check_reads()
        opt.step()
        opt.zero_grad()
    obs.reset_context()
    tracker.reset()  # the next dump's iterations count from 0 again
    return tmp_path / "dump" / "rank_0" / "Net" / "0"


def rows(folder):
    out = []
    for step in ("0", "1", "2"):
        with open(folder / step / "statistic.csv") as fh:
            out += list(csv.reader(fh))[1:]
    return out


@pytest.fixture
def device_path(monkeypatch):
    def on():
        monkeypatch.setattr(statistic_csv, "DeviceStats", functools.partial(DeviceStats, cpu=True))
        monkeypatch.setattr(data_dump, "PinnedFiles", functools.partial(PinnedFiles, cpu=True))
    return on


@pytest.mark.parametrize("categories", [ALL, ("max", "min", "l2norm", "md5")], ids=["all", "with-hash"])
def test_a_statistic_dump_through_the_device_writes_what_the_torch_path_does(tmp_path, monkeypatch, device_path,
                                                                              categories):
    monkeypatch.setattr(tensor_stats, "native", None)  # the torch path: the values the device path computes too
    want = rows(dump(tmp_path / "now", "statistic", categories))
    device_path()
    reads = ReadBacks(monkeypatch)
    recorded = []  # tensors whose statistics were taken as their op returned
    taken = statistic_csv.compile_statistics
    monkeypatch.setattr(statistic_csv, "compile_statistics", lambda c: lambda t: recorded.append(t) or taken(c)(t))

    def no_reads():
        assert reads.count == 0 and recorded == []  # nothing read on this thread while the step runs

    got = rows(dump(tmp_path / "later", "statistic", categories, no_reads))
    assert len(got) == len(want) > 60
    assert categories != ALL or any(r[10 + ALL.index("nan count")] == "1" for r in got)
    for a, b in zip(got, want):
        assert a[:4] == b[:4] and a[5:10] == b[5:10]  # names, io, slot, size, dtype, shape (not the µs)
        for x, y in zip(a[10:], b[10:]):
            assert x == y or float(x) == pytest.approx(float(y), rel=1e-5, abs=1e-7)


def test_a_tensor_dump_through_pinned_copies_writes_the_same_files(tmp_path, device_path):
    want = dump(tmp_path / "now", "full", ("max", "min"))
    device_path()
    got = dump(tmp_path / "later", "full", ("max", "min"))
    for step in ("0", "1", "2"):
        names = sorted(os.listdir(want / step))
        strip = [n.split(".")[:2] + n.split(".")[5:] for n in names]  # without the µs
        later = sorted(os.listdir(got / step))
        assert [n.split(".")[:2] + n.split(".")[5:] for n in later] == strip
        for a, b in zip(names, later):
            if a.endswith(".npy"):
                assert (want / step / a).read_bytes() == (got / step / b).read_bytes(), a


def test_the_cpp_recorders_rows_keep_the_token_until_the_values_come():
    rows = statistic_csv.StatisticRows(("max", "min"))
    if rows.native is None:
        pytest.skip(f"the C++ recorder is not built here: {statistic_csv.native_rows.unavailable_reason()}")
    rows.device = DeviceStats(("max", "min"), cpu=True)
    op = ("Mul", "Default_Mul-op0", 7)
    try:
        # a dense tensor is the recorder's own; a negative view goes to Python, here to the device path
        rows.add_values(op, "input", (torch.tensor([1.0, 2.0]), torch._neg_view(torch.tensor([3.0, -5.0]))))
        assert len(rows.device) == 1
        written = []
        rows.write_text(written.append)
        rows.clear()
        rows.flush()
    finally:
        rows.close()
    assert written == [rows.header + "\n" + 'Mul,Default_Mul-op0,0,0,7,input,0,8,float32,"(2)",2.0,1.0\n'
                       'Mul,Default_Mul-op0,0,0,7,input,1,8,float32,"(2)",5.0,-3.0\n']
