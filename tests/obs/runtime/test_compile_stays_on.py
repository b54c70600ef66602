"""torch.compile compiles the same frames with every obs feature on as without obs, and the numbers are the same.

Dynamo's own counters (``torch._dynamo.utils.counters``) say how many frames it compiled and why graphs broke;
each feature is set through its public API and runs a compiled model for a few training steps.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import torch

import obs
from tests.training import CompiledRun, train_compiled

pytestmark = pytest.mark.native()


class Net(torch.nn.Module):
    def __init__(self, graph_break: bool) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 4)
        self.graph_break = graph_break

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        if self.graph_break:
            torch._dynamo.graph_break()
        return self.fc2(h)


def env_file(tmp_path, sections: dict[str, Any]) -> None:
    path = tmp_path / "env.json"
    path.write_text(json.dumps(sections))
    obs.set_context(env_config_path=str(path))


def dump(tmp_path, saved_data: str = "statistic") -> dict[str, Any]:
    return {"dump": {"common_dump_settings": {
        "dump_mode": 0, "path": str(tmp_path / "dump"), "net_name": "Net", "iteration": "all",
        "saved_data": saved_data, "input_output": 0, "kernels": [], "support_device": [0]}}}


FEATURES: dict[str, Callable[[Any], None]] = {
    "save_graphs=1": lambda d: obs.set_context(save_graphs=1, save_graphs_path=str(d / "graphs")),
    "save_graphs=3": lambda d: obs.set_context(save_graphs=3, save_graphs_path=str(d / "graphs")),
    "data dump statistic": lambda d: env_file(d, dump(d)),
    "data dump tensor": lambda d: env_file(d, dump(d, "tensor")),
    "nan_check module": lambda d: env_file(d, {"nan_check": {"enable": True, "path": str(d)}}),
    "nan_check op": lambda d: env_file(d, {"nan_check": {"enable": True, "granularity": "op", "path": str(d)}}),
    "exception_dump": lambda d: env_file(d, {"exception_dump": {"enable": True, "path": str(d)}}),
    "rdr module": lambda d: env_file(d, {"rdr": {"enable": True, "path": str(d)}}),
    "rdr op": lambda d: env_file(d, {"rdr": {"enable": True, "path": str(d), "granularity": "op"}}),
    "print to file": lambda d: obs.set_context(print_file_path=str(d / "print.pb")),
    "profiler task_trace": lambda d: obs.set_context(enable_profiling=True, profiling_options=json.dumps(
        {"output": str(d / "prof"), "task_trace": "on"})),
    "profiler op_trace": lambda d: obs.set_context(enable_profiling=True, profiling_options=json.dumps(
        {"output": str(d / "prof"), "task_trace": "on", "op_trace": "on"})),
    "everything": lambda d: (env_file(d, {
        **dump(d), "nan_check": {"enable": True, "granularity": "op", "path": str(d)},
        "exception_dump": {"enable": True, "path": str(d)},
        "rdr": {"enable": True, "path": str(d), "granularity": "op"}}),
        obs.set_context(save_graphs=3, save_graphs_path=str(d / "graphs"), print_file_path=str(d / "print.pb"))),
}


def compiled_run(graph_break: bool, steps: int = 3) -> CompiledRun:
    """The losses and Dynamo's counters of a ``Net`` compiled with aot_eager and trained for ``steps``."""
    torch.manual_seed(0)
    return train_compiled(Net(graph_break), steps, lambda: (torch.randn(4, 8),), backend="aot_eager")


@pytest.fixture(scope="module")
def without_obs() -> Callable[[bool], CompiledRun]:
    """``without_obs(graph_break)``: :func:`compiled_run` with obs off, run once for the module (it is the same
    for every feature and path)."""
    done: dict[bool, CompiledRun] = {}

    def get(graph_break: bool) -> CompiledRun:
        if graph_break not in done:
            done[graph_break] = compiled_run(graph_break)
        return done[graph_break]
    return get


@pytest.mark.parametrize("graph_break", [False, True], ids=["one graph", "graph break"])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_every_feature_compiles_the_frames_compiled_without_obs(feature, graph_break, tmp_path, native_path,
                                                                 without_obs):
    without = without_obs(graph_break)
    FEATURES[feature](tmp_path)
    with_obs = compiled_run(graph_break)
    obs.reset_context()
    assert with_obs.frames == without.frames and with_obs.breaks == without.breaks
    assert with_obs.losses == without.losses  # bit for bit


def test_a_compiled_module_is_recorded_once_under_its_own_name(native_path):
    scopes: list[str] = []
    model = Net(graph_break=False)
    compiled = torch.compile(model, backend="aot_eager")
    with obs.subscribe(obs.Event.MODULE_ENTER, lambda scope, module: scopes.append(scope)):
        compiled(torch.randn(2, 8)).sum().backward()
        compiled(torch.randn(2, 8)).sum().backward()
    assert scopes == ["Default/net-Net", "Default/net-Net"]


def test_a_module_compiled_in_place_is_recorded_once(native_path):
    scopes: list[str] = []
    model = Net(graph_break=False)
    model.compile(backend="aot_eager")
    with obs.subscribe(obs.Event.MODULE_ENTER, lambda scope, module: scopes.append(scope)):
        model(torch.randn(2, 8)).sum().backward()
    assert scopes == ["Default/net-Net"]
