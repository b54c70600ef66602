"""env_config_path files: parsing, every bad-file error, and set_context integration."""

from __future__ import annotations

import json

import pytest

import obs
from obs.settings.env_config_file import load_file, parse_text, resolve


def write(tmp_path, data, name="obs.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def test_full_file_is_read(tmp_path):
    path = write(tmp_path, {"rdr": {"enable": True, "mode": 2, "path": str(tmp_path)}, "sys": {"mem_reuse": False}})
    obs.set_context(env_config_path=path)
    config = obs.env_config()
    assert config.pop("profiler")["enable"] is False  # a section the file does not name keeps its defaults
    for section in ("exception_dump", "nan_check"):
        assert config.pop(section)["enable"] is False
    assert config.pop("dump") == {"common_dump_settings": {}, "e2e_dump_settings": {}}
    assert config.pop("graphs") == {"save_graphs": 0, "save_graphs_path": ""}
    assert config.pop("monitor")["enable"] is False
    assert config == {"rdr": {"enable": True, "mode": 2, "path": str(tmp_path), "granularity": "module",
                              "capacity": {}, "hang_action": "dump", "memory_history": 0},
                      "sys": {"mem_reuse": False}}


def test_docs_spelling_mem_Reuse_is_accepted(tmp_path):  # noqa: N802 - the docs' spelling, in the name
    parsed = load_file(write(tmp_path, {"sys": {"mem_Reuse": False}}))
    assert parsed.sections["sys"] == {"mem_reuse": False}


@pytest.mark.parametrize("text, fragment", [
    ('{"rdr": {"enable": true,}}', "not valid JSON"),
    ('[1, 2]', "JSON object of sections"),
    ('{"rdrr": {}}', 'unknown section "rdrr"; did you mean "rdr"'),
    ('{"rdr": []}', "section 'rdr' must be a JSON object"),
    ('{"rdr": {"enabel": true}}', 'no key "enabel"; did you mean "enable"'),
    ('{"rdr": {"enable": "yes"}}', "'rdr.enable' must be true or false (got \"yes\" of type string)"),
    ('{"rdr": {"mode": 3}}', "'rdr.mode' must be one of [1, 2]"),
    ('{"rdr": {"mode": "2"}}', "'rdr.mode' must be one of [1, 2]"),
    ('{"rdr": {"path": "relative/dir"}}', "'rdr.path' must be an absolute path"),
    ('{"sys": {"mem_reuse": 1}}', "'sys.mem_reuse' must be true or false (got 1 of type number)"),
    ('{"rdr": {"enable": true, "enable": false}}', 'key "enable" is given more than once'),
    ('[' * 100_000 + ']' * 100_000, "nested too deeply"),
    ('{"sys": {"mem_reuse": true, "mem_Reuse": false}}', "given twice"),
])
def test_bad_file_names_file_key_expectation_and_value(text, fragment):
    with pytest.raises(ValueError) as info:
        parse_text(text, "/etc/obs.json")
    assert fragment in str(info.value)
    assert "/etc/obs.json" in str(info.value)


def test_not_json_error_gives_line_and_column():
    with pytest.raises(ValueError, match="line 2 column 1"):
        parse_text('{"rdr": {}\n', "f.json")


def test_missing_file_is_rejected_by_set_context(tmp_path):
    with pytest.raises(ValueError, match="existing file"):
        obs.set_context(env_config_path=str(tmp_path / "missing.json"))


def test_invalid_file_rejects_the_whole_call(tmp_path):
    path = write(tmp_path, {"rdr": {"path": "rel"}})
    with pytest.raises(ValueError, match="absolute"):
        obs.set_context(env_config_path=path, save_graphs=1)
    assert obs.get_context("save_graphs") == 0
    assert obs.get_context("env_config_path") == ""


def test_env_config_path_is_stored_as_real_path(tmp_path, monkeypatch):
    path = write(tmp_path, {})
    monkeypatch.chdir(tmp_path)
    obs.set_context(env_config_path="obs.json")
    assert obs.get_context("env_config_path") == path


def test_resolve_without_file_gives_defaults():
    assert resolve(None, {}).as_dict() == {"rdr": {"enable": False, "mode": 1, "path": "", "granularity": "module",
                                                   "capacity": {}, "hang_action": "dump", "memory_history": 0},
                                           "profiler": {"enable": False, "options": "training_trace", "output": "",
                                                        "endpoint": "", "protocol": "", "steps": "", "span_budget": 50,
                                                        "module_depth": 3, "max_file_mb": 100, "window": {},
                                                        "metrics": "",
                                                        "prometheus_host": "", "prometheus_port": 0, "batch_size": 0,
                                                        "tokens_per_step": 0},
                                           "sys": {"mem_reuse": True},
                                           "exception_dump": {"enable": False, "mode": "2", "path": ""},
                                           "nan_check": {"enable": False, "action": "continue",
                                                         "granularity": "module", "backward": True, "path": "",
                                                         "sync": False},
                                           "dump": {"common_dump_settings": {}, "e2e_dump_settings": {}},
                                           "graphs": {"save_graphs": 0, "save_graphs_path": ""},
                                           "monitor": {"enable": False, "path": "", "config_file": "", "targets": {},
                                                       "xy_distribution": False, "all_xy": False,
                                                       "wg_distribution": False, "mv_distribution": False,
                                                       "ur_distribution": False, "cc_distribution": {},
                                                       "ops": ["norm"], "eps": 1e-8, "ndigits": 6, "alert": {},
                                                       "format": "csv", "start_step": 0, "step_interval": 1,
                                                       "collect_times": 100_000_000, "step_count_per_record": 100,
                                                       "print_struct": False, "module_ranks": [], "update_sample": 4096,
                                                       "window": 50,
                                                       "warmup": 20, "threshold": 10.0,
                                                       "ring_steps": 64, "ring_series": 1024, "on_anomaly": [],
                                                       "capture_steps": 5}}


def test_every_problem_of_a_file_is_reported_at_once_in_json_words(tmp_path):
    from obs.settings.env_config_file import ConfigFileError, load_file

    path = tmp_path / "obs.json"
    path.write_text('{"rdr": {"enable": "yes", "mode": 3, "granularity": "ops", "bogus": null, "path": null}, '
                    '"sys": {"mem_reuse": null, "mem_reuse": true}, "extra": {}}')
    with pytest.raises(ConfigFileError) as info:
        load_file(str(path))
    keys = [p.key for p in info.value.problems]
    assert keys == ["mem_reuse", "rdr.enable", "rdr.mode", "rdr.granularity", "rdr.bogus", "extra"]
    text = str(info.value)
    assert f"env config file {path} has 6 problems:" in text
    assert '\'rdr.enable\' must be true or false (got "yes" of type string)' in text
    assert '\'rdr.granularity\' must be one of ["off", "step", "module", "op"] (got "ops")' in text
    assert "True" not in text and "None" not in text


def test_huge_values_are_cut_in_messages(tmp_path):
    from obs.settings.env_config_file import ConfigFileError, load_file

    path = tmp_path / "obs.json"
    path.write_text(json.dumps({"rdr": {"path": "x" * 100_000}}))
    with pytest.raises(ConfigFileError) as info:
        load_file(str(path))
    assert len(str(info.value)) < 400 and "[100002 chars]" in str(info.value)


def test_a_ring_larger_than_the_bound_is_refused_with_the_size_it_would_take(tmp_path):
    from obs.settings.env_config_file import ConfigFileError, load_file

    path = tmp_path / "obs.json"
    path.write_text(json.dumps({"rdr": {"enable": True, "capacity": {"blob": 16777216}}}))
    with pytest.raises(ConfigFileError) as info:
        load_file(str(path))
    text = str(info.value)
    assert "capacity.blob=16777216 asks for a ring file of 32.0 GiB" in text and "the limit is 1.0 GiB" in text
    assert not list(tmp_path.iterdir())[1:]  # nothing was created beside the config
