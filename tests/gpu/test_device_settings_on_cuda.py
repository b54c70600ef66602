"""The CUDA branches of the device settings: device_target GPU with device_id, max_device_memory, the TF32 and cuDNN
switches and deterministic, each in force on a real device and undone by reset_context (tests/obs/settings covers
their validation on CPU)."""

from __future__ import annotations

import pytest
import torch

import obs


def test_device_id_and_max_device_memory_reach_the_device_and_are_undone():
    before = torch.cuda.current_device()
    obs.set_context(device_target="GPU", device_id=0, max_device_memory="1GB")
    try:
        assert obs.device() == torch.device("cuda", 0) and torch.cuda.current_device() == 0
        torch.cuda.empty_cache()
        with pytest.raises(torch.OutOfMemoryError):  # the fraction caps the caching allocator at about 1 GB
            torch.empty(int(1.5 * 2**30), dtype=torch.uint8, device="cuda:0")
        small = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda:0")
        del small
    finally:
        obs.reset_context()
    torch.cuda.empty_cache()
    big = torch.empty(int(1.5 * 2**30), dtype=torch.uint8, device="cuda:0")  # the cap is gone
    del big
    torch.cuda.empty_cache()
    assert torch.cuda.current_device() == before


def test_tf32_cudnn_and_determinism_switches_are_in_force_on_cuda_and_undone():
    saved = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.benchmark,
             torch.are_deterministic_algorithms_enabled())
    obs.set_context(device_target="GPU", deterministic="ON",
                    gpu_config={"conv_allow_tf32": False, "matmul_allow_tf32": True})
    try:
        assert torch.backends.cudnn.allow_tf32 is False and torch.backends.cuda.matmul.allow_tf32 is True
        assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
        x = torch.randn(8, 3, 16, 16, device="cuda")
        conv = torch.nn.Conv2d(3, 4, 3).cuda()
        assert torch.equal(conv(x), conv(x))  # cuDNN, deterministic
    finally:
        obs.reset_context()
    assert (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.benchmark,
            torch.are_deterministic_algorithms_enabled()) == saved
