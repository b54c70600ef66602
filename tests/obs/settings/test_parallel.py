"""Auto-parallel and PS contexts, rank/world size, and the GPU device_context knobs."""

from __future__ import annotations

import warnings

import pytest

import obs
from obs.settings.parallel import AUTO_PARALLEL_OPTIONS, PS_OPTIONS, rank_given


@pytest.mark.parametrize("key", list(AUTO_PARALLEL_OPTIONS))
def test_auto_parallel_defaults(key):
    assert obs.get_auto_parallel_context(key) == AUTO_PARALLEL_OPTIONS[key].default


def test_auto_parallel_set_get_reset():
    obs.set_auto_parallel_context(parallel_mode=obs.ParallelMode.DATA_PARALLEL, device_num=8, global_rank=3,
                                  gradients_mean=True)
    assert obs.get_auto_parallel_context("parallel_mode") == "data_parallel"
    assert (obs.rank(), obs.world_size()) == (3, 8)
    obs.reset_auto_parallel_context()
    assert obs.get_auto_parallel_context("device_num") == 1


@pytest.mark.parametrize("kwargs, error, fragment", [
    ({"parallel_mode": "pipeline"}, ValueError, "stand_alone"),
    ({"device_num": 0}, ValueError, "device_num"),
    ({"global_rank": 4096}, ValueError, "[0, 4095]"),
    ({"pipeline_stages": 0}, ValueError, "pipeline_stages"),
    ({"search_mode": "greedy"}, ValueError, "recursive_programming"),
    ({"gradients_mean": 1}, TypeError, "gradients_mean"),
    ({"fusion_threshold": 64}, ValueError, "unknown key"),
])
def test_auto_parallel_errors_change_nothing(kwargs, error, fragment):
    with pytest.raises(error, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        obs.set_auto_parallel_context(**{"gradient_fp32_sync": False, **kwargs})
    assert obs.get_auto_parallel_context("gradient_fp32_sync") is True


def test_rank_and_world_size_from_torchrun_environment(monkeypatch):
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "6")
    assert (obs.rank(), obs.world_size()) == (5, 6)


@pytest.mark.parametrize("environ, given", [
    ({}, True),  # a plain process: rank 0 of 1
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}, True),  # torchrun
    ({"WORLD_SIZE": "1"}, True),
    ({"LOCAL_RANK": "1", "WORLD_SIZE": "2"}, False),  # Lightning's launcher's rank 1: no RANK
    ({"LOCAL_RANK": "0"}, False),
    ({"WORLD_SIZE": "2"}, False),
])
def test_the_rank_is_given_by_rank_or_by_nothing_saying_there_are_other_ranks(monkeypatch, environ, given):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert rank_given() is given
    obs.set_auto_parallel_context(global_rank=1)
    assert rank_given()


@pytest.mark.parametrize("key", [k for k in PS_OPTIONS if "password" not in k])
def test_ps_defaults(key):
    assert obs.get_ps_context(key) == PS_OPTIONS[key].default


def test_ps_reset_restores_enable_ssl_too():
    obs.set_ps_context(enable_ssl=True, worker_num=2, client_password="secret")
    assert obs.get_ps_context("enable_ssl") is True
    with pytest.raises(ValueError, match="write-only"):
        obs.get_ps_context("client_password")
    obs.reset_ps_context()
    assert obs.get_ps_context("enable_ssl") is False


def test_ps_errors():
    with pytest.raises(ValueError, match="unknown key 'foo'"):
        obs.set_ps_context(foo=1)
    with pytest.raises(TypeError, match="enable_ps"):
        obs.set_ps_context(enable_ps="yes")


def test_gpu_knobs_validate_like_gpu_config():
    tuning = obs.device_context.gpu.op_tuning
    with pytest.raises(ValueError, match=r"'conv_wgrad_algo' must be one of .*winograd_nonfused"):
        tuning.conv_wgrad_algo("winograd")
    with pytest.raises(TypeError, match="matmul_allow_tf32"):
        obs.device_context.gpu.op_precision.matmul_allow_tf32(1)


def test_gpu_knobs_are_ignored_with_a_warning_on_cpu():
    with pytest.warns(UserWarning, match="conv_fprop_algo"):
        obs.device_context.gpu.conv_fprop_algo("performance")
    assert obs.device_context.gpu.op_tuning.get("conv_fprop_algo") == "normal"
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        obs.device_context.gpu.conv_allow_tf32(False)
    assert obs.device_context.gpu.op_precision.get("conv_allow_tf32") is True

