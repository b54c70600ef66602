"""The env config's ``monitor`` section and the msprobe monitor config file it names."""

from __future__ import annotations

import json

import pytest

from obs._core.errors import ObsConfigError
from obs.settings.env_config_file import ConfigFileError, parse_text, resolve
from obs.settings.monitor_options import load_msprobe_config, merged

#: msprobe's own example of every key (its monitor documentation's "详细配置" section), as a user has it.
MSPROBE_EXAMPLE = {
    "targets": {"language_model.encoder.layers.0": {"input": "tuple[2]:0", "output": "tensor",
                                                     "input_grad": "tuple[2]:0", "output_grad": "tuple[1]:0"}},
    "print_struct": False,
    "module_ranks": [0, 1, 2, 3],
    "ur_distribution": True,
    "xy_distribution": True,
    "all_xy": True,
    "forward_only": False,
    "backward_only": False,
    "mv_distribution": True,
    "wg_distribution": True,
    "cc_distribution": {"enable": True, "cc_codeline": []},
    "alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}], "dump": False},
    "format": "tensorboard",
    "ops": ["min", "max", "norm", "zeros", "nans", "mean"],
    "eps": 1e-8,
    "ndigits": 12,
}


def _file(tmp_path, body, name="monitor_config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(body))
    return str(path)


def test_msprobes_example_config_is_accepted_as_it_is(tmp_path):
    """Every key of msprobe's documented example passes; the ones obs acts on come back validated."""
    values = load_msprobe_config(_file(tmp_path, MSPROBE_EXAMPLE))
    assert values["ops"] == ["min", "max", "norm", "zeros", "nans", "mean"]
    assert values["alert"]["rules"][0]["args"]["threshold"] == 0.5
    assert values["module_ranks"] == [0, 1, 2, 3] and values["ndigits"] == 12
    assert "forward_only" not in values  # accepted, not acted on


def test_section_keys_win_over_the_file(tmp_path):
    """Defaults < the msprobe file < the section's own keys."""
    path = _file(tmp_path, {"ops": ["norm", "max"], "wg_distribution": True, "start_step": 5})
    parsed = parse_text(json.dumps({"monitor": {"enable": True, "config_file": path, "start_step": 7}}), "obs.json")
    cfg = resolve(parsed, {})
    got = merged(cfg.values["monitor"], cfg.origins["monitor"])
    assert (got["ops"], got["wg_distribution"], got["start_step"], got["step_interval"]) == (["norm", "max"], True,
                                                                                              7, 1)


def test_bad_values_in_the_file_name_the_file_the_key_and_the_value(tmp_path):
    path = _file(tmp_path, {"ops": ["norm", "nrom"], "eps": "small", "alert": {"rules": [{"rule_name":
                            "AnomalyTurbulence"}]}, "targtes": {}})
    with pytest.raises(ObsConfigError) as info:
        load_msprobe_config(path)
    text = str(info.value)
    assert path in text and "4 problem(s)" in text
    assert '"nrom"' in text and 'did you mean "norm"' in text
    assert "'eps' must be a number" in text
    assert "AnomalyTurbulence needs one" in text
    assert 'unknown key "targtes"' in text and 'did you mean "targets"' in text


def test_the_section_check_reports_the_files_problems(tmp_path):
    """`obs config check` and set_context see a bad msprobe file through the section, with every other problem."""
    path = _file(tmp_path, {"format": "json"})
    with pytest.raises(ConfigFileError) as info:
        parse_text(json.dumps({"monitor": {"enable": "yes", "config_file": path}}), "obs.json")
    text = str(info.value)
    assert "'monitor.enable' must be true or false" in text
    assert f"monitor.config_file {path}" in text and "'format' must be one of" in text


@pytest.mark.parametrize(("body", "words"), [
    ({"config_file": "relative.json"}, "an absolute path"),
    ({"window": 2}, "'monitor.window' must be an int in [3, 100000]"),
    ({"threshold": -1}, "'monitor.threshold' must be a finite number >= 0"),
    ({"targets": {"h.0": "tensor"}}, "'monitor.targets.h.0' must be an object"),
    ({"cc_distribution": {"enabled": True}}, 'has no key "enabled"'),
    ({"alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": -0.5}}]}}, ">= 0"),
    ({"ops": []}, "a non-empty list"),
])
def test_bad_section_values_are_clear_errors(body, words):
    with pytest.raises(ConfigFileError) as info:
        parse_text(json.dumps({"monitor": body}), "obs.json")
    assert words in str(info.value)


def test_a_missing_or_broken_file_is_an_error(tmp_path):
    with pytest.raises(ObsConfigError, match="cannot be read"):
        load_msprobe_config(str(tmp_path / "missing.json"))
    broken = tmp_path / "broken.json"
    broken.write_text('{"ops": [')
    with pytest.raises(ObsConfigError, match="is not valid JSON at line 1"):
        load_msprobe_config(str(broken))
