"""The ``nn.Module.__call__`` wrapper, C (recorder/_module_call.c) and Python: scopes under torch.compile, what a
user's traceback shows, and the same events in the same order from both."""

from __future__ import annotations

import inspect
import traceback

import pytest
import torch

import obs
from obs._core.internal import suppressed
from obs.runtime.torch import _modules, failure_hooks
from recorder.hotpath import hotpath

pytestmark = pytest.mark.native("RECORDER")


@pytest.fixture(autouse=True)
def impl(native_path):
    """Every test runs on the C wrapper (where the hot path is built) and on the Python one (tests/conftest.py)."""
    if native_path == "native" and not hasattr(hotpath(), "install_module_call"):
        pytest.skip("the C hot path is an old build, without the module call wrapper")
    return "c" if native_path == "native" else "python"


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.fc(x))


class Net(torch.nn.Module):
    def __init__(self, compile_block=False):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.block = torch.compile(Block(), backend="eager") if compile_block else Block()
        self.head = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))

    def forward(self, x):
        return self.head(self.block(self.fc1(x)))


class Breaks(Net):
    """A forward whose head runs eagerly, outside any graph (as code Dynamo skips does)."""

    def forward(self, x):
        return self._head(self.block(self.fc1(x)))

    @torch._dynamo.disable
    def _head(self, h):
        return self.head(h)


def scopes_of(model, steps=2):
    scopes = []
    with obs.subscribe(obs.Event.MODULE_ENTER, lambda scope, module: scopes.append(scope)):
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
    return scopes


# -- item: scopes under torch.compile -------------------------------------------------------------

def test_compiled_model_is_scoped_by_its_own_class():
    """Issue 9: under torch.compile the scope was ``Default/net-OptimizedModule``."""
    torch._dynamo.reset()
    scopes = scopes_of(torch.compile(Net(), backend="eager"))
    assert scopes and set(scopes) == {"Default/net-Net"}


def test_submodules_run_outside_the_graph_have_no_orig_mod_level():
    torch._dynamo.reset()
    scopes = scopes_of(torch.compile(Breaks(), backend="eager"))
    assert "Default/net-Breaks" in scopes and "Default/net-Breaks/head-Sequential/1-Linear" in scopes
    assert not any("OptimizedModule" in s or "_orig_mod" in s for s in scopes), scopes


def test_a_compiled_submodule_is_named_after_the_module_it_wraps():
    torch._dynamo.reset()
    scopes = scopes_of(Net(compile_block=True))
    assert scopes[:3] == ["Default/net-Net", "Default/net-Net/fc1-Linear", "Default/net-Net/block-Block"]
    assert not any("OptimizedModule" in s or "_orig_mod" in s for s in scopes), scopes


def test_obs_compile_in_graph_mode_and_without_class_names():
    torch._dynamo.reset()
    obs.set_context(mode=obs.GRAPH_MODE, reserve_class_name_in_scope=False)
    scopes = scopes_of(obs.compile(Breaks(), backend="eager"))
    assert "Default/net" in scopes and "Default/net/head/1" in scopes
    assert not any("_orig_mod" in s or "graphmodule" in s for s in scopes), scopes


# -- item: tracebacks through wrapped modules -----------------------------------------------------

