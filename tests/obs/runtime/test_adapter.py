"""The PyTorch adapter on CPU torch: hooks only when needed, steps, scopes, ops, faults, suppression."""

from __future__ import annotations

import pytest
import torch
from torch.nn.modules import module as nn_module
from torch.optim import optimizer as torch_optimizer

import obs
from obs._core.internal import internal_error_counts, set_raise_internal_errors, suppressed
from obs.runtime.torch import adapter, current_scope
from tests.training import train


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.act = torch.nn.ReLU()
        self.fc2 = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def global_hook_counts():
    return (len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks),
            len(torch_optimizer._global_optimizer_pre_hooks), len(torch_optimizer._global_optimizer_post_hooks))


ORIGINAL_CALL = torch.nn.Module._wrapped_call_impl


def calls_through() -> bool:
    """Module.__call__ is torch's, or obs's wrapper left in place once torch.compile was loaded, publishing nothing."""
    from obs.runtime.torch import _modules

    return torch.nn.Module.__call__ is ORIGINAL_CALL or (
        bool(_modules._kept) and torch.nn.Module.__call__ is _modules._kept[0])


def test_no_subscriber_means_no_hook():
    assert adapter.installed == {"steps": False, "modules": False, "ops": False, "collectives": False,
                                 "phases": False, "compiles": False, "graph_stats": False}
    assert global_hook_counts() == (0, 0, 0, 0)
    assert calls_through()


def test_hooks_come_and_go_with_subscribers():
    with obs.subscribe(obs.Event.MODULE_ENTER, lambda scope, module: None):
        assert adapter.installed["modules"] and torch.nn.Module.__call__ is not ORIGINAL_CALL
        with obs.subscribe(obs.Event.STEP_END, lambda step, ns: None):
            assert global_hook_counts() == (0, 0, 1, 1)
    assert global_hook_counts() == (0, 0, 0, 0)
    assert calls_through()


def test_steps_are_detected_from_optimizer_step():
    events = []
    obs.subscribe(obs.Event.STEP_BEGIN, lambda step: events.append(("begin", step)))
    obs.subscribe(obs.Event.STEP_END, lambda step, ns: events.append(("end", step)))
    train(3, Net(), marked=False)
    assert events == [("begin", 1), ("end", 1), ("begin", 2), ("end", 2), ("begin", 3), ("end", 3)]


def test_explicit_steps_take_precedence_over_detection():
    ends = []
    obs.subscribe(obs.Event.STEP_END, lambda step, ns: ends.append(step))
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for batch in obs.steps([torch.randn(5, 4) for _ in range(2)]):
        for _ in range(2):  # two optimizer steps inside one marked step
            opt.zero_grad()
            model(batch).sum().backward()
            opt.step()
    assert ends == [1, 2]


def test_module_scopes_follow_mindspore_full_names():
    scopes = []
    obs.subscribe(obs.Event.MODULE_ENTER, lambda scope, module: scopes.append(scope))
    Net()(torch.randn(1, 4))
    assert scopes == ["Default/net-Net", "Default/net-Net/fc1-Linear", "Default/net-Net/act-ReLU",
                      "Default/net-Net/fc2-Linear"]


def test_scopes_without_class_names():
    obs.set_context(reserve_class_name_in_scope=False)
    scopes = []
    obs.subscribe(obs.Event.MODULE_ENTER, lambda scope, module: scopes.append(scope))
    Net()(torch.randn(1, 4))
    assert scopes[1] == "Default/net/fc1"


def test_current_scope_inside_forward():
    inside = []
    obs.subscribe(obs.Event.MODULE_ENTER, lambda scope, module: inside.append(current_scope()))
    Net()(torch.randn(1, 4))
    assert inside[-1] == "Default/net-Net/fc2-Linear" and current_scope() == ""


