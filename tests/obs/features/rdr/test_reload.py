"""Hot reloads of the rdr section during a real training loop: staged by the watcher thread, swapped at a
step boundary on the training thread, never into a closed ring, never touching signals off the main thread."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

import obs
from obs._core.internal import internal_error_counts
from obs.features.env_config import feature as env_feature
from recorder.bundle_reader import list_bundles
from recorder.layout import Kind
from recorder.ring_reader import read_ring
from recorder.signals import relay

SMALL = {"step": 64, "module": 64, "op": 64, "memory": 16, "collective": 16, "blob": 16}
TIMEOUT = 20


def write(path, rdr):
    tmp = path.with_name(".obs.json.tmp")
    tmp.write_text(json.dumps({"rdr": rdr}))
    os.replace(tmp, path)  # one rename: the watcher sees one change


def stage(rdr):
    """Wait until the watcher has validated and staged the file holding ``rdr``."""
    staged = env_feature.wait_staged(lambda cfg: all(cfg.values["rdr"][k] == v for k, v in rdr.items()), TIMEOUT)
    assert staged is not None, f"reload of {rdr} was not staged"


def trainer():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)

    def step():
        with obs.step() as number:
            net(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
        return number
    return step


def ring_steps(recorder):
    lines = read_ring(recorder.ring.buffer()).event_lines((Kind.STEP_END,))
    return {json.loads(line)["step"] for line in lines}


@pytest.mark.slow
def test_1000_reloads_switch_the_recorder_and_every_step_is_recorded_by_exactly_one(tmp_path, monkeypatch):
    monkeypatch.setattr(env_feature, "debounce_s", 0.0)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    variants = [{"enable": True, "mode": 1, "path": a}, {"enable": False, "mode": 1, "path": a},
                {"enable": True, "mode": 2, "path": a}, {"enable": True, "mode": 2, "path": b},
                {"enable": False, "mode": 2, "path": b}, {"enable": True, "mode": 1, "path": b}]
    path = tmp_path / "obs.json"
    write(path, {**variants[-1], "granularity": "step", "capacity": SMALL})
    errors_before = internal_error_counts()
    obs.set_context(env_config_path=str(path))
    step = trainer()
    recorders: list = []  # every recorder seen, in order
    owned: dict[int, set[int]] = {}  # index in recorders -> the steps during which it was live
    for i in range(1000):
        want = variants[i % len(variants)]
        write(path, {**want, "granularity": "step", "capacity": SMALL})
        stage(want)
        number = step()  # the swap happens at this step's boundary, on this thread
        live = obs.rdr.recorder()
        assert (live is not None) is want["enable"], i
        if live is not None:
            assert (live.config.mode, live.config.path) == (want["mode"], want["path"])
            assert live.dir == os.path.join(want["path"], "rank_0", "rdr")
            if not recorders or recorders[-1] is not live:
                recorders.append(live)
            mine = owned.setdefault(len(recorders) - 1, set())
            mine.add(number)
            assert ring_steps(live) == mine, i  # this step, and no step of another recorder
        assert all(rec.ring.closed for rec in recorders if rec is not live)  # the others record nothing more
    obs.reset_context()
    assert internal_error_counts() == errors_before
    assert len(recorders) > 300  # path changes and on/off restart it; mode changes retune it
    assert sum(len(steps) for steps in owned.values()) == sum(1 for i in range(1000) if variants[i % 6]["enable"])
    assert not os.path.exists(a)  # clean exits with nothing to report leave nothing; a restart reports nothing
    # turning off a mode 2 recorder (the file, reset_context at the end) ends its recording normally: one
    # normal_end bundle each time, and nothing else
    last = variants[999 % 6]
    offs = sum(1 for i in range(1000) if variants[i % 6] == variants[4]) + (last["enable"] and last["mode"] == 2)
    assert [info.reason for info in list_bundles(b).bundles] == ["normal_end"] * offs


def test_200_reloads_of_granularity_recorder_and_signal_settings_keep_manifests_true(tmp_path, monkeypatch):
    monkeypatch.setattr(env_feature, "debounce_s", 0.0)
    out = str(tmp_path / "out")
    variants = [{"enable": True, "granularity": "step", "mode": 1, "hang_action": "dump"},
                {"enable": True, "granularity": "op", "mode": 2, "hang_action": "abort"},
                {"enable": False, "granularity": "op", "mode": 2, "hang_action": "abort"},
                {"enable": True, "granularity": "module", "mode": 1, "hang_action": "abort"},
                {"enable": True, "granularity": "off", "mode": 2, "hang_action": "dump"},
                {"enable": True, "granularity": "op", "mode": 1, "hang_action": "dump"}]
    path = tmp_path / "obs.json"
    write(path, {**variants[-1], "path": out, "capacity": SMALL})
    errors_before = internal_error_counts()
    obs.set_context(env_config_path=str(path))
    step = trainer()
    dumps = 0
    for i in range(200):
        want = variants[i % len(variants)]
        write(path, {**want, "path": out, "capacity": SMALL})
        stage(want)
        step()
        live = obs.rdr.recorder()
        handler = signal.getsignal(signal.SIGTERM)
        if not want["enable"]:
            assert live is None and relay() is None and handler == signal.SIG_DFL  # restored on the main thread
            continue
        assert relay() is not None and handler == relay()._python_handler and relay().target is not None
        if i % 4:
            continue
        step()
        manifest_path = obs.rdr.dump(f"reload{i}")
        dumps += 1
        manifest = json.loads(Path(manifest_path, "manifest.json").read_text())
        rdr = manifest["settings"]["env_config"]["rdr"]
        assert manifest["granularity"] == want["granularity"]
        assert {k: rdr[k] for k in want} == want
        kinds = {json.loads(line)["kind"] for line in Path(manifest_path, "events.jsonl").read_text().splitlines()}
        assert ("op" in kinds) is (want["granularity"] == "op"), (i, want, kinds)
        assert ("step_end" in kinds) is (want["granularity"] != "off")
    obs.reset_context()
    assert internal_error_counts() == errors_before
    assert dumps == sum(1 for i in range(0, 200, 4) if variants[i % 6]["enable"]) and relay() is None
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_reloads_applied_on_a_training_thread_that_is_not_main_never_touch_signals(tmp_path, monkeypatch):
    import threading

    monkeypatch.setattr(env_feature, "debounce_s", 0.0)
    out = str(tmp_path / "out")
    path = tmp_path / "obs.json"
    write(path, {"enable": True, "path": out, "capacity": SMALL})
    obs.set_context(env_config_path=str(path))  # main thread: the relay is installed here
    installed = relay()
    assert installed is not None and signal.getsignal(signal.SIGTERM) == installed._python_handler
    errors_before = internal_error_counts()
    seen: list = []
    failures: list = []

    def training():
        try:
            step = trainer()
            for i in range(40):
                want = {"enable": i % 2 == 1, "path": out, "granularity": ("module", "step")[i % 4 // 2]}
                write(path, {**want, "capacity": SMALL})
                stage(want)
                step()
                live = obs.rdr.recorder()
                seen.append((live is not None, relay() is installed, installed.target is not None))
        except BaseException as exc:  # noqa: BLE001 - reported to the main thread below
            failures.append(exc)

    worker = threading.Thread(target=training, name="trainer")
    worker.start()
    worker.join(120)
    assert not worker.is_alive() and not failures, failures
    # Off the main thread the recorder came and went; the relay stayed, following it, never reinstalled.
    assert seen == [(i % 2 == 1, True, i % 2 == 1) for i in range(40)]
    assert signal.getsignal(signal.SIGTERM) == installed._python_handler
    assert internal_error_counts() == errors_before
    obs.reset_context()  # main thread: now restored
    assert relay() is None and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