class Faulty(torch.nn.Module):
    """Three module levels; the innermost Linear gets a float64 input (a dtype fault, as in nanoGPT)."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.Linear(4, 4)))

    def forward(self, x):
        return self.body[1](self.body[0](x).double())


def failing_step():
    model = Faulty()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    opt.zero_grad()
    with pytest.raises(RuntimeError, match=r"dtype|type") as info:
        model(torch.randn(2, 4)).sum().backward()
    return info.value, traceback.extract_tb(info.value.__traceback__)


def test_wrapped_modules_add_no_frame_to_the_users_traceback():
    """Issue 9: every user traceback gained an ``_modules.py ... __call__`` frame per module level."""
    _, plain = failing_step()
    faults = []
    obs.subscribe(obs.Event.MODULE_ENTER, lambda scope, module: None)
    obs.subscribe(obs.Event.FAULT, lambda kind, detail, error: faults.append((kind, detail)))
    error, wrapped = failing_step()
    assert not [f for f in wrapped if f.filename == _modules.__file__], traceback.format_list(wrapped)
    user = [(f.name, f.line) for f in wrapped if f.filename == __file__]
    assert user == [(f.name, f.line) for f in plain if f.filename == __file__]
    assert user[-1] == ("forward", "return self.body[1](self.body[0](x).double())")
    # obs inlines torch's _wrapped_call_impl: one frame fewer per module level than without obs
    assert len(wrapped) == len(plain) - 3
    assert traceback.extract_tb(error.__traceback__)[-1].name == plain[-1].name
    assert faults == [("module_error", "Default/net-Faulty/body-Sequential/1-Sequential/0-Linear")]


def test_a_traceback_still_runs_through_every_user_frame_of_a_training_loop():
    obs.subscribe(obs.Event.MODULE_EXIT, lambda scope, module, error: None)

    def train_step(model):
        return model(torch.randn(2, 4))

    with pytest.raises(RuntimeError) as info:
        train_step(Faulty())
    names = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert names[:2] == ["test_a_traceback_still_runs_through_every_user_frame_of_a_training_loop", "train_step"]
    assert names.count("forward") == 3 and names.count("_call_impl") == 3  # Faulty, Sequential, Linear


def test_a_module_patched_call_before_obs_is_still_called(monkeypatch):
    """When something else replaced Module.__call__ first, obs calls it rather than inlining torch's."""
    calls = []
    original = torch.nn.Module.__call__

    def theirs(module, *args, **kwargs):
        calls.append(type(module).__name__)
        return original(module, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "__call__", theirs)
    with obs.subscribe(obs.Event.MODULE_ENTER, lambda scope, module: None):
        torch.nn.Linear(2, 2)(torch.ones(1, 2))
    assert calls == ["Linear"]
    assert torch.nn.Module.__call__ is theirs or _modules._kept[0] is torch.nn.Module.__call__


def test_a_function_put_over_the_wrapper_obs_left_in_place_is_called_once_and_obs_records_beneath_it(monkeypatch, impl):
    """Once Dynamo is loaded, turning obs off leaves its wrapper in Module.__call__.  A function put over it later
    calls it; turning obs on again must neither call that function from below (a RecursionError on every module
    call: the C wrapper is one configuration) nor drop it."""
    import torch._dynamo  # what makes obs leave its wrapper in place

    net = torch.nn.Linear(2, 2)
    with obs.subscribe(obs.Event.MODULE_ENTER, lambda scope, module: None):
        net(torch.ones(1, 2))
    kept = torch.nn.Module.__call__
    calls, scopes = [], []

    def theirs(module, *args, **kwargs):
        calls.append(type(module).__name__)
        return kept(module, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "__call__", theirs)
    with obs.subscribe(obs.Event.MODULE_ENTER, lambda scope, module: scopes.append(scope)):
        net(torch.ones(1, 2))
    net(torch.ones(1, 2))  # obs off again
    assert calls == ["Linear", "Linear"] and scopes == ["Default/net-Linear"]
    monkeypatch.undo()
    with obs.subscribe(obs.Event.MODULE_ENTER, lambda scope, module: scopes.append(scope)):
        net(torch.ones(1, 2))
    assert scopes == ["Default/net-Linear"] * 2 and calls == ["Linear", "Linear"]


# -- the C wrapper and the Python one publish the same events ------------------------------------

class Kw(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)

    def forward(self, x, *, scale=1.0, fail=False):
        if fail:
            raise ValueError("planted")
        return self.inner(x) * scale


