"""The monitor's activations in compiled models come from graph taps: the same ``actv`` rows as the eager hooks
write, while torch.compile compiles the same frames, breaks no graph and the losses stay the same to the bit.

aot_eager runs in this process (a few steps of a tiny model, with and without the monitor, and eagerly with it);
Inductor in one subprocess of its own (Inductor keeps worker threads for the rest of a process; its cache folder is
the suite's), which compiles the model twice (without obs, and with the taps).  More than 20 s of CPU (about 22 s
beside the suite's other Inductor tests, which build the C++ headers: 11 s for the subprocess with a warm kernel
cache, the rest aot_eager and Dynamo): Inductor's check needs both compiles, and it is the one place where a tap
could change a kernel.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

import obs
from obs._core.internal import internal_error_counts, set_raise_internal_errors
from obs.features.monitor.explain import explain
from obs.features.monitor.feature import feature
from obs.features.monitor.reader import read_run

OPS = ["norm", "min", "max", "mean", "zeros", "nans"]
# No filter of torch's warning about global module hooks: the monitor's discovery hook (one until the first call)
# keeps it from users (names.hush_compile_hook_warning), and the suite turns any warning into an error.


class Net(torch.nn.Module):
    """fc1 -> relu -> shared -> shared -> fc2: ``shared`` is called twice a step (micro steps 0 and 1)."""

    def __init__(self, graph_break: bool = False) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.act = torch.nn.ReLU()
        self.shared = torch.nn.Linear(16, 16)
        self.fc2 = torch.nn.Linear(16, 2)
        self.graph_break = graph_break

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc1(x))
        if self.graph_break:
            torch._dynamo.graph_break()
        return self.fc2(torch.tanh(self.shared(torch.tanh(self.shared(h)))))


def _train(config, *, compiled: bool, graph_break: bool = False, steps: int = 3):
    """Losses, Dynamo's frame counters and graph breaks, and the actv series ({(name, micro, stat): values}) of a few
    SGD steps of :class:`Net` (compiled with aot_eager, or eager), with the monitor on when ``config`` is given."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = Net(graph_break)
    run = torch.compile(model, backend="aot_eager") if compiled else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    if config is not None:
        obs.set_context(env_config_path=str(config))
    losses = []
    for _ in range(steps):
        loss = run(torch.randn(4, 8, generator=g)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    series = None
    if config is not None:
        assert feature.monitor is not None and feature.monitor.flush()
        series = {(s.name, s.micro, s.stat): s.values for s in read_run(feature.monitor.folder).series
                  if s.prefix == "actv"}
        obs.reset_context()
    breaks = {reason.splitlines()[0]: n for reason, n in counters["graph_break"].items()}
    return losses, dict(counters["frames"]), dict(counters["stats"]), breaks, series


def _config(tmp_path, **keys):
    tmp_path.mkdir(exist_ok=True)
    path = tmp_path / "obs.json"
    path.write_text(json.dumps({"monitor": {"enable": True, "path": str(tmp_path / "out"), "xy_distribution": True,
                                            "ops": OPS, **keys}}))
    return path


def _same(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for key, values in want.items():
        assert got[key] == pytest.approx(values, rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize("graph_break", [False, True], ids=["one graph", "graph break"])
def test_aot_eager_activations_come_from_the_graph_and_compile_as_before(tmp_path, recwarn, graph_break):
    raising = set_raise_internal_errors(True)
    errors = dict(internal_error_counts())
    try:
        plain = _train(None, compiled=True, graph_break=graph_break)
        targets = {"fc1": {}, "shared": {}, "fc2": {}}
        config = _config(tmp_path, targets=targets) if graph_break else _config(tmp_path, all_xy=True)
        watched = _train(config, compiled=True, graph_break=graph_break)
        eager = _train(_config(tmp_path / "eager", targets=targets) if graph_break else
                       _config(tmp_path / "eager", all_xy=True), compiled=False)
    finally:
        set_raise_internal_errors(raising)
    assert dict(internal_error_counts()) == errors
    assert watched[0] == plain[0]  # bit for bit
    assert watched[1] == plain[1] and watched[2] == plain[2] and watched[3] == plain[3]  # frames, stats, breaks
    assert bool(watched[3]) == graph_break
    series = watched[4]
    assert ("shared.output", 1, "norm") in series and ("fc1.input", 0, "nans") in series
    if not graph_break:
        assert (".input", 0, "norm") in series and ("act.output", 0, "zeros") in series  # the model; every module
    _same(series, eager[4])  # the eager hooks' rows, the same statistics
    assert not [w for w in recwarn if "hook" in str(w.message) and "torch.compile(module)" not in str(w.message)]


def test_the_taps_go_with_the_monitor(tmp_path):
    """After the monitor is turned off, graphs compile as without obs: no pass left in Inductor, aot_eager's compiler
    as it was."""
    from torch._dynamo.backends import debugging
    from torch._inductor import config

    before = (debugging.boxed_nop, config.post_grad_custom_post_pass)
    _train(_config(tmp_path, targets={"fc1": {}}), compiled=True, steps=1)
    assert (debugging.boxed_nop, config.post_grad_custom_post_pass) == before


def test_a_bad_batch_is_first_seen_in_the_first_layer_of_a_compiled_model(tmp_path):
    """Inputs x1000 at step 150, the model compiled (aot_eager): the first anomaly is the first layer's input."""
    config = tmp_path / "obs.json"
    config.write_text(json.dumps({"monitor": {"enable": True, "path": str(tmp_path / "out"), "xy_distribution": True,
                                              "targets": {"0": {}, "2": {}}, "step_count_per_record": 1000}}))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    compiled = torch.compile(model, backend="aot_eager")
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    w = torch.randn(16, 1)
    try:
        obs.set_context(env_config_path=str(config))
        for step in range(200):
            x = torch.randn(32, 16) * (1e3 if step == 150 else 1.0)
            loss = torch.nn.functional.mse_loss(compiled(x), x @ w)
            loss.backward()
            opt.step()
            opt.zero_grad()
        assert feature.monitor is not None and feature.monitor.flush()
        folder = feature.monitor.folder
    finally:
        torch.set_num_threads(threads)
    first = explain(read_run(folder)).first
    assert first is not None
    assert (first.step, first.kind, first.stage, first.name) == (150, "xy", "forward", "0.input")


SCRIPT = r'''
import json, sys, torch, obs
from torch._dynamo.utils import counters
from obs._core.internal import set_raise_internal_errors
from obs.features.monitor.feature import feature
from obs.features.monitor.reader import read_run
set_raise_internal_errors(True)
torch.set_num_threads(1)

def train(config):
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    compiled = torch.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    if config:
        obs.set_context(env_config_path=config)
    losses, want = [], {}
    for step in range(3):
        x = torch.randn(4, 8, generator=g)
        loss = compiled(x).square().mean()
        with torch.no_grad():  # what the eager hooks would see (the compiled model is called first: it is the model)
            h = model[0](x)
            for name, t in (("0.input", x), ("0.output", h), ("2.input", torch.relu(h)), ("2.output", model(x))):
                want.setdefault(name, []).append([t.norm().item(), t.min().item(), t.max().item()])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    got = None
    if config:
        assert feature.monitor.flush()
        got = {}
        for s in read_run(feature.monitor.folder).series:
            if s.prefix == "actv":
                got.setdefault(s.name, {})[s.stat] = list(s.values)
        obs.reset_context()
    return {"losses": losses, "frames": dict(counters["frames"]), "stats": dict(counters["stats"]),
            "breaks": len(counters["graph_break"]), "got": got, "want": want}

print(json.dumps([train(None), train(sys.argv[1])]))
'''


def test_inductor_activations_come_from_the_graph_and_compile_as_before(tmp_path, inductor_cache):
    config = tmp_path / "obs.json"
    config.write_text(json.dumps({"monitor": {"enable": True, "path": str(tmp_path / "out"), "xy_distribution": True,
                                              "targets": {"0": {}, "2": {}}, "ops": ["norm", "min", "max"]}}))
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": inductor_cache}
    done = subprocess.run([sys.executable, str(script), str(config)], capture_output=True, text=True, timeout=600,
                          env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    plain, watched = json.loads(done.stdout.strip().splitlines()[-1])
    assert watched["losses"] == plain["losses"]  # bit for bit: the taps change no kernel
    assert watched["frames"] == plain["frames"] and watched["stats"] == plain["stats"]
    assert watched["breaks"] == plain["breaks"] == 0
    got, want = watched["got"], watched["want"]
    assert set(got) == set(want)
    for name, steps in want.items():
        for i, stat in enumerate(("norm", "min", "max")):
            expected = [row[i] for row in steps]
            assert got[name][stat] == pytest.approx(expected, rel=1e-4, abs=1e-5), (name, stat)
            assert all(math.isfinite(v) for v in got[name][stat])
