"""set_context as a whole: atomic calls, unknown keys, deprecations, reset, and the PyTorch effects."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import obs
from obs._core.errors import DeviceUnavailableError


def test_failing_call_changes_nothing():
    """One bad key rejects the whole call: the good keys before it are not applied."""
    with pytest.raises(ValueError):
        obs.set_context(save_graphs=1, deterministic="ON", device_id=-1)
    assert obs.get_context("save_graphs") == 0
    assert obs.get_context("deterministic") == "OFF"
    assert not torch.are_deterministic_algorithms_enabled()


def test_unknown_key_lists_close_matches_and_points_to_obs_options():
    with pytest.raises(ValueError, match=r"did you mean 'print_file_path'.*obs options"):
        obs.set_context(print_file_pat="x.pb")


def test_unknown_get_key_is_value_error():
    with pytest.raises(ValueError, match="unknown key 'nope'"):
        obs.get_context("nope")


def test_ascend_sub_key_at_top_level_points_to_ascend_config():
    with pytest.raises(ValueError, match="inside 'ascend_config'"):
        obs.set_context(precision_mode="force_fp16")


def test_deprecated_key_names_replacement():
    with pytest.warns(DeprecationWarning, match="use 'aoe_tune_mode' instead"):
        obs.set_context(auto_tune_mode="GA")


def test_device_specific_key_is_ignored_on_cpu_with_warning():
    with pytest.warns(UserWarning, match=r"'gpu_config' only applies on \['GPU'\].*ignored"):
        obs.set_context(gpu_config={"matmul_allow_tf32": True})
    assert obs.get_context("gpu_config") == {}


def test_ascend_config_keeps_exception_dump_and_drops_ascend_only_keys_on_cpu():
    with pytest.warns(UserWarning, match="precision_mode"):
        obs.set_context(ascend_config={"exception_dump": "1", "precision_mode": "force_fp16"})
    assert obs.get_context("ascend_config") == {"exception_dump": "1"}


def test_dict_option_rejects_unknown_sub_key_with_suggestion():
    with pytest.raises(ValueError, match="did you mean 'exception_dump'"):
        obs.set_context(ascend_config={"exception_dmp": "1"})


def test_none_sets_a_key_back_to_its_default():
    obs.set_context(save_graphs=3)
    obs.set_context(save_graphs=None)
    assert obs.get_context("save_graphs") == 0


def test_settings_changed_event_carries_the_changes():
    seen = []
    obs.subscribe(obs.Event.SETTINGS_CHANGED, lambda source, changes: seen.append((source, dict(changes))))
    obs.set_context(save_graphs=1, op_timeout=900)
    assert seen == [("set_context", {"save_graphs": (0, 1)})]


def test_deterministic_on_uses_deterministic_algorithms_and_reset_undoes_it():
    obs.set_context(deterministic="ON")
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    obs.reset_context()
    assert not torch.are_deterministic_algorithms_enabled()
    assert not torch.backends.cudnn.deterministic


def test_runtime_num_threads_sets_the_pool_and_reset_restores_it():
    before = torch.get_num_threads()
    obs.set_context(runtime_num_threads=1)
    assert torch.get_num_threads() == 1
    obs.reset_context()
    assert torch.get_num_threads() == before


def test_gpu_switches_reach_torch_backends(monkeypatch):
    """With a GPU target the tf32 and 'performance' switches land in torch.backends (undone by reset)."""
    from obs.runtime.torch import _controls

    values = {"gpu_config": {"conv_allow_tf32": False, "matmul_allow_tf32": True, "conv_wgrad_algo": "performance"}}
    _controls.apply(values, {"gpu_config": ({}, values["gpu_config"])})
    assert torch.backends.cudnn.allow_tf32 is False
    assert torch.backends.cuda.matmul.allow_tf32 is True
    assert torch.backends.cudnn.benchmark is True
    _controls.restore()
    assert torch.backends.cudnn.allow_tf32 is True
    assert torch.backends.cuda.matmul.allow_tf32 is False
    assert torch.backends.cudnn.benchmark is False


def test_pynative_synchronize_sets_cuda_launch_blocking(monkeypatch):
    monkeypatch.delenv("CUDA_LAUNCH_BLOCKING", raising=False)
    obs.set_context(pynative_synchronize=True)
    assert os.environ["CUDA_LAUNCH_BLOCKING"] == "1"
    obs.reset_context()
    assert "CUDA_LAUNCH_BLOCKING" not in os.environ


def test_device_is_cpu_by_default():
    assert obs.device() == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_gpu_target_without_cuda_is_a_clear_error_and_changes_nothing():
    with pytest.raises(DeviceUnavailableError, match=r"needs CUDA.*is_available\(\) is False"):
        obs.set_context(device_target="GPU", save_graphs=1)
    assert obs.get_context("device_target") == "CPU"
    assert obs.get_context("save_graphs") == 0


def test_ascend_target_without_npu_backend_is_a_clear_error():
    with pytest.raises(DeviceUnavailableError, match="torch_npu"):
        obs.set_context(device_target="Ascend")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_target_selects_cuda_device_and_memory_fraction():
    obs.set_context(device_target="GPU", device_id=0, max_device_memory="1GB")
    assert obs.device() == torch.device("cuda", 0)


def test_graph_mode_compiles_and_publishes_the_graph():
    graphs = []
    obs.subscribe(obs.Event.GRAPH_COMPILED, lambda name, gm, inputs: graphs.append((name, gm)))
    obs.set_context(mode=obs.GRAPH_MODE)

    def f(x):
        return torch.relu(x) * 2

    compiled = obs.compile(f, backend="eager")
    assert compiled is not f
    assert torch.equal(compiled(torch.ones(3)), torch.full((3,), 2.0))
    assert len(graphs) == 1 and graphs[0][0].startswith("f_")
    assert "relu" in str(graphs[0][1].graph)


def test_pynative_mode_leaves_the_function_eager():
    def f(x):
        return x + 1

    assert obs.compile(f) is f


def test_reset_emits_changes_and_restores_defaults():
    seen = []
    obs.set_context(save_graphs=2, deterministic="ON")
    obs.subscribe(obs.Event.SETTINGS_CHANGED, lambda source, changes: seen.append(source))
    obs.reset_context()
    assert seen == ["reset"]
    assert obs.get_context("save_graphs") == 0


def test_no_warning_for_plain_cpu_settings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        obs.set_context(device_target="CPU", mode=obs.PYNATIVE_MODE, save_graphs=1)
