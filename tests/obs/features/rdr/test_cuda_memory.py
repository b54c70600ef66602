"""rdr.memory_history and an OOM bundle's CUDA memory files: turned on and off with the settings (PyTorch's own
functions stood in for where CUDA is needed), said and not crashed on without CUDA, snapshots bounded.  On a real
device: tests/gpu/test_device_faults_on_cuda.py."""

from __future__ import annotations

import json
import logging

import pytest
import torch

import obs
from obs.features.rdr import cuda_memory, feature
from obs.features.rdr.cuda_memory import NO_CUDA, MemoryHistory, add_to_bundle, bounded_snapshot
from tests.recorder.test_device_faults import OOM


@pytest.fixture(name="fake_cuda")
def _fake_cuda(monkeypatch):
    """torch.cuda as a process using device 1 of two would see it; returns the history calls made."""
    calls = []
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(cuda, "device_count", lambda: 2)
    monkeypatch.setattr(cuda, "current_device", lambda: 1)
    monkeypatch.setattr(cuda, "mem_get_info", lambda device: (2**30, 80 * 2**30))
    monkeypatch.setattr(cuda, "get_device_name", lambda device: f"Card {device}")
    monkeypatch.setattr(cuda, "memory_summary", lambda device: f"|  PyTorch CUDA memory summary, device ID {device} |")
    monkeypatch.setattr(cuda.memory, "_record_memory_history", lambda **kw: calls.append(kw))
    frames = [{"filename": "train.py", "line": i, "name": "f"} for i in range(40)]
    snapshot = {"segments": [{"address": 0, "total_size": 2**21, "frames": frames,
                              "blocks": [{"size": 512, "state": "active_allocated", "frames": frames}] * 3}],
                "device_traces": [[{"action": "alloc", "size": 512, "frames": frames}] * 50 + [{"action": "oom"}], []],
                "allocator_settings": {"expandable_segments": False}}
    monkeypatch.setattr(cuda.memory, "_snapshot", lambda: snapshot)
    return calls


def oom_files() -> dict:
    return {"device_fault.json": json.dumps({"kind": "cuda_oom", "message": OOM})}


def test_the_history_follows_the_setting_through_the_recorder(tmp_path, fake_cuda):
    config = tmp_path / "obs.json"
    config.write_text(json.dumps({"rdr": {"enable": True, "path": str(tmp_path), "memory_history": 500}}))
    obs.set_context(env_config_path=str(config))
    assert feature.memory_history.entries == 500
    assert fake_cuda == [{"enabled": "all", "context": "alloc", "stacks": "python", "max_entries": 500}]
    obs.reset_context()
    assert feature.memory_history.entries == 0 and fake_cuda[-1] == {"enabled": None}


def test_without_cuda_the_history_is_said_once_and_nothing_breaks(caplog):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    history = MemoryHistory()
    with caplog.at_level(logging.INFO, logger="obs"):
        history.apply(100)
        history.apply(50)
    assert history.entries == 0 and sum("memory_history" in r.getMessage() for r in caplog.records) == 1


def test_an_oom_bundle_without_cuda_says_so():
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        pytest.skip("this process uses CUDA")
    files = oom_files()
    add_to_bundle(files, history=100)
    assert files["memory_summary.txt"] == NO_CUDA and "memory_snapshot.json" not in files


def test_an_oom_bundle_has_the_summary_of_the_device_named_and_a_bounded_snapshot(fake_cuda, monkeypatch):
    monkeypatch.setattr(cuda_memory, "FRAMES_KEPT", 4)
    monkeypatch.setattr(cuda_memory, "BLOCKS_KEPT", 2)
    files = oom_files()
    add_to_bundle(files, history=10)
    summary = files["memory_summary.txt"]
    assert summary.startswith("device cuda:0 (Card 0): the driver reports 1.00 GiB free of 80.00 GiB")  # GPU 0 of OOM
    assert "memory summary, device ID 0" in summary
    snapshot = json.loads(files["memory_snapshot.json"])
    first = snapshot["device_traces"][0]
    assert len(first) == 10 and first[-1] == {"action": "oom"} and len(first[0]["frames"]) == 4
    assert [len(s["blocks"]) for s in snapshot["segments"]] == [2] and len(snapshot["segments"][0]["frames"]) == 4
    # frames left out of what is kept: 9 trace entries, the segment and its 2 blocks
    assert snapshot["left_out"] == {"trace_entries": 41, "blocks": 1, "frames": 36 * 12}
    assert snapshot["allocator_settings"] == {"expandable_segments": False}


