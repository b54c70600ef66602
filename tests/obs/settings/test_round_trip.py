"""What a getter returns is accepted back by its setter, for every key of every table."""

from __future__ import annotations

import warnings

import pytest

import obs
from obs.settings.context_options import CONTEXT_OPTIONS
from obs.settings.parallel import _WRITE_ONLY, AUTO_PARALLEL_OPTIONS, PS_OPTIONS


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated and device-scoped keys warn; accepting them is the point
        yield


@pytest.mark.parametrize("key", list(CONTEXT_OPTIONS))
def test_context_get_then_set(key):
    value = obs.get_context(key)
    obs.set_context(**{key: value})
    assert obs.get_context(key) == value


@pytest.mark.parametrize("key", list(AUTO_PARALLEL_OPTIONS))
def test_auto_parallel_get_then_set(key):
    value = obs.get_auto_parallel_context(key)
    obs.set_auto_parallel_context(**{key: value})
    assert obs.get_auto_parallel_context(key) == value


@pytest.mark.parametrize("key", [k for k in PS_OPTIONS if k not in _WRITE_ONLY])
def test_ps_get_then_set(key):
    value = obs.get_ps_context(key)
    obs.set_ps_context(**{key: value})
    assert obs.get_ps_context(key) == value


def test_a_size_in_gb_round_trips_and_bad_numbers_are_named():
    check = CONTEXT_OPTIONS["mempool_block_size"].check
    assert check("2.5GB", "mempool_block_size") == 2.5
    assert check(2.5, "mempool_block_size") == 2.5
    with pytest.raises(ValueError, match=r"'mempool_block_size' must be a size of at least 1GB \(got 0.5\)"):
        check(0.5, "mempool_block_size")
    with pytest.raises(ValueError, match=r"finite number of GB.*\(got nan\)"):
        check(float("nan"), "mempool_block_size")
    with pytest.raises(TypeError, match="size string"):
        check(True, "mempool_block_size")


@pytest.mark.parametrize("mode", ["GA,RL", "RL,GA", "RL", "GA", "NO_TUNE"])
def test_auto_tune_mode_takes_rl_and_ga_in_either_order(mode):
    obs.set_context(auto_tune_mode=mode)
    assert obs.get_context("auto_tune_mode") == mode


def test_the_empty_default_of_a_path_key_means_unset_but_other_empty_values_still_fail():
    obs.set_context(print_file_path="")
    assert obs.get_context("print_file_path") == ""
    with pytest.raises(ValueError, match="non-empty"):
        obs.set_context(save_graphs_path="")  # its default is '.', so '' stays invalid