def test_failing_module_reports_exit_error_and_one_fault():
    class Bad(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Linear(4, 3)

        def forward(self, x):
            return self.inner(x) @ torch.ones(2, 2)  # shape error in the outer module

    exits, faults = [], []
    obs.subscribe(obs.Event.MODULE_EXIT, lambda scope, module, error: exits.append((scope, type(error))))
    obs.subscribe(obs.Event.FAULT, lambda kind, detail, error: faults.append((kind, detail)))
    with pytest.raises(RuntimeError):
        Bad()(torch.randn(1, 4))
    assert exits == [("Default/net-Bad/inner-Linear", type(None)), ("Default/net-Bad", RuntimeError)]
    assert faults == [("module_error", "Default/net-Bad")]
    assert current_scope() == ""


def test_op_events_carry_names_and_durations():
    ops = []
    with obs.subscribe(obs.Event.OP, lambda name, args, kwargs, ns, error: ops.append((name, ns, error))):
        assert adapter.installed["ops"]
        torch.mm(torch.ones(2, 2), torch.ones(2, 2))
    assert [name for name, _, _ in ops] == ["ones.default", "ones.default", "mm.default"]
    assert all(ns > 0 and error is None for _, ns, error in ops)
    assert not adapter.installed["ops"]


def test_suppressed_work_is_invisible_to_hooks():
    ops, scopes = [], []
    obs.subscribe(obs.Event.OP, lambda name, args, kwargs, ns, error: ops.append(name))
    obs.subscribe(obs.Event.MODULE_ENTER, lambda scope, module: scopes.append(scope))
    with suppressed():
        Net()(torch.ones(1, 4))
        torch.ones(3).sum()
    assert ops == [] and scopes == []


def test_memory_event_at_step_end_reports_rss_on_cpu(monkeypatch):
    import obs.runtime.steps as steps_module

    monkeypatch.setattr(steps_module, "MEMORY_INTERVAL_NS", 0)
    stats = []
    obs.subscribe(obs.Event.MEMORY, lambda step, s: stats.append((step, s)))
    train(2, Net(), marked=False)
    assert [s for s, _ in stats] == [1, 2]
    assert stats[0][1]["device"] == "cpu" and stats[0][1]["rss_bytes"] > 0


def test_memory_is_sampled_at_most_every_interval(monkeypatch):
    import obs.runtime.steps as steps_module

    monkeypatch.setattr(steps_module, "MEMORY_INTERVAL_NS", 3_600 * 10**9)
    stats = []
    obs.subscribe(obs.Event.MEMORY, lambda step, s: stats.append(step))
    train(4, Net(), marked=False)
    assert stats == [1]


def test_our_bug_never_breaks_the_training_loop():
    """With internal errors in production mode, a failing subscriber is counted, training goes on."""
    def broken(scope, module):
        raise KeyError("bug in a subscriber")

    obs.subscribe(obs.Event.MODULE_ENTER, broken)
    old = set_raise_internal_errors(False)
    try:
        train(2, Net(), marked=False)
    finally:
        set_raise_internal_errors(old)
    assert internal_error_counts()["MODULE_ENTER handler"] >= 8


def test_failing_op_reports_op_event_and_fault():
    ops, faults = [], []
    obs.subscribe(obs.Event.OP, lambda name, args, kwargs, ns, error: ops.append((name, type(error))))
    obs.subscribe(obs.Event.FAULT, lambda kind, detail, error: faults.append((kind, detail)))
    with pytest.raises(RuntimeError):
        torch.mm(torch.ones(2, 3), torch.ones(2, 3))
    assert ops[-1] == ("mm.default", RuntimeError)
    assert faults == [("op_error", "mm.default")]


def test_graph_call_marks_step_start_in_graph_mode():
    """Module events fold away inside compiled graphs; the compiled graph's call opens the step."""
    obs.set_context(mode=obs.GRAPH_MODE)
    net = Net()
    begins = []  # (step, whether backward already ran): a begin from the optimizer hook would see grads
    obs.subscribe(obs.Event.STEP_BEGIN, lambda step: begins.append((step, net.fc1.weight.grad is not None)))
    train(2, obs.compile(net, backend="eager"), marked=False)
    assert begins == [(1, False), (2, False)]
