"""The profiler's device time wired end to end on CPU, with CUDA's events and Kineto replaced by fakes: a session
times steps, phases and modules once "CUDA" is in use, writes memory peaks, captures an op_trace window's kernels,
and its trace has the device attributes and the GPU tracks.  Without CUDA nothing of it exists."""

from __future__ import annotations

import json
import threading
import time
from typing import ClassVar

import pytest
import torch

import obs
from obs import profiling
from obs.features.profiling import device_recording
from obs.runtime import device_time as runtime_device_time
from obs.runtime.steps import tracker
from tests.training import train

CPU, CUDA = torch._C._autograd.DeviceType.CPU, torch._C._autograd.DeviceType.CUDA


class HostEvent:
    """A CUDA event of a device that runs everything at once: its time is the host's when recorded."""

    asked: ClassVar[set[int]] = set()

    def record(self) -> None:
        self.t = time.perf_counter_ns()

    def query(self) -> bool:
        HostEvent.asked.add(threading.get_ident())
        return True

    def synchronize(self) -> None:
        HostEvent.asked.add(threading.get_ident())

    def elapsed_time(self, other: HostEvent) -> float:
        HostEvent.asked.add(threading.get_ident())
        return (other.t - self.t) / 1e6


class KinetoEvent:
    def __init__(self, device, name: str, start: int, duration: int, correlation: int) -> None:
        self._device, self._name, self._start, self._duration, self._corr = device, name, start, duration, correlation

    def device_type(self):
        return self._device

    def name(self) -> str:
        return self._name

    def start_ns(self) -> int:
        return self._start

    def duration_ns(self) -> int:
        return self._duration

    def correlation_id(self) -> int:
        return self._corr


class FakeKineto:
    """Kineto as the capture uses it: each ``launch`` while started is a kernel, run 5 µs after its launch."""

    def __init__(self) -> None:
        self.on, self.launches, self.starts = False, [], 0

    def start(self) -> None:
        self.on, self.starts = True, self.starts + 1

    def launch(self, name: str) -> None:
        if self.on:
            self.launches.append((time.time_ns(), name))

    def stop(self):
        self.on = False
        events = []
        for i, (t, name) in enumerate(self.launches, start=1):
            events += [KinetoEvent(CPU, "cudaLaunchKernel", t, 100, i), KinetoEvent(CUDA, name, t + 5_000, 2_000, i)]
        return type("Result", (), {"events": lambda self: events})()


@pytest.fixture
def fake_cuda(monkeypatch):
    kineto = FakeKineto()
    HostEvent.asked = set()
    monkeypatch.setattr(device_recording, "cuda_build", lambda: True)
    monkeypatch.setattr(device_recording, "cuda_in_use", lambda: True)
    monkeypatch.setattr(device_recording, "cuda_events", lambda: (HostEvent, lambda: False, kineto))
    return kineto


def train_launching_kernels(steps: int, kineto: FakeKineto | None = None) -> None:
    """``steps`` steps, each launching a fake kernel on ``kineto`` (when given) at its end."""
    train(steps, after=None if kineto is None else lambda n, loss: kineto.launch(f"gemm_step_{tracker.step}"))


def _trace(out) -> list[dict]:
    return json.loads((out / "rank_0" / "trace.json").read_text())


