"""CUDA faults on a real device: a device-side assert (in a subprocess: the CUDA context dies with it), a real out of
memory with the allocator's history on, the memory reading per step without a host sync.  The same on CPU, from the
real exception types and messages: tests/recorder/test_device_faults*.py, tests/obs/features/rdr/test_cuda_memory.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import obs
from recorder.bundle_reader import list_bundles, load_bundle

CUDA = torch.device("cuda", 0)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EMBEDDING = "Default/net-Sequential/0-Embedding"

SCRIPT = textwrap.dedent("""
    import torch

    net = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 2)).cuda()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(3):
        loss = net(torch.tensor([1, 2, 3], device="cuda")).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        print("loss", loss.item())  # the device is waited for: every kernel so far succeeded
    out = net(torch.tensor([3, 12], device="cuda"))  # 12 is out of range: the embedding's kernel asserts
    print(out.sum().item())  # where it surfaces (unless a launch in between reports it first)
""")


def run_script(tmp_path, **env):
    (tmp_path / "obs.json").write_text(json.dumps({"rdr": {"enable": True, "path": str(tmp_path / "rdr"),
                                                           "granularity": "op"}}))
    (tmp_path / "train.py").write_text(SCRIPT)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("MS_RDR", "OBS_", "CUDA_LAUNCH_BLOCKING"))
            or k.startswith("OBS_NATIVE")}
    return subprocess.run([sys.executable, "-m", "obs", "run", "--config", "obs.json", "train.py"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, env={**base, "PYTHONPATH": ROOT, **env})


def only_bundle(tmp_path):
    (info,) = list_bundles(str(tmp_path / "rdr")).bundles
    return load_bundle(info.path)


def test_a_device_side_assert_names_the_ops_launched_since_the_last_wait(tmp_path):
    result = run_script(tmp_path)
    assert result.returncode == 1 and "device-side assert triggered" in result.stderr, result.stderr[-2000:]
    b = only_bundle(tmp_path)
    fault = b.device_fault
    assert fault is not None and fault.kind == "device_assert", b.manifest
    assert fault.asynchronous and fault.launch_blocking is False
    suspects = {m["scope"]: m["names"] for m in fault.suspects}
    assert "embedding" in suspects.get(EMBEDDING, []), fault.suspects  # launched after step 2's loss.item()
    assert fault.ops_since_wait and fault.ops_since_wait < 200  # one step's ops, not the whole ring
    assert any("CUDA_LAUNCH_BLOCKING=1" in line for line in fault.advice)
    assert fault.surfaced_at is not None and fault.surfaced_at["file"] == str(tmp_path / "train.py")


def test_with_cuda_launch_blocking_the_embedding_raises_itself(tmp_path):
    result = run_script(tmp_path, CUDA_LAUNCH_BLOCKING="1")
    assert result.returncode == 1, result.stderr[-2000:]
    fault = only_bundle(tmp_path).device_fault
    assert fault.kind == "device_assert" and fault.launch_blocking is True
    assert fault.module == EMBEDDING and "was set" in fault.advice[0]
    assert fault.surfaced_at["line"] == 12  # the call that launched it


class Greedy(torch.nn.Module):
    """Asks for more than the card has."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        too_much = torch.cuda.get_device_properties(CUDA).total_memory + (1 << 30)
        return x + torch.empty(too_much, dtype=torch.uint8, device=CUDA).sum()


def test_a_real_oom_has_the_memory_summary_and_a_bounded_snapshot(tmp_path):
    config = tmp_path / "obs.json"
    config.write_text(json.dumps({"rdr": {"enable": True, "path": str(tmp_path / "rdr"), "memory_history": 500}}))
    obs.set_context(env_config_path=str(config))
    net = torch.nn.Linear(64, 64).to(CUDA)
    for _ in range(20):  # allocations with Python stacks in the history
        net(torch.randn(32, 64, device=CUDA)).sum().backward()
    with pytest.raises(torch.OutOfMemoryError):
        Greedy()(torch.ones(1, device=CUDA))
    obs.reset_context()
    b = only_bundle(tmp_path)
    fault = b.device_fault
    assert b.info.reason == "module_error" and fault.kind == "cuda_oom" and fault.module == "Default/net-Greedy"
    assert "PyTorch CUDA memory summary" in fault.memory_summary and "the driver reports" in fault.memory_summary
    assert fault.memory_snapshot is not None and os.path.getsize(fault.memory_snapshot) < 32 << 20
    with open(fault.memory_snapshot) as fh:
        snapshot = json.load(fh)
    trace = snapshot["device_traces"][0]
    assert 0 < len(trace) <= 500 and any(e["action"] == "oom" for e in trace)
    assert all(len(e.get("frames", [])) <= 16 for e in trace)
    assert any(f["filename"] == __file__ for e in trace for f in e.get("frames", []))  # Python stacks
    from obs.features.rdr import feature

    assert feature.memory_history.entries == 0  # turned off again with the recorder


def test_the_memory_reading_has_per_step_peaks_and_no_sync():
    from obs.runtime.torch._adapter import memory_stats

    torch.ones(1, device=CUDA)  # CUDA initialised
    big = torch.empty(256 << 20, dtype=torch.uint8, device=CUDA)
    del big
    torch.cuda.set_sync_debug_mode("error")
    try:
        first, second = memory_stats(), memory_stats()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert first["device"] == "cuda:0" and first["allocated_bytes.all.peak"] >= 256 << 20
    assert second["allocated_bytes.all.peak"] < 256 << 20  # reset by the first reading
    assert second["reserved_bytes.all.peak"] <= first["reserved_bytes.all.peak"]


@pytest.mark.parametrize("granularity", ["step", "op"])
def test_the_recorder_adds_no_host_sync_to_a_training_step(tmp_path, granularity):
    config = tmp_path / "obs.json"
    config.write_text(json.dumps({"rdr": {"enable": True, "path": str(tmp_path / "rdr"),
                                          "granularity": granularity}}))
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).to(CUDA)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    obs.set_context(env_config_path=str(config))
    torch.cuda.set_sync_debug_mode("error")  # a synchronising CUDA call raises
    try:
        for _ in range(3):
            net(torch.randn(16, 64, device=CUDA)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        obs.reset_context()
