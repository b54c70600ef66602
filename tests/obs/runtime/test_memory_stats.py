"""The memory reading at each step end: CUDA's allocated and reserved bytes and their peaks since the last reading
(the peak counters reset at every reading), or the process's RSS; PyTorch's CUDA functions stood in for on CPU."""

from __future__ import annotations

import pytest
import torch

from obs.runtime.torch._adapter import memory_stats


@pytest.fixture(name="allocator")
def _allocator(monkeypatch):
    """A CUDA caching allocator in use (device 0 current): its counters, and the resets asked of it."""
    state = {"peak": 900, "resets": []}

    def stats(device):
        return {"allocated_bytes": {"all": {"current": 100, "peak": state["peak"], "allocated": 5, "freed": 4}},
                "reserved_bytes": {"all": {"current": 2048, "peak": 4096}}, "num_alloc_retries": 1, "num_ooms": 0}

    def reset(device):
        state["resets"].append(str(device))
        state["peak"] = 100  # back to what is allocated now

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", stats)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: pytest.fail("flattens every key: slower"))
    return state


def test_peaks_are_per_reading_and_the_counter_is_reset(allocator):
    first = memory_stats()
    assert first == {"device": "cuda:0", "allocated_bytes.all.current": 100, "allocated_bytes.all.peak": 900,
                     "reserved_bytes.all.current": 2048, "reserved_bytes.all.peak": 4096, "num_alloc_retries": 1,
                     "num_ooms": 0}
    assert memory_stats()["allocated_bytes.all.peak"] == 100  # the next step's own peak
    assert allocator["resets"] == ["cuda:0", "cuda:0"]


def test_without_cuda_in_use_it_is_the_rss(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: pytest.fail("no CUDA in use"))
    stats = memory_stats()
    assert stats["device"] == "cpu" and stats["rss_bytes"] > 0