def record(run):
    """Every module, phase, step and fault event ``run`` causes, in order (timestamps dropped)."""
    events = []
    subs = [obs.subscribe(obs.Event.MODULE_ENTER, lambda scope, module: events.append(("enter", scope))),
            obs.subscribe(obs.Event.MODULE_EXIT,
                          lambda scope, module, error: events.append(("exit", scope, type(error).__name__))),
            obs.subscribe(obs.Event.PHASE, lambda name, begin, end: events.append(("phase", name, end >= begin))),
            obs.subscribe(obs.Event.STEP_BEGIN, lambda step: events.append(("step", step))),
            obs.subscribe(obs.Event.FAULT, lambda kind, detail, error: events.append(("fault", kind, detail)))]
    try:
        run()
    finally:
        for sub in subs:
            sub.remove()
    return events


def training(model_type=Kw):
    model = model_type()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def run():
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(2, 4), scale=2.0).sum().backward()
            opt.step()
        with torch.no_grad():
            model(torch.randn(2, 4))  # evaluation: no step, no forward phase
        with pytest.raises(ValueError, match="planted"):
            model(torch.randn(2, 4), fail=True)
    return run


def test_the_event_sequence_is_the_same_on_both_wrappers(impl, monkeypatch):
    events = record(training())
    monkeypatch.setenv("OBS_NATIVE_RECORDER", "0" if impl == "c" else "1")
    obs.bus.clear()
    from obs.runtime.steps import tracker

    tracker.reset()
    assert record(training()) == events
    assert events[:4] == [("step", 1), ("enter", "Default/net-Kw"), ("enter", "Default/net-Kw/inner-Linear"),
                          ("exit", "Default/net-Kw/inner-Linear", "NoneType")]
    assert ("phase", "forward", True) in events and ("fault", "module_error", "Default/net-Kw") in events
    assert events.count(("step", 3)) == 1  # the failing call with grad on opened the third step


def test_the_c_wrapper_replaces_module_call_while_module_events_are_wanted(impl):
    original = torch.nn.Module.__call__
    with obs.subscribe(obs.Event.MODULE_ENTER, lambda scope, module: None):
        wrapper = torch.nn.Module.__call__
        assert type(wrapper).__name__ == ("method_descriptor" if impl == "c" else "function")
        params = inspect.signature(torch.nn.Linear(2, 2)).parameters.values()
        assert [p.kind.name for p in params] == ["VAR_POSITIONAL", "VAR_KEYWORD"]
    # torch's own again; or, once torch.compile is loaded, ours left calling through (compiled graphs guard on it)
    assert torch.nn.Module.__call__ is original or _modules._kept[0] is torch.nn.Module.__call__


def test_suppressed_calls_publish_nothing_and_keep_their_result():
    seen = []
    model = Kw()
    x = torch.randn(2, 4)
    with obs.subscribe(obs.Event.MODULE_ENTER, lambda scope, module: seen.append(scope)):
        with suppressed():
            out = model(x, scale=3.0)
    assert seen == [] and torch.equal(out, model.inner(x) * 3.0)


def test_failure_hooks_get_the_failing_calls_own_arguments():
    got = []
    hook = failure_hooks.add(lambda error, kind, scope, args, kwargs, module: got.append(
        (type(error).__name__, kind, scope, len(args), sorted(kwargs), type(module).__name__)))
    with hook, obs.subscribe(obs.Event.MODULE_ENTER, lambda scope, module: None):
        with pytest.raises(ValueError):
            Kw()(torch.randn(2, 4), fail=True, scale=1.0)
    assert got == [("ValueError", "module", "Default/net-Kw", 1, ["fail", "scale"], "Kw")]


