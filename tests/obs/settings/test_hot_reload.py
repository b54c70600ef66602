"""Hot reload of env_config_path, driven by file-system events (no sleeps: we wait on events).

A reload is validated and staged by the watcher thread and applied at the next step boundary on
the training thread; ``boundary()`` stands for the training loop's next step.
"""

from __future__ import annotations

import json
import logging
import os
import threading

import pytest

import obs
from obs.features.env_config import feature
from obs.runtime.steps import tracker

TIMEOUT = 20


def boundary():
    with obs.step():
        pass


def staged(**rdr):
    """Wait until the watcher has validated a reload whose rdr section holds ``rdr``."""
    return feature.wait_staged(lambda cfg: all(cfg.values["rdr"][k] == v for k, v in rdr.items()), TIMEOUT)


@pytest.fixture(name="config")
def _config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # an rdr section without a path writes into the current folder
    monkeypatch.setattr(feature, "debounce_s", 0.05)
    path = tmp_path / "obs.json"
    path.write_text(json.dumps({"rdr": {"enable": False}}))
    changed = threading.Event()

    def on_change(source, changes):
        if source == str(path):
            changed.set()

    obs.subscribe(obs.Event.SETTINGS_CHANGED, on_change)
    obs.set_context(env_config_path=str(path))
    return path, changed


def test_edit_in_place_is_applied(config, tmp_path):
    path, changed = config
    path.write_text(json.dumps({"rdr": {"enable": True, "mode": 2}}))
    assert staged(enable=True, mode=2)
    assert obs.env_config()["rdr"]["enable"] is False and not changed.is_set()  # staged, not applied
    boundary()
    assert changed.is_set()
    assert obs.env_config()["rdr"]["enable"] is True and obs.env_config()["rdr"]["mode"] == 2
    assert (tmp_path / "rank_0" / "rdr" / "marker.json").exists()  # the current folder is tmp_path


def test_a_reload_is_applied_on_the_training_thread_never_the_watchers(config):
    path, _ = config
    threads = []
    obs.subscribe(obs.Event.SETTINGS_CHANGED, lambda source, changes: threads.append(threading.current_thread()))
    path.write_text(json.dumps({"rdr": {"enable": True, "granularity": "op"}}))
    assert staged(enable=True, granularity="op")
    boundary()
    assert threads == [threading.main_thread()]
    assert obs.rdr.recorder().config.granularity == "op"


def test_atomic_save_by_rename_is_applied(config):
    path, changed = config
    tmp = path.with_name(".obs.json.tmp")
    tmp.write_text(json.dumps({"rdr": {"enable": True}}))
    os.replace(tmp, path)
    assert staged(enable=True)
    boundary()
    assert changed.is_set() and obs.env_config()["rdr"]["enable"] is True


def test_recreated_file_is_applied(config):
    path, changed = config
    path.unlink()
    path.write_text(json.dumps({"sys": {"mem_reuse": False}}))
    assert feature.wait_staged(lambda cfg: cfg.values["sys"]["mem_reuse"] is False, TIMEOUT)
    boundary()
    assert changed.is_set() and obs.env_config()["sys"]["mem_reuse"] is False


def test_invalid_edit_keeps_last_good_settings_and_warns_once(config, caplog):
    path, changed = config
    watcher = feature.watcher
    done = watcher.callbacks
    caplog.set_level(logging.WARNING, logger="obs")
    with pytest.warns(obs.ObsConfigWarning, match="keeping the settings in force") as warned:
        for _ in range(2):
            path.write_text('{"rdr": {"mode": 7}}')
            done += 1
            assert watcher.wait_callbacks(done, TIMEOUT)
    assert len([w for w in warned if issubclass(w.category, obs.ObsConfigWarning)]) == 1  # not once per edit
    assert {k: obs.env_config()["rdr"][k] for k in ("enable", "mode", "path")} == {"enable": False, "mode": 1,
                                                                                   "path": ""}
    assert "'rdr.mode' must be one of [1, 2]" in feature.last_error
    assert len([r for r in caplog.records if "keeping the settings in force" in r.getMessage()]) == 1
    path.write_text(json.dumps({"rdr": {"mode": 2}}))
    assert staged(mode=2)
    boundary()
    assert changed.is_set() and obs.env_config()["rdr"]["mode"] == 2 and feature.last_error is None


def test_reload_during_a_step_waits_for_the_step_boundary(config):
    path, changed = config
    watcher = feature.watcher
    done = watcher.callbacks
    with obs.step():
        path.write_text(json.dumps({"rdr": {"enable": True}}))
        assert watcher.wait_callbacks(done + 1, TIMEOUT) and staged(enable=True)
        assert obs.env_config()["rdr"]["enable"] is False  # validated, parked until the step ends
        assert tracker.in_step
    assert changed.is_set()
    assert obs.env_config()["rdr"]["enable"] is True


def test_reset_stops_the_watcher_thread(config):
    watcher = feature.watcher
    assert any(t.name == "obs-config-watch" for t in threading.enumerate())
    obs.reset_context()
    assert feature.watcher is None
    assert not watcher._worker.is_alive() and not watcher._observer.is_alive()


def test_new_path_replaces_the_watcher(config, tmp_path):
    first = feature.watcher
    other = tmp_path / "other.json"
    other.write_text("{}")
    obs.set_context(env_config_path=str(other))
    assert feature.watcher is not first and not first._worker.is_alive()
    assert feature.watcher.path == str(other)