def test_a_session_on_cuda_times_steps_phases_and_modules_and_writes_the_gpu_tracks(tmp_path, monkeypatch, fake_cuda):
    out = tmp_path / "prof"
    config = tmp_path / "obs.json"
    config.write_text(json.dumps({"profiler": {"enable": True, "output": str(out),
                                               "options": "training_trace:task_trace",
                                               "window": {"start": 3, "steps": 2, "level": "op_trace"}}}))
    obs.set_context(env_config_path=str(config))
    session = profiling.session()
    assert session is not None and "device" in session.ring.rings
    peaks = {"device": "cuda:0", "allocated_bytes.all.peak": 123 << 20, "reserved_bytes.all.peak": 456 << 20}
    monkeypatch.setattr(tracker, "memory_probe", lambda: peaks)
    train_launching_kernels(6, fake_cuda)
    assert session.device.timer is runtime_device_time.current  # the collectives' wrappers time with it
    obs.reset_context()
    assert runtime_device_time.current is None
    assert threading.get_ident() not in HostEvent.asked and HostEvent.asked  # resolved by the poller only

    events = _trace(out)
    host = [e for e in events if e.get("ph") == "X" and e["tid"] == 1]
    steps = {e["args"]["trace_id"]: e["args"]["ml.step"] for e in host if e["cat"] == "step"}
    assert sorted(steps.values()) == [1, 2, 3, 4, 5, 6]
    for e in host:
        if e["cat"] == "step":
            assert e["args"]["obs.device.time_ns"] > 0 and e["args"]["obs.memory.peak_reserved_bytes"] == 456 << 20
        if e["cat"] in ("phase", "module") and e["name"] != "data":
            assert e["args"]["obs.device.time_ns"] >= 0, e
    phases = {e["name"] for e in host if e["cat"] == "phase" and "obs.device.time_ns" in e["args"]}
    assert phases == {"forward", "backward", "optimizer"}  # data runs no device work: untimed
    gpu = [e for e in events if e.get("ph") == "X" and e["tid"] == 2]
    assert {e["cat"] for e in gpu} == {"gpu"} and {e["args"]["kind"] for e in gpu} == {"step", "phase", "module"}
    kernels = [e for e in events if e.get("ph") == "X" and e["tid"] == 3]
    assert sorted(steps[e["args"]["trace_id"]] for e in kernels) == [3, 4]  # the op_trace window's steps only
    assert {e["name"] for e in kernels} == {"gemm_step_3", "gemm_step_4"}  # each in the step that launched it
    assert fake_cuda.starts == 1 and not fake_cuda.on  # one capture, stopped
    named = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert named == {1: "training steps", 2: "GPU (CUDA events)", 3: "GPU kernels (CUPTI)"}


def test_without_cuda_there_is_no_device_ring_no_timer_and_no_thread(tmp_path):
    obs.set_context(enable_profiling=True, profiling_options=json.dumps({"output": str(tmp_path / "prof")}))
    session = profiling.session()
    # a CUDA build run on a CPU (torch's default wheel) keeps a device ring and watches for CUDA coming into use
    assert session is not None
    assert ("device" in session.ring.rings) is session.device.watch is device_recording.cuda_build()
    train_launching_kernels(3)
    assert session.device.timer is None and runtime_device_time.current is None
    assert not [t for t in threading.enumerate() if t.name == "obs-device-time"]
    obs.reset_context()
    trace = json.dumps(_trace(tmp_path / "prof"))
    assert "obs.device" not in trace and "GPU" not in trace


def test_a_capture_gives_each_kernel_the_step_its_launch_was_in_and_ends_with_a_count():
    from obs.features.profiling.kernels import KernelCapture
    from recorder.layout import DeviceTarget as T

    written, kineto = [], FakeKineto()
    capture = KernelCapture(lambda *r: written.append(r), lambda done: done(), kineto)
    kineto.launch("before")  # not started: not recorded
    assert capture.start(7)
    for step in (7, 8):
        capture.step_begins(step)
        kineto.launch(f"k{step}")
    capture.finish(8)
    kineto.launch("after")  # still running until the boundary that stops it: after the window, left out
    assert capture.poll() and not kineto.on
    capture.close()
    assert written[0] == (T.KERNELS_BEGIN, 0, 7, 7, 0)
    assert [(r[1], r[2]) for r in written if r[0] == T.KERNEL] == [("k7", 7), ("k8", 8)]
    assert written[-1] == (T.KERNELS_END, 0, 8, 7, 2)


def test_a_capture_that_cannot_start_or_stop_says_so_and_ends_its_window(caplog):
    from obs._core.internal import set_raise_internal_errors
    from obs.features.profiling import kernels
    from recorder.layout import DeviceTarget as T

    class Busy(FakeKineto):
        def start(self) -> None:
            raise RuntimeError("Can't enable Kineto profiler: a profiler is already running")

    written: list = []
    kernels._said.discard("start")
    assert not kernels.KernelCapture(lambda *r: written.append(r), lambda done: done(), Busy()).start(3)
    assert not written and "no kernel spans for the op_trace window at step 3" in caplog.text

    class Broken(FakeKineto):
        def stop(self):
            raise RuntimeError("CUPTI went away")

    capture = kernels.KernelCapture(lambda *r: written.append(r), lambda done: done(), Broken())
    assert capture.start(3)
    capture.finish(3)
    old = set_raise_internal_errors(False)
    try:
        assert capture.poll()
    finally:
        set_raise_internal_errors(old)
    assert written[-1] == (T.KERNELS_END, 0, 3, 3, -1)
