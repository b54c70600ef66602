"""Device time on a real GPU: CUDA events around steps, phases, modules and a blocking collective, kernel spans for
an op_trace window, memory peaks per step, and not one host synchronisation added to the training steps
(``torch.cuda.set_sync_debug_mode("error")`` around them: a synchronising call raises).

Mirrors tests/obs/features/profiling/test_device_recording.py, which runs the same wiring on CPU with fake events.
Skipped without CUDA (tests/gpu/conftest.py).
"""

from __future__ import annotations

import json
import socket

import pytest
import torch

import obs
from obs import profiling
from obs.runtime import device_time

CUDA = torch.device("cuda", 0)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(256, 1024)
        self.fc2 = torch.nn.Linear(1024, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def _config(tmp_path, **profiler) -> str:
    path = tmp_path / "obs.json"
    path.write_text(json.dumps({"profiler": {"enable": True, "output": str(tmp_path / "prof"), **profiler}}))
    return str(path)


def train_without_host_sync(model: torch.nn.Module, steps: int, collective: bool = False) -> None:
    """Training steps with no host sync of their own; any sync obs adds raises."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [torch.randn(512, 256, device=CUDA) for _ in range(steps)]
    torch.cuda.synchronize()  # before the checked region
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x in obs.steps(batches):
            opt.zero_grad(set_to_none=True)
            loss = model(x).square().mean()
            loss.backward()
            if collective:
                torch.distributed.all_reduce(model.fc2.weight.grad)
            opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _events(tmp_path) -> list[dict]:
    return json.loads((tmp_path / "prof" / "rank_0" / "trace.json").read_text())


def test_step_phase_and_module_spans_get_device_time_and_the_trace_a_gpu_track(tmp_path):
    model = Net().to(CUDA)
    obs.set_context(env_config_path=_config(tmp_path, options="training_trace:task_trace",
                                            window={"start": 4, "steps": 2, "level": "op_trace"}))
    train_without_host_sync(model, 8)
    session = profiling.session()
    assert session is not None and session.device.timer is not None and session.device.timer.skipped == 0
    obs.reset_context()
    assert device_time.current is None

    events = _events(tmp_path)
    host = [e for e in events if e.get("ph") == "X" and e["tid"] == 1]
    steps = {e["args"]["trace_id"]: e for e in host if e["cat"] == "step"}
    assert len(steps) == 8
    for step in steps.values():
        args = step["args"]
        assert "obs.device.missing" not in args, args
        # the device ran the step's work: more than nothing, less than the whole run
        assert 0 < args["obs.device.time_ns"] < 60e9
        assert args["obs.memory.peak_allocated_bytes"] > 0
        assert args["obs.memory.peak_reserved_bytes"] >= args["obs.memory.peak_allocated_bytes"]
    for e in host:
        if e["cat"] == "module" or (e["cat"] == "phase" and e["name"] != "data"):
            assert e["args"]["obs.device.time_ns"] >= 0, e
    gpu = [e for e in events if e.get("ph") == "X" and e["tid"] == 2]
    assert {e["args"]["kind"] for e in gpu} == {"step", "phase", "module"}
    # on the device the forward's Linear layers ran inside the forward phase
    forward = [e for e in host if e["name"] == "forward"]
    assert all(e["args"]["obs.device.time_ns"] > 0 for e in forward)
    kernels = [e for e in events if e.get("ph") == "X" and e["tid"] == 3]
    assert kernels, "no kernel spans for the op_trace window"
    assert {steps[e["args"]["trace_id"]]["args"]["ml.step"] for e in kernels} == {4, 5}
    assert all(e["cat"] == "kernel" and float(e["dur"]) > 0 for e in kernels)


def test_a_blocking_collective_on_the_gpu_is_timed_on_its_stream(tmp_path, monkeypatch):
    dist = torch.distributed
    if not dist.is_available() or not dist.is_nccl_available():
        pytest.skip("NCCL is not available")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=CUDA)
    try:
        model = Net().to(CUDA)
        obs.set_context(env_config_path=_config(tmp_path))
        warm = torch.ones(4, device=CUDA)
        dist.all_reduce(warm)  # the communicator is made at the first collective: outside the checked steps
        torch.cuda.synchronize()
        train_without_host_sync(model, 4, collective=True)
        obs.reset_context()
    finally:
        dist.destroy_process_group()
    events = _events(tmp_path)
    collectives = [e for e in events if e.get("ph") == "X" and e.get("cat") == "collective"]
    assert collectives and all(e["tid"] == 2 and e["args"]["obs.device.time_ns"] >= 0 for e in collectives)
    steps = [e for e in events if e.get("ph") == "X" and e.get("cat") == "step" and e["tid"] == 1]
    assert all(e["args"].get("obs.device.collectives_ns", 0) >= 0 for e in steps)
    assert sum("obs.device.collectives_ns" in e["args"] for e in steps) >= 3
