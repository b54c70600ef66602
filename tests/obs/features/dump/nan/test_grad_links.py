"""The NaN/Inf check leaves unread the gradients a finite-preserving backward makes from checked ones, and only
those."""

from __future__ import annotations

import json

import pytest
import torch

import obs
from obs.features.dump.feature import feature
from obs.features.dump.nan import native_check
from obs.features.dump.nan._grad_links import preserves_in_backward
from obs.features.dump.nan.check import NanCheck, NonFiniteError
from tests.obs.features.dump.nan.test_check import GradToNan

pytestmark = pytest.mark.native("DUMP")  # the path native_path switches (tests/conftest.py)


@pytest.fixture
def check(native_path, tmp_path):
    """The armed check (module granularity, backward on): its C++ hooks, or the Python path (tests/conftest.py)."""
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"nan_check": {"enable": True, "path": str(tmp_path)}}))
    obs.set_context(env_config_path=str(path))
    armed = feature.nan
    assert isinstance(armed, NanCheck)
    assert (armed._native is None) is (native_path == "python"), native_check.unavailable_reason()
    yield armed
    obs.reset_context()


def findings(tmp_path):
    root = tmp_path / "rank_0" / "nan_check"
    return [json.loads((f / "meta.json").read_text()) for f in sorted(root.iterdir())] if root.exists() else []


def cnn():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(4, 8, 3, padding=1), torch.nn.Tanh(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(8 * 2 * 2, 3))


def test_a_chain_reads_only_the_gradients_no_finite_preserving_backward_makes(check, tmp_path):
    cnn()(torch.randn(2, 1, 8, 8)).sum().backward()
    # Read: the linear's output gradient and each max-pool's (a conv's backward made it).  Not read: what ReLU,
    # Tanh and the pools' backward made from them (the convs' and activations' output gradients): 3 of 7.
    assert check.gradients_read == 3
    assert findings(tmp_path) == []


class Residual(torch.nn.Module):
    """fc → ReLU, and the fc's output also added back (outside any module) through a poisoned path."""

    def __init__(self, poison: bool):
        super().__init__()
        self.fc, self.act, self.head = torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)
        self.poison = poison

    def forward(self, x):
        h = self.fc(x)
        skip = GradToNan.apply(h) if self.poison else h
        return self.head(self.act(h) + skip)


def test_a_second_user_of_the_input_makes_its_gradient_checked(check, tmp_path):
    Residual(poison=True)(torch.randn(3, 4)).sum().backward()
    [found] = findings(tmp_path)
    # The NaN reaches fc's output through the skip path only: ReLU's checked gradient was finite.
    assert (found["phase"], found["scope"], found["nan"]) == ("backward", "Default/net-Residual/fc-Linear", 12)


def test_a_clean_residual_reads_the_shared_gradient(check, tmp_path):
    Residual(poison=False)(torch.randn(3, 4)).sum().backward()
    assert check.gradients_read == 3  # head's, ReLU's, and fc's output gradient: two edges reach fc's
    assert findings(tmp_path) == []


def test_a_second_loss_on_an_inner_output_is_seen_from_its_root(check, tmp_path):
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sigmoid(), torch.nn.Linear(4, 2))
    inner = []
    net[0].register_forward_hook(lambda module, args, out: inner.append(out))
    out = net(torch.randn(3, 4))
    loss = out.sum() + GradToNan.apply(inner[0]).sum()
    torch.autograd.backward(loss)
    [found] = findings(tmp_path)
    assert (found["phase"], found["scope"]) == ("backward", "Default/net-Sequential/0-Linear")


def test_a_backward_that_bypasses_the_wrapper_checks_everything(check, tmp_path):
    loss = Residual(poison=True)(torch.randn(3, 4)).sum()
    # The engine called directly, as no user code should: no settle ran, so the covered gradient is armed.
    torch.autograd.Variable._execution_engine.run_backward((loss,), (torch.ones(()),), False, False, (), True, True)
    [found] = findings(tmp_path)
    assert found["scope"] == "Default/net-Residual/fc-Linear"


def test_a_nan_made_between_a_relu_and_the_next_module_is_found_at_the_relu(check, tmp_path):
    class Poison(torch.nn.Module):
        def forward(self, x):
            return GradToNan.apply(x)

    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), Poison(), torch.nn.Linear(4, 2))
    net(torch.randn(3, 4)).sum().backward()
    [found] = findings(tmp_path)
    assert (found["phase"], found["scope"]) == ("backward", "Default/net-Sequential/1-ReLU")


def test_an_in_place_relu_or_a_user_hook_keeps_the_gradient_read(check, tmp_path):
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(inplace=True), torch.nn.Linear(4, 2))
    net(torch.randn(3, 4)).sum().backward()
    assert check.gradients_read == 3
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))

    def user_hook(module, args, out):
        out.register_hook(lambda g: g * 2)

    net[0].register_forward_hook(user_hook)
    net(torch.randn(3, 4)).sum().backward()
    assert check.gradients_read == 6


@pytest.mark.parametrize(("module", "expected"), [
    (torch.nn.ReLU(), True), (torch.nn.ReLU6(), True), (torch.nn.Sigmoid(), True), (torch.nn.Tanh(), True),
    (torch.nn.MaxPool2d(2), True), (torch.nn.MaxPool2d(3, stride=3), True), (torch.nn.MaxPool1d(2, stride=4), True),
    (torch.nn.MaxPool2d(3, stride=2), False), (torch.nn.MaxPool2d(2, dilation=2, stride=2), False),
    (torch.nn.MaxPool3d((2, 2, 3), stride=(2, 2, 2)), False), (torch.nn.MaxPool3d((1, 2, 2), stride=2), True),
    (torch.nn.AdaptiveMaxPool2d(3), False), (torch.nn.LeakyReLU(), False), (torch.nn.GELU(), False),
    (torch.nn.Softmax(dim=1), False)])
def test_which_backwards_preserve_finiteness(module, expected):
    assert preserves_in_backward(module) is expected


def test_raise_mode_in_backward_reaches_the_caller_of_backward(tmp_path, native_path):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"nan_check": {"enable": True, "path": str(tmp_path), "action": "raise"}}))
    obs.set_context(env_config_path=str(path))
    try:
        net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sigmoid(), torch.nn.Linear(4, 4))
        h = net[2](net[1](net[0](torch.randn(3, 4))))  # modules called one by one: their gradients are checked
        loss = GradToNan.apply(h).sum()
        with pytest.raises(NonFiniteError, match="backward at Default/net-Linear ") as info:
            loss.backward()
    finally:
        obs.reset_context()
    assert info.value.folder and findings(tmp_path)[0]["nan"] == 12
