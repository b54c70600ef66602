"""Hot reload of the env config file's dump and nan_check sections during training (applied at a step boundary)."""

from __future__ import annotations

import json
import os
import time
import warnings

import pytest
import torch

import obs
from obs.features.dump import DumpReader
from obs.features.env_config import feature as env_feature

# Every test with the reloaded dump and NaN/Inf check on their C++ hooks and on Python's (tests/conftest.py).
pytestmark = [pytest.mark.native("DUMP"), pytest.mark.usefixtures("native_path")]

TIMEOUT = 20


def write(path, body):
    tmp = path.with_name(".cfg.json.tmp")
    tmp.write_text(json.dumps(body))
    os.replace(tmp, path)  # one rename: the watcher sees one change


def dump_section(root, net_name, iteration="all"):
    return {"common_dump_settings": {"dump_mode": 0, "path": str(root), "net_name": net_name, "iteration": iteration,
                                     "saved_data": "statistic", "input_output": 2, "kernels": [],
                                     "support_device": [0]}}


def test_a_reloaded_dump_section_takes_effect_at_the_next_step(tmp_path, monkeypatch):
    monkeypatch.setattr(env_feature, "debounce_s", 0.0)
    cfg = tmp_path / "cfg.json"
    write(cfg, {"dump": dump_section(tmp_path / "d", "First")})
    obs.set_context(env_config_path=str(cfg))
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)

    def step():
        net(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()

    step()
    step()
    write(cfg, {"dump": dump_section(tmp_path / "d", "Second", iteration="3-4"),
                "nan_check": {"enable": True, "path": str(tmp_path)}})
    staged = env_feature.wait_staged(lambda c: c.values["nan_check"]["enable"], TIMEOUT)
    assert staged is not None
    for _ in range(4):
        step()
    obs.reset_context()
    steps = [(s.net, s.iteration) for s in DumpReader(str(tmp_path / "d")).steps()]
    # the reload lands at the boundary after step 3 began or before it: First keeps 0-1 (and 2 when it came late)
    assert steps[:2] == [("First", 0), ("First", 1)] and ("Second", 3) in steps and ("Second", 4) in steps
    assert not [it for net, it in steps if net == "Second" and it not in (3, 4)]

    bad = {"dump": dump_section(tmp_path / "d", "Third", iteration="9-1")}
    obs.set_context(env_config_path=str(cfg))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the watcher warns (ObsConfigWarning) and keeps the settings in force
        write(cfg, bad)
        deadline = time.monotonic() + TIMEOUT
        while env_feature.last_error is None and time.monotonic() < deadline:
            time.sleep(0.05)
    assert env_feature.last_error is not None and "is reversed" in env_feature.last_error
