"""The NaN/Inf check's gates kept on the device (obs/features/dump/nan/device_flags.py), driven on CPU tensors.

On CUDA the check reads a step's gates once, after the step, off the training thread; here ``cpu=True`` sends CPU
tensors down the same path.  No read-back may happen before the step's end: the tests count ``tolist``/``item``.
"""

from __future__ import annotations

import functools
import json
import math
import threading

import pytest
import torch

import obs
from obs.features.dump.feature import feature
from obs.features.dump.nan import check as nan_check
from obs.features.dump.nan import device_flags
from obs.features.dump.nan.check import NanCheck, NonFiniteError
from obs.features.dump.nan.device_flags import DeviceFlags
from obs.features.dump.nan.findings import kinds
from tests.obs.features.dump.nan.test_check import Net, fault_folders, train_step

NAN, INF = float("nan"), float("inf")


class ReadBacks:
    """Counts the host reads of tensors (``tolist``, ``item``) made on the thread that created it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count, thread = 0, threading.get_ident()
        for name in ("tolist", "item"):
            original = getattr(torch.Tensor, name)

            def counted(tensor, *args, _original=original):
                if threading.get_ident() == thread:
                    self.count += 1
                return _original(tensor, *args)

            monkeypatch.setattr(torch.Tensor, name, counted)


class Recorder:
    """A ``found`` callback: what the walk reported, in order; stops after ``stop_after`` findings."""

    def __init__(self, stop_after: int = 0) -> None:
        self.found: list[tuple[int, str, float, float]] = []
        self.threads: set[int] = set()
        self.stop_after = stop_after

    def __call__(self, step: int, label: str, low: float, high: float) -> bool:
        self.found.append((step, label, low, high))
        self.threads.add(threading.get_ident())
        return not self.stop_after or len(self.found) < self.stop_after


@pytest.fixture
def flags():
    made: list[DeviceFlags] = []

    def make(**kw):
        made.append(DeviceFlags(kw.pop("found"), cpu=True, **kw))
        return made[-1]

    yield make
    for f in made:
        f.close()


def test_no_read_back_until_the_step_ends_then_the_bad_ones_in_order(flags, monkeypatch):
    seen = Recorder()
    f = flags(found=seen)
    reads = ReadBacks(monkeypatch)
    for label, value in (("a", 1.0), ("b", NAN), ("c", 2.0), ("d", -INF)):
        assert f.check(torch.full((3, 2), value), 1, label)
    assert (reads.count, f.reads, f.pending, seen.found) == (0, 0, 4, [])
    f.flush()
    assert f.reads == 1 and f.pending == 0
    assert [(s, label) for s, label, _, _ in seen.found] == [(1, "b"), (1, "d")]
    assert seen.threads == {f.poller._thread.ident} != {threading.get_ident()}  # walked off this thread


def test_each_step_is_walked_on_its_own(flags):
    seen = Recorder()
    f = flags(found=seen)
    f.check(torch.tensor([NAN]), 1, "a")
    f.check(torch.ones(2), 1, "b")
    f.end_step()
    f.check(torch.ones(2), 2, "a")  # the slot that was bad in step 1 is fine in step 2
    f.check(torch.tensor([1.0, INF]), 2, "b")
    f.end_step()
    f.check(torch.ones(2), 3, "a")
    f.flush()
    assert [(s, label) for s, label, _, _ in seen.found] == [(1, "a"), (2, "b")]
    assert f.reads == 3


def test_the_walk_stops_when_told(flags):
    seen = Recorder(stop_after=1)
    f = flags(found=seen)
    for label in "abc":
        f.check(torch.tensor([NAN]), 1, label)
    f.flush()
    assert [label for _, label, _, _ in seen.found] == ["a"]


def test_what_is_not_gated_on_the_device(flags):
    f = flags(found=Recorder())
    assert f.check(torch.arange(3), 1, "integers")  # nothing to check
    assert f.check(torch.empty(0), 1, "empty")
    assert f.pending == 0 and f.checks == 0
    assert not f.check(torch.ones(2).to_sparse(), 1, "sparse")  # left to the caller
    assert not DeviceFlags(Recorder()).check(torch.ones(2), 1, "cpu")  # CPU tensors, unless asked


def test_complex_and_half_tensors(flags):
    seen = Recorder()
    f = flags(found=seen)
    f.check(torch.tensor([1 + 1j, complex(0, INF)]), 1, "complex")
    f.check(torch.tensor([1.0, NAN], dtype=torch.bfloat16), 1, "bf16")
    f.check(torch.tensor([1.0, 2.0], dtype=torch.float16), 1, "fp16")
    f.flush()
    assert [label for _, label, _, _ in seen.found] == ["complex", "bf16"]
    assert kinds(*seen.found[0][2:]) == ["+Inf"] and kinds(*seen.found[1][2:]) == ["NaN"]


def test_gates_from_several_threads_keep_their_labels(flags):
    seen = Recorder()
    f = flags(found=seen)

    def work(k: int) -> None:
        for i in range(50):
            f.check(torch.tensor([NAN if i == k else 1.0]), 1, (k, i))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    f.flush()
    assert sorted(label for _, label, _, _ in seen.found) == [(k, k) for k in range(4)]


def test_a_loop_without_step_ends_sends_every_max_pending_checks(flags, monkeypatch):
    monkeypatch.setattr(device_flags, "MAX_PENDING", 3)
    seen = Recorder()
    f = flags(found=seen)
    for i in range(7):
        f.check(torch.tensor([NAN if i == 4 else 0.0]), 1, i)
    assert f.pending == 1
    f.poller.drain()
    assert [label for _, label, _, _ in seen.found] == [4] and f.reads == 2


def test_kinds_from_the_minimum_and_the_maximum():
    assert kinds(NAN, NAN) == ["NaN"]
    assert kinds(-INF, INF) == ["+Inf", "-Inf"]
    assert kinds(0.0, INF) == ["+Inf"]
    assert kinds(-math.inf, 1.0) == ["-Inf"]


# -- the check itself, its Python path (the C++ hooks read CPU tensors themselves) ------------------------------------
@pytest.fixture
def deferred(monkeypatch, tmp_path):
    """The NaN check armed through its settings, with CPU tensors gated as CUDA ones are."""
    monkeypatch.setenv("OBS_NATIVE_DUMP", "0")
    monkeypatch.setattr(nan_check, "DeviceFlags", functools.partial(DeviceFlags, cpu=True))

    def arm(**section):
        path = tmp_path / "cfg.json"
        path.write_text(json.dumps({"nan_check": {"enable": True, "path": str(tmp_path), **section}}))
        obs.set_context(env_config_path=str(path))
        assert isinstance(feature.nan, NanCheck) and feature.nan.flags is not None
        return feature.nan

    yield arm
    obs.reset_context()


def meta(tmp_path):
    [folder] = fault_folders(tmp_path)
    return json.loads((folder / "meta.json").read_text())


def test_a_forward_nan_is_named_after_the_step_without_a_read_back(deferred, tmp_path, monkeypatch):
    check = deferred()
    reads = ReadBacks(monkeypatch)
    immediate = []  # the check where the tensor is made (on the CPU a C pass: no tolist or item to count)
    monkeypatch.setattr(nan_check, "nonfinite_counts", lambda t: immediate.append(t))
    train_step(Net(forward_nan=True))
    assert (reads.count, immediate) == (0, []) and check.flags.checks > 0  # the poller reads, after the step
    check.flush()
    found = meta(tmp_path)
    assert (found["phase"], found["scope"], found["step"], found["where"]) == \
        ("forward", "Default/net-Net/poison-Poison", 1, "output")
    assert (found["nan"], found["found"], found["counted"]) == (None, ["NaN"], False)
    assert "not kept" in found["tensors"] and not list(fault_folders(tmp_path)[0].glob("*.npy"))


def test_a_backward_nan_is_found_at_the_first_gradient_that_holds_it(deferred, tmp_path):
    deferred()
    train_step(Net(backward_nan=True))
    obs.reset_context()  # what is in flight is still reported
    found = meta(tmp_path)
    assert (found["phase"], found["scope"], found["where"]) == ("backward", "Default/net-Net/fc1-Linear",
                                                                "gradient of the output")


def test_one_finding_per_step_and_the_flags_of_each_step_are_its_own(deferred, tmp_path):
    check = deferred()
    check.limit = 0  # every step's first (as op_debug_mode 3 with overflow_number 0)
    net = Net()
    for poisoned in (True, False, True):  # no update: the weights stay finite
        net.poison.forward_nan = poisoned
        with obs.step():
            net(torch.randn(3, 4)).sum().backward()
        net.zero_grad()
    check.flush()
    assert [(f["step"], f["scope"]) for f in check.findings] == [
        (1, "Default/net-Net/poison-Poison"), (3, "Default/net-Net/poison-Poison")]


def test_raise_comes_on_the_training_thread_at_the_next_check(deferred, tmp_path):
    check = deferred(action="raise")
    net = Net(forward_nan=True)
    train_step(net)  # the bad step itself goes on: its gates are read after it
    check.flush()
    net.poison.forward_nan = False
    with pytest.raises(NonFiniteError, match=r"poison-Poison \(step 1, output\): NaN") as info:
        train_step(net)
    assert info.value.folder == str(fault_folders(tmp_path)[0])


def test_op_granularity_gates_each_op_output(deferred, tmp_path):
    check = deferred(granularity="op")
    train_step(Net(forward_nan=True))
    check.flush()
    found = meta(tmp_path)
    assert (found["kind"], found["op"], found["scope"]) == ("op", "log.default", "Default/net-Net/poison-Poison")


def test_sync_checks_where_the_tensor_is_made(monkeypatch, tmp_path):
    monkeypatch.setenv("OBS_NATIVE_DUMP", "0")
    check = NanCheck(str(tmp_path), sync=True).install()
    try:
        assert check.flags is None
        train_step(Net(forward_nan=True))
    finally:
        check.remove()
    assert meta(tmp_path)["nan"] == 24


def test_the_poller_thread_stops_with_the_check(deferred, tmp_path):
    check = deferred()
    train_step(Net(forward_nan=True))
    thread = check.flags.poller._thread
    assert thread is not None and thread.name == "obs-nan-check"
    obs.reset_context()
    assert not thread.is_alive()


class Transposed(torch.nn.Module):
    """Outputs the C++ hook hands to Python (not contiguous), as it hands it every CUDA tensor."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.bad = False

    def forward(self, x):
        y = self.fc(x).t()
        return torch.log(-y.abs() - 1) if self.bad else y


def test_a_late_raise_reaches_the_training_thread_through_the_cpp_hook(monkeypatch, tmp_path):
    monkeypatch.setattr(nan_check, "DeviceFlags", functools.partial(DeviceFlags, cpu=True))
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"nan_check": {"enable": True, "path": str(tmp_path), "action": "raise"}}))
    obs.set_context(env_config_path=str(path))
    try:
        check = feature.nan
        if check._native is None:
            pytest.skip(f"the C++ hook is not built here: {nan_check.native_check.unavailable_reason()}")
        net = Transposed()
        net.bad = True
        with obs.step():
            net(torch.randn(3, 4))
        check.flush()
        assert check.done  # the limit is reached, yet the hook still calls Python for the raise
        net.bad = False
        with pytest.raises(NonFiniteError, match=r"at Default/net-Transposed \(step 1, output\)"), obs.step():
            net(torch.randn(3, 4))
    finally:
        obs.reset_context()
