"""exception_dump at module granularity saves what ``forward`` received: after forward pre-hooks (the module's and the
global ones, with and without kwargs), never by running them again; on both module wrappers (C and Python)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import obs

# The module wrapper is C where the recorder's hot path is built, Python otherwise: both report failing modules.
pytestmark = [pytest.mark.native("RECORDER"), pytest.mark.usefixtures("native_path")]


def arm(tmp_path):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"exception_dump": {"enable": True, "mode": "2", "path": str(tmp_path)}}))
    obs.set_context(env_config_path=str(path))


def only_dump(tmp_path):
    [folder] = sorted((tmp_path / "rank_0" / "exception_dump").iterdir())
    return folder, json.loads((folder / "meta.json").read_text())


def failing(call):
    with pytest.raises(Exception) as info:
        call()
    return info.value


@pytest.fixture
def global_pre_hooks():
    handles = []
    yield lambda hook, **kw: handles.append(torch.nn.modules.module.register_module_forward_pre_hook(hook, **kw))
    for handle in handles:
        handle.remove()


def test_a_pre_hook_that_slices_the_input_dumps_the_sliced_input(tmp_path):
    arm(tmp_path)
    fc, x = torch.nn.Linear(8, 2), torch.randn(3, 8)
    fc.register_forward_pre_hook(lambda module, args: (args[0][..., :-1],))
    error = failing(lambda: fc(x))
    assert "(3x7 and 8x2)" in str(error)
    folder, meta = only_dump(tmp_path)
    assert meta["inputs"] == [{"file": "inputs.0.npy", "arg": "args[0]", "shape": [3, 7], "dtype": "Float32",
                               "device": "cpu"}]
    np.testing.assert_array_equal(np.load(folder / "inputs.0.npy"), x[..., :-1].numpy())
    assert (meta["inputs_are"], meta["inputs_are_meaning"]) == ("forward", "what forward received")


def test_a_pre_hook_that_casts_the_input_dumps_the_cast_input(tmp_path):
    arm(tmp_path)
    fc = torch.nn.Linear(4, 2)
    fc.register_forward_pre_hook(lambda module, args: args[0].double())  # a bare value: PyTorch makes it a tuple
    error = failing(lambda: fc(torch.randn(3, 4)))
    assert "Double" in str(error)
    _, meta = only_dump(tmp_path)
    assert [i["dtype"] for i in meta["inputs"]] == ["Float64"]


def test_global_and_kwargs_pre_hooks_in_pytorchs_order(tmp_path, global_pre_hooks):
    class Scaled(torch.nn.Module):
        def forward(self, x, *, scale):
            x = x * scale  # forward rebinds its argument: what it received is still what is dumped
            raise ValueError("bad scale")

    arm(tmp_path)
    module, x = Scaled(), torch.ones(2, 3)
    seen = []
    # global pre-hooks run first, then the module's: the global one halves, the module's sees the halved input
    global_pre_hooks(lambda m, args: (args[0] / 2,) if isinstance(m, Scaled) else None)
    module.register_forward_pre_hook(lambda m, args, kwargs: seen.append(args[0].sum().item()) or
                                     (args, {**kwargs, "scale": torch.full((3,), 7.0)}), with_kwargs=True)
    error = failing(lambda: module(x, scale=torch.ones(3)))
    assert str(error) == "bad scale" and seen == [3.0]  # each hook ran once: none is run again to dump
    folder, meta = only_dump(tmp_path)
    assert [i["arg"] for i in meta["inputs"]] == ["args[0]", "kwargs['scale']"]
    np.testing.assert_array_equal(np.load(folder / "inputs.0.npy"), np.full((2, 3), 0.5, np.float32))
    np.testing.assert_array_equal(np.load(folder / "inputs.1.npy"), np.full((3,), 7.0, np.float32))
    assert meta["inputs_are"] == "forward"


def test_a_pre_hook_that_raises_dumps_what_it_was_handed(tmp_path):
    def refuse(module, args):
        raise RuntimeError(f"refused {tuple(args[0].shape)}")

    arm(tmp_path)
    fc = torch.nn.Linear(4, 2)
    fc.register_forward_pre_hook(lambda module, args: (args[0][:1],))
    fc.register_forward_pre_hook(refuse)
    error = failing(lambda: fc(torch.randn(3, 4)))
    assert str(error) == "refused (1, 4)"
    _, meta = only_dump(tmp_path)
    assert [i["shape"] for i in meta["inputs"]] == [[1, 4]]
    assert meta["inputs_are"] == "pre_hook" and "forward was not called" in meta["inputs_are_meaning"]


def test_without_pre_hooks_the_call_arguments_are_what_forward_received(tmp_path):
    arm(tmp_path)
    fc = torch.nn.Linear(4, 2)
    fc.register_forward_hook(lambda module, args, output: None)  # hooks of another kind change nothing
    failing(lambda: fc(torch.randn(3, 5)))
    _, meta = only_dump(tmp_path)
    assert [i["shape"] for i in meta["inputs"]] == [[3, 5]] and meta["inputs_are"] == "forward"


def test_when_pytorchs_frame_is_not_found_the_call_arguments_are_kept_and_said_so():
    from obs.features.dump.exception import INPUTS_ARE, _forward_args

    fc, args = torch.nn.Linear(4, 2), (torch.randn(3, 4),)
    fc.register_forward_pre_hook(lambda module, a: (a[0][:1],))
    got = _forward_args(RuntimeError("no traceback"), fc, args, {})
    assert got == (args, {}, "call") and "what they handed forward is unknown" in INPUTS_ARE["call"]