def test_only_an_oom_gets_memory_files(fake_cuda):
    files = {"device_fault.json": json.dumps({"kind": "device_assert"})}
    add_to_bundle(files, history=10)
    assert list(files) == ["device_fault.json"]
    none = {"device_fault.json": json.dumps({"kind": "cuda_oom", "message": "no device named"})}
    add_to_bundle(none, history=0)
    assert "device ID 1" in none["memory_summary.txt"] and "memory_snapshot.json" not in none  # the current one


def test_bounding_keeps_the_newest_entries():
    trace = [{"action": "alloc", "addr": i} for i in range(5)]
    out = bounded_snapshot({"device_traces": [trace]}, 2)
    assert out["device_traces"] == [trace[-2:]] and out["segments"] == [] and out["max_entries"] == 2


@pytest.mark.parametrize("value,fragment", [(-1, r"an int in \[0, 100000\]"), (100_001, r"an int in \[0, 100000\]"),
                                            (True, "an int"), ("10", "an int")])
def test_bad_memory_history_values_are_refused(tmp_path, value, fragment):
    path = tmp_path / "obs.json"
    path.write_text(json.dumps({"rdr": {"enable": True, "memory_history": value}}))
    with pytest.raises(ValueError, match=f"'rdr.memory_history' must be {fragment}"):
        obs.set_context(env_config_path=str(path))


def test_turning_the_history_off_after_a_cuda_fault_is_quiet(fake_cuda, monkeypatch):
    history = MemoryHistory()
    history.apply(10)

    def dead(**kw):
        raise torch.AcceleratorError("CUDA error: device-side assert triggered")

    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", dead)
    history.apply(0)  # the context died with the assert: nothing to turn off, nothing to report
    assert history.entries == 0


def test_a_steps_cuda_peaks_are_in_the_ring_and_shown(tmp_path, capsys):
    """A MEMORY reading with CUDA's peaks (as obs.runtime.torch._adapter.memory_stats gives it on a GPU) is a memory
    and a memory_peak event of the step in the bundle, and `obs rdr show` says the peak."""
    from obs._core.events import Event, bus
    from obs.cli import main

    config = tmp_path / "obs.json"
    config.write_text(json.dumps({"rdr": {"enable": True, "path": str(tmp_path / "rdr"), "granularity": "step"}}))
    obs.set_context(env_config_path=str(config))
    try:
        bus.emit(Event.MEMORY, 4, {"device": "cuda:0", "allocated_bytes.all.current": 3 << 20,
                                   "allocated_bytes.all.peak": 96 << 20, "reserved_bytes.all.current": 128 << 20,
                                   "reserved_bytes.all.peak": 160 << 20})
        path = obs.rdr.dump("manual")
    finally:
        obs.reset_context()
    with open(f"{path}/memory.jsonl") as fh:
        lines = [json.loads(line) for line in fh]
    assert [(e["kind"], e["step"], e["device"]) for e in lines] == [("memory", 4, "cuda:0"), ("memory_peak", 4,
                                                                                             "cuda:0")]
    assert (lines[1]["peak_allocated_bytes"], lines[1]["peak_reserved_bytes"]) == (96 << 20, 160 << 20)
    assert main(["rdr", "show", path]) == 0
    assert "step 4: 3.0 MiB (peak 96.0 MiB)" in capsys.readouterr().out