def test_a_failing_failure_hook_is_reported_the_next_runs_and_the_training_sees_its_own_error():
    from obs._core.internal import SUPPRESSION, internal_error_counts, set_raise_internal_errors

    def broken(error, kind, scope, args, kwargs, module):
        raise RuntimeError("hook bug")

    got = []
    with failure_hooks.add(broken), failure_hooks.add(lambda error, *rest: got.append(type(error).__name__)):
        with obs.subscribe(obs.Event.MODULE_ENTER, lambda scope, module: None):
            old = set_raise_internal_errors(False)  # as in production
            try:
                with pytest.raises(ValueError, match="planted"):
                    Kw()(torch.randn(2, 4), fail=True)
            finally:
                set_raise_internal_errors(old)
            with pytest.raises(RuntimeError, match="hook bug"):  # the test suite's raise mode
                Kw()(torch.randn(2, 4), fail=True)
    assert got == ["ValueError"] and internal_error_counts()[f"failure hook {broken.__qualname__}"] >= 1
    assert not failure_hooks.snapshot and SUPPRESSION.stack == []


def test_a_failing_handler_is_reported_and_the_stack_stays_balanced():
    from obs._core.internal import SUPPRESSION

    def broken(scope, module):
        raise KeyError("handler bug")

    with obs.subscribe(obs.Event.MODULE_ENTER, broken):
        with pytest.raises(KeyError, match="handler bug"):  # the test suite's raise mode
            Kw()(torch.randn(2, 4))
    assert SUPPRESSION.stack == []


def test_a_compiled_model_has_no_graph_break_at_its_module_calls():
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    scopes_of(torch.compile(Net(), backend="eager"))
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_dynamo_imported_after_the_c_wrapper_still_traces_through_it(impl):
    """Dynamo's first import comes after obs installed its C __call__ (a fresh process): no graph breaks."""
    import subprocess
    import sys

    script = (
        "import sys, torch, obs\n"
        "assert 'torch._dynamo' not in sys.modules\n"
        "scopes = []\n"
        "obs.subscribe(obs.Event.MODULE_ENTER, lambda scope, module: scopes.append(scope))\n"
        "net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())\n"
        "compiled = torch.compile(net, backend='eager')\n"
        "compiled(torch.randn(2, 4)); compiled(torch.randn(2, 4))\n"
        "from torch._dynamo.utils import counters\n"
        "print(type(torch.nn.Module.__call__).__name__, dict(counters['graph_break']), sorted(set(scopes)))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    kind = "method_descriptor" if impl == "c" else "function"
    assert out.stdout.split()[0] == kind and "{} ['Default/net-Sequential']" in out.stdout, out.stdout



def test_a_function_taken_off_module_call_before_dynamo_is_imported_is_not_called_by_compiled_modules(impl):
    """What Dynamo and ``torch.compile(module)`` are taught (on Dynamo's first import, once per process) is what the C
    wrapper calls when they run, not what it called when obs first turned on: a function someone put on
    Module.__call__ while obs was on, and took away before that import, is never called again (a fresh process)."""
    import subprocess
    import sys

    if impl != "c":
        pytest.skip("only the C wrapper is taught to Dynamo (the Python one is a frame it inlines)")
    script = (
        "import sys, torch, obs\n"
        "calls, torch_call = [], torch.nn.Module.__call__\n"
        "def theirs(module, *args, **kwargs):\n"
        "    calls.append(type(module).__name__)\n"
        "    return torch_call(module, *args, **kwargs)\n"
        "torch.nn.Module.__call__ = theirs\n"
        "with obs.subscribe(obs.Event.MODULE_ENTER, lambda scope, module: None):\n"
        "    torch.nn.Linear(4, 4)(torch.randn(2, 4))\n"
        "torch.nn.Module.__call__ = torch_call\n"
        "assert 'torch._dynamo' not in sys.modules\n"
        "import torch._dynamo\n"
        "scopes = []\n"
        "with obs.subscribe(obs.Event.MODULE_ENTER, lambda scope, module: scopes.append(scope)):\n"
        "    compiled = torch.compile(torch.nn.Sequential(torch.nn.Linear(4, 4)), backend='eager')\n"
        "    compiled(torch.randn(2, 4)); compiled(torch.randn(2, 4))\n"
        "from torch._dynamo.utils import counters\n"
        "print(dict(counters['graph_break']), sorted(set(scopes)), calls)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == "{} ['Default/net-Sequential'] ['Linear']", out.stdout
