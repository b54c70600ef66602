"""The set_context option table, parametrised over every key: default, a good value, each kind of bad value."""

from __future__ import annotations

import warnings

import pytest

import obs
from obs.settings.context_options import CONTEXT_OPTIONS

# key -> (good value on CPU, normalised value or ..., wrong-type value, out-of-range/not-allowed value or None)
SAMPLES = {
    "mode": (obs.GRAPH_MODE, ..., "graph", 5),
    "device_target": ("CPU", ..., 1, "TPU"),
    "device_id": (0, ..., "0", 4096),
    "max_device_memory": ("3.5GB", 3.5, True, "3.5gb"),
    "variable_memory_max_size": ("2GB", 2.0, [2], "32GB"),
    "mempool_block_size": ("2GB", 2.0, {}, "0.5GB"),
    "op_timeout": (30, ..., 1.5, -1),
    "save_graphs": (True, 2, "1", 4),
    "save_graphs_path": ("./graphs", ..., 1, ""),
    "enable_dump": (True, ..., 1, None),
    "save_dump_path": ("./dump", ..., None.__class__, ""),
    "deterministic": ("ON", ..., True, "on"),
    "print_file_path": ("print.pb", ..., 3, "a\x00b"),
    "env_config_path": ("<file>", ..., 3, "/nonexistent/obs.json"),
    "precompile_only": (True, ..., "yes", None),
    "reserve_class_name_in_scope": (False, ..., 0, None),
    "pynative_synchronize": (True, ..., 1, None),
    "debug_level": (obs.DEBUG, ..., "DEBUG", 2),
    "enable_graph_kernel": (True, ..., 1, None),
    "graph_kernel_flags": ("--opt_level=2", ..., 2, None),
    "enable_reduce_precision": (False, ..., 0, None),
    "aoe_tune_mode": ("online", ..., 1, "sometimes"),
    "aoe_config": ({"job_type": "1"}, ..., "1", {"job_type": "3"}),
    "check_bprop": (True, ..., 1, None),
    "max_call_depth": (2000, ..., "2000", 0),
    "grad_for_scalar": (True, ..., 1, None),
    "enable_compile_cache": (True, ..., 1, None),
    "compile_cache_path": ("./cache", ..., 1, "a\x00b"),
    "inter_op_parallel_num": (0, ..., "2", -1),
    "runtime_num_threads": (1, ..., 1.0, -1),
    "disable_format_transform": (True, ..., 1, None),
    "support_binary": (True, ..., 1, None),
    "memory_optimize_level": ("O1", ..., 1, "O2"),
    "memory_offload": ("ON", ..., True, "YES"),
    "ascend_config": ({"exception_dump": "1"}, ..., "1", {"exception_dump": "3"}),
    "jit_syntax_level": (obs.STRICT, ..., "STRICT", 5),
    "gpu_config": ({"conv_fprop_algo": "performance"}, ..., [], {"conv_fprop_algo": "fastest"}),
    "save_ms_model": (True, ..., 1, None),
    "save_ms_model_path": ("./m.ms", ..., 1, ""),
    "enable_auto_mixed_precision": (True, ..., 1, None),
    "enable_profiling": (True, ..., 1, None),
    "profiling_options": ('{"output": "/tmp/prof"}', ..., 1, '{"output": '),
    "auto_tune_mode": ("GA", ..., 1, "SA"),
    "enable_sparse": (True, ..., 1, None),
}
KEYS = list(CONTEXT_OPTIONS)


def test_every_option_has_samples():
    """A new row in the table needs its samples here."""
    assert sorted(SAMPLES) == sorted(KEYS)


@pytest.fixture(name="good")
def _good(tmp_path):
    def good(key):
        value = SAMPLES[key][0]
        if value == "<file>":
            path = tmp_path / "obs.json"
            path.write_text('{"rdr": {"enable": false}}')
            return str(path)
        if key == "print_file_path":  # applying it creates the file
            return str(tmp_path / value)
        return value
    return good


@pytest.mark.parametrize("key", KEYS)
def test_default_before_set(key):
    """get_context of a never-set key returns the table's default."""
    assert obs.get_context(key) == CONTEXT_OPTIONS[key].default


@pytest.mark.parametrize("key", KEYS)
def test_good_value_is_stored_or_ignored_by_device(key, good, tmp_path, monkeypatch):
    """A good value is stored (normalised); a key for another device is ignored with a warning."""
    monkeypatch.chdir(tmp_path)  # a key that turns a feature on (enable_profiling) writes to its default ./ folder
    value = good(key)
    row = CONTEXT_OPTIONS[key]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        obs.set_context(**{key: value})
    messages = [str(w.message) for w in caught]
    if row.deprecated:
        assert any("deprecated" in m and key in m for m in messages), messages
    if row.devices is not None and "CPU" not in row.devices:
        assert any("ignored" in m and key in m for m in messages), messages
        assert obs.get_context(key) == row.default
        return
    expected = SAMPLES[key][1]
    expected = value if expected is ... else expected
    if key == "env_config_path":
        expected = str(__import__("os").path.realpath(value))
    if key == "ascend_config":  # Ascend-only sub-keys would be dropped; exception_dump stays on every device
        assert obs.get_context(key) == {"exception_dump": "1"}
        return
    assert obs.get_context(key) == expected


@pytest.mark.parametrize("key", KEYS)
def test_wrong_type_raises_type_error(key):
    """A value of the wrong type is a TypeError naming the key and the value."""
    bad = SAMPLES[key][2]
    if bad is None.__class__:
        bad = 3
    with pytest.raises(TypeError) as info:
        obs.set_context(**{key: bad})
    assert key in str(info.value)
    assert obs.get_context(key) == CONTEXT_OPTIONS[key].default


@pytest.mark.parametrize("key", [k for k in KEYS if SAMPLES[k][3] is not None])
def test_bad_value_raises_value_error(key):
    """Out of range, not allowed or badly formatted: ValueError naming key, expectation and value."""
    bad = SAMPLES[key][3]
    with pytest.raises(ValueError) as info:
        obs.set_context(**{key: bad})
    message = str(info.value)
    assert key in message and "must be" in message
    assert obs.get_context(key) == CONTEXT_OPTIONS[key].default
