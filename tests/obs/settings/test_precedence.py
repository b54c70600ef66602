"""Precedence of env-config sources: defaults < MS_RDR_* environment < the file. One test per pair."""

from __future__ import annotations

import pytest

from obs.settings.env_config_file import parse_text, resolve


def test_environment_beats_defaults():
    cfg = resolve(None, {"MS_RDR_ENABLE": "1", "MS_RDR_MODE": "2", "MS_RDR_PATH": "/var/rdr"})
    assert cfg.values["rdr"] == {"enable": True, "mode": 2, "path": "/var/rdr", "granularity": "module",
                                 "capacity": {}, "hang_action": "dump", "memory_history": 0}
    assert cfg.origins["rdr"]["mode"] == "env MS_RDR_MODE"


def test_file_beats_environment():
    parsed = parse_text('{"rdr": {"enable": false, "path": "/file/rdr"}}', "f.json")
    cfg = resolve(parsed, {"MS_RDR_ENABLE": "1", "MS_RDR_MODE": "2", "MS_RDR_PATH": "/env/rdr"})
    assert cfg.values["rdr"]["enable"] is False and cfg.values["rdr"]["mode"] == 2
    assert cfg.values["rdr"]["path"] == "/file/rdr"
    assert cfg.origins["rdr"] == {"enable": "file", "mode": "env MS_RDR_MODE", "path": "file",
                                  "granularity": "default", "capacity": "default", "hang_action": "default",
                                  "memory_history": "default"}


def test_keys_absent_everywhere_keep_defaults():
    cfg = resolve(parse_text('{"sys": {}}', "f.json"), {})
    assert cfg.origins["rdr"]["enable"] == "default" and cfg.values["sys"]["mem_reuse"] is True


@pytest.mark.parametrize("var, value, fragment", [
    ("MS_RDR_ENABLE", "yes", "MS_RDR_ENABLE must be 1 or 0"),
    ("MS_RDR_MODE", "3", "MS_RDR_MODE must be 1 or 2"),
    ("MS_RDR_PATH", "rel/dir", "MS_RDR_PATH"),
])
def test_bad_environment_values_name_the_variable(var, value, fragment):
    with pytest.raises(ValueError, match=fragment):
        resolve(None, {var: value})
