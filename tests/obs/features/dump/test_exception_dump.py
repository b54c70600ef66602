"""exception_dump: each kind of failure, forward and backward, gives the right folder and the original exception."""

from __future__ import annotations

import json
import os
import stat

import numpy as np
import pytest
import torch

import obs
from obs.features.dump.exception import dump_of


def arm(tmp_path, mode="2", **rdr):
    cfg = {"exception_dump": {"enable": True, "mode": mode, "path": str(tmp_path)}}
    if rdr:
        cfg["rdr"] = {"enable": True, "path": str(tmp_path / "rdr"), **rdr}
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    obs.set_context(env_config_path=str(path))


def dumps(tmp_path):
    root = tmp_path / "rank_0" / "exception_dump"
    return sorted(root.iterdir()) if root.exists() else []


def meta(folder):
    return json.loads((folder / "meta.json").read_text())


class Net(torch.nn.Module):
    def __init__(self, inner=5):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.fc2 = torch.nn.Linear(inner, 2)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def failing(call):
    with pytest.raises(Exception) as info:
        call()
    return info.value


def test_shape_mismatch_dumps_the_innermost_module_inputs_and_keeps_the_exception(tmp_path):
    arm(tmp_path)
    net, x = Net(), torch.randn(3, 4)
    error = failing(lambda: net(x))
    assert type(error) is RuntimeError and "cannot be multiplied (3x8 and 5x2)" in str(error)
    [folder] = dumps(tmp_path)
    assert dump_of(error) == str(folder)
    assert folder.name.endswith("_Default_net-Net_fc2-Linear")
    m = meta(folder)
    assert (m["kind"], m["op"], m["scope"], m["mode"]) == ("module", "Linear", "Default/net-Net/fc2-Linear", "2")
    assert m["exception"] == {"type": "RuntimeError", "message": str(error)}
    assert m["inputs"] == [{"file": "inputs.0.npy", "arg": "args[0]", "shape": [3, 8], "dtype": "Float32",
                            "device": "cpu"}]
    expected = torch.relu(net.fc1(x)).detach().numpy()
    np.testing.assert_array_equal(np.load(folder / "inputs.0.npy"), expected)
    np.testing.assert_array_equal(np.load(folder / "parameters.0.npy"), net.fc2.weight.detach().numpy())
    assert "outputs" not in m  # mode 2: inputs only
    assert any("self.fc2(torch.relu(self.fc1(x)))" in line for line in m["python_stack"])
    assert not any("obs_module_call" in line for line in m["python_stack"])
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(folder / "meta.json").st_mode) == 0o600


def test_the_traceback_the_user_sees_is_the_one_without_obs(tmp_path):
    net, x = Net(), torch.randn(3, 4)
    plain = failing(lambda: net(x))
    arm(tmp_path)
    armed = failing(lambda: net(x))
    assert (type(armed), str(armed)) == (type(plain), str(plain))
    import traceback

    package = os.path.dirname(obs.__file__) + os.sep
    armed_frames = [(f.name, f.line) for f in traceback.extract_tb(armed.__traceback__)]
    assert not [f for f in traceback.extract_tb(armed.__traceback__) if f.filename.startswith(package)]
    assert armed_frames[-1] == traceback.extract_tb(plain.__traceback__)[-1][2:4]


def test_mode_1_lists_outputs_and_dtype_errors_are_caught(tmp_path):
    arm(tmp_path, mode="1")

    class Mixed(torch.nn.Module):
        def forward(self, a, b):
            return a @ b

    error = failing(lambda: Mixed()(torch.ones(2, 2), torch.ones(2, 2, dtype=torch.int64)))
    assert isinstance(error, RuntimeError)
    [folder] = dumps(tmp_path)
    m = meta(folder)
    assert m["outputs"] == [] and [i["dtype"] for i in m["inputs"]] == ["Float32", "Int64"]
    assert np.load(folder / "inputs.1.npy").dtype == np.int64


def test_custom_function_forward_error_out_of_memory_and_device_error(tmp_path):
    arm(tmp_path)

    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            raise ValueError("custom forward failed")

        @staticmethod
        def backward(ctx, g):
            return g

    class UsesBoom(torch.nn.Module):
        def forward(self, x):
            return Boom.apply(x)

    class Huge(torch.nn.Module):
        def forward(self, x):
            return x.new_empty(1 << 62)  # the CPU allocator refuses: an out-of-memory error

    class ToCuda(torch.nn.Module):
        def forward(self, x):
            return x.to("cuda:7") if torch.cuda.device_count() < 8 else x.to("nope")

    errors = [failing(lambda: UsesBoom()(torch.ones(3))), failing(lambda: Huge()(torch.ones(3))),
              failing(lambda: ToCuda()(torch.ones(3)))]
    assert str(errors[0]) == "custom forward failed"
    folders = dumps(tmp_path)
    assert len(folders) == 3
    assert [meta(f)["op"] for f in folders] == ["UsesBoom", "Huge", "ToCuda"]
    assert [meta(f)["exception"]["type"] for f in folders] == [type(e).__name__ for e in errors]
    assert all(dump_of(e) for e in errors)


def test_op_granularity_when_op_interception_is_on_and_the_rdr_bundle_points_to_the_dump(tmp_path):
    arm(tmp_path, granularity="module")
    obs.subscribe(obs.Event.OP, lambda name, args, kwargs, duration_ns, error: None)  # another feature's op hook
    net = Net()
    error = failing(lambda: net(torch.randn(3, 4)))
    [folder] = dumps(tmp_path)
    m = meta(folder)
    assert m["kind"] == "op" and m["op"] == "addmm.default" and m["scope"] == "Default/net-Net/fc2-Linear"
    assert [i["shape"] for i in m["inputs"]] == [[2], [3, 8], [5, 2]]
    [bundle] = [p for p in (tmp_path / "rdr" / "rank_0" / "rdr").iterdir() if p.is_dir()]
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["fault"]["exception_dump"] == str(folder) == dump_of(error)


class BadBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("backward of BadBackward failed")


class WrongShape(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad[:1]


class Inner(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn.apply(x)


class Outer(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fc = torch.nn.Linear(3, 3)
        self.inner = Inner(fn)

    def forward(self, x):
        return self.inner(self.fc(x)).sum()


def test_backward_failure_names_the_node_and_its_forward_module_and_dumps_what_autograd_holds(tmp_path):
    arm(tmp_path)
    net = Outer(BadBackward)
    loss = net(torch.randn(2, 3))
    error = failing(loss.backward)
    assert str(error) == "backward of BadBackward failed"
    [folder] = dumps(tmp_path)
    m = meta(folder)
    assert (m["kind"], m["autograd_node"], m["forward_module"]) == \
        ("backward", "BadBackwardBackward", "Default/net-Outer/inner-Inner")
    assert [i["arg"] for i in m["inputs"]] == ["args[0]"]  # the gradient handed to the node
    assert m["saved"][0]["arg"] == "ctx.saved_tensors[0]" and m["saved"][0]["shape"] == [2, 3]
    np.testing.assert_array_equal(np.load(folder / "inputs.0.npy"), np.ones((2, 3), np.float32))


def test_backward_engine_error_names_the_node_from_the_message(tmp_path):
    arm(tmp_path)
    loss = Outer(WrongShape)(torch.randn(2, 3))
    error = failing(loss.backward)
    assert "returned an invalid gradient" in str(error)
    folder = dumps(tmp_path)[-1]
    m = meta(folder)
    assert m["autograd_node"] == "WrongShapeBackward" and m["forward_module"] == "Default/net-Outer/inner-Inner"


def test_off_installs_nothing_and_disarming_restores_autograd(tmp_path):
    from obs.runtime.torch import failure_hooks

    backward = torch.autograd.backward
    arm(tmp_path)
    assert torch.autograd.backward is not backward and len(failure_hooks) == 1
    obs.set_context(ascend_config={"exception_dump": "0"})
    assert torch.autograd.backward is backward and not failure_hooks.snapshot
    failing(lambda: Net()(torch.randn(3, 4)))
    assert dumps(tmp_path) == []


def test_ascend_config_arms_it_in_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    obs.set_context(ascend_config={"exception_dump": "1"})
    error = failing(lambda: Net()(torch.randn(3, 4)))
    [folder] = dumps(tmp_path)
    assert meta(folder)["mode"] == "1" and dump_of(error) == str(folder)


def test_hostile_module_names_stay_inside_the_dump_folder(tmp_path):
    arm(tmp_path)

    class Evil(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.add_module("x/\\y z\n", torch.nn.Linear(2, 3))

        def forward(self, x):
            return getattr(self, "x/\\y z\n")(x)

    Evil.__name__ = "E/../../v il"  # class names are part of scopes
    failing(lambda: Evil()(torch.randn(2, 5)))
    [folder] = dumps(tmp_path)
    assert folder.parent == tmp_path / "rank_0" / "exception_dump"
    assert "/" not in folder.name and ".." not in folder.name


class MatmulInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad @ torch.ones(5, 5)  # an aten op that fails in backward


def test_an_op_failing_in_backward_under_op_interception_is_named_after_its_forward_module(tmp_path):
    arm(tmp_path)
    obs.subscribe(obs.Event.OP, lambda name, args, kwargs, duration_ns, error: None)  # op interception on
    loss = Outer(MatmulInBackward)(torch.randn(2, 3))
    error = failing(loss.backward)
    assert "cannot be multiplied" in str(error)
    [folder] = dumps(tmp_path)
    m = meta(folder)
    assert (m["kind"], m["op"], m["scope"]) == ("op", "mm.default", "Gradients/Default/net-Outer/inner-Inner")
    assert [i["shape"] for i in m["inputs"]] == [[2, 3], [5, 5]]


def test_mode_1_labels_an_ops_out_tensor_as_an_output(tmp_path):
    arm(tmp_path, mode="1")
    obs.subscribe(obs.Event.OP, lambda name, args, kwargs, duration_ns, error: None)  # another feature's op hook
    out = torch.zeros(2, 2)
    failing(lambda: torch.mm(torch.ones(2, 3), torch.ones(2, 2), out=out))
    [folder] = dumps(tmp_path)
    m = meta(folder)
    assert m["kind"] == "op" and [o["arg"] for o in m["outputs"]] == ["output"]
    assert [i["arg"] for i in m["inputs"]] == ["args[0]", "args[1]", "kwargs['out']"]


def test_an_error_in_a_compiled_module_names_the_module_the_node_and_the_users_line(tmp_path):
    arm(tmp_path)
    torch._dynamo.reset()
    compiled = torch.compile(Net(), backend="aot_eager")
    error = failing(lambda: compiled(torch.randn(3, 4)))
    [folder] = dumps(tmp_path)
    assert dump_of(error) == str(folder)
    m = meta(folder)
    assert (m["kind"], m["op"], m["scope"]) == ("module", "Net", "Default/net-Net")  # not OptimizedModule
    assert m["compiled"]["source"] == f"{__file__}:{Net.forward.__code__.co_firstlineno + 1}"
    assert "linear" in m["compiled"]["node"]
    assert [i["shape"] for i in m["inputs"]] == [[3, 4]]
    # PyTorch's own "from user code" traceback shows torch's frames where obs's wrapper is, never obs's
    assert "_dynamo_polyfill" not in str(error) and "obs_module_call" not in str(error)
