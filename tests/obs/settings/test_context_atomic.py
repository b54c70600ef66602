"""A set_context call whose applying fails half-way changes nothing: every applier is rolled back."""

from __future__ import annotations

import json
import os

import pytest

import obs
from obs.settings import _context


class Injected(RuntimeError):
    pass


def _state():
    rec = obs.rdr.recorder()
    return (dict(_context.snapshot()), obs.env_config(), rec is not None, obs.get_context("deterministic"),
            obs.get_context("print_file_path"))


def _files(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


@pytest.mark.parametrize("index", range(len(_context._appliers)))
@pytest.mark.parametrize("when", ["before", "after"])
def test_failure_injected_in_any_applier_rolls_the_whole_call_back(tmp_path, monkeypatch, index, when):
    config = tmp_path / "obs.json"
    config.write_text(json.dumps({"rdr": {"enable": True, "path": str(tmp_path / "rdr"), "granularity": "step"}}))
    before = _state()
    appliers = list(_context._appliers)
    victim = appliers[index]
    real = victim.commit

    def failing(prepared, values, changes):
        if values.get("op_timeout") == 77:  # only the forward commit, not the rollback
            if when == "after":
                real(prepared, values, changes)
            raise Injected(f"injected into {type(victim).__name__}")
        return real(prepared, values, changes)

    monkeypatch.setattr(victim, "commit", failing)
    with pytest.raises(Injected):
        obs.set_context(env_config_path=str(config), print_file_path=str(tmp_path / "p.pb"), deterministic="ON",
                        op_timeout=77, save_graphs=1, save_graphs_path=str(tmp_path / "graphs"))
    assert _state() == before
    assert obs.rdr.recorder() is None
    assert _files(tmp_path) == ["obs.json"]  # no print file, ring or marker was left behind


def test_a_lone_surrogate_in_a_path_is_refused_before_anything_is_applied(tmp_path):
    config = tmp_path / "obs.json"
    config.write_text('{"rdr": {"enable": true, "path": "/tmp/x\\udc80y"}}')
    with pytest.raises(ValueError, match=r"'rdr.path' must be valid Unicode text \(no lone surrogates\)"):
        obs.set_context(env_config_path=str(config))
    assert obs.env_config()["rdr"]["enable"] is False and obs.rdr.recorder() is None
