"""A bundle's exception: the whole chain from the user's outermost frame, without obs's wrapper frames, and
"raised at" naming the user's innermost frame with the library frame beside it."""

from __future__ import annotations

import os

import pytest
import torch

from recorder.stacks import exception_record


def caught_while_propagating(fn):
    """Record an exception the way obs's wrappers do: while it still propagates, from the frame that caught it."""
    def catcher():
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - the record is what we test
            return exception_record(exc)
        raise AssertionError("fn did not raise")

    return catcher()


def user_forward():
    torch.nn.Linear(4, 2)(torch.ones(3, 5))


def test_outer_frames_come_from_the_live_stack_and_raised_at_is_the_users_frame():
    record = caught_while_propagating(user_forward)
    functions = [f["function"] for f in record["frames"]]
    # this test and its callers (pytest) are outside the traceback proper: they come from the live stack
    assert "test_outer_frames_come_from_the_live_stack_and_raised_at_is_the_users_frame" in functions
    assert functions.index("catcher") < functions.index("user_forward")
    assert record["where"]["function"] == "user_forward" and record["where"]["file"] == __file__
    assert record["raised_in"]["file"].endswith(os.path.join("torch", "nn", "modules", "linear.py"))
    assert "test_assemble.py" in record["traceback"] and "linear.py" in record["traceback"]
    assert record["traceback"].rstrip().endswith("mat1 and mat2 shapes cannot be multiplied (3x5 and 4x2)")


def test_a_users_own_raise_has_no_library_frame():
    def boom():
        raise ValueError("mine")

    record = caught_while_propagating(boom)
    assert record["where"]["function"] == "boom" and record["raised_in"] is None


@pytest.mark.native("RECORDER")  # the C module call wrapper has no frame; the Python one's are dropped
def test_obs_wrapper_frames_are_dropped_from_every_chained_exception(tmp_path, native_path):
    """Real obs module events (the wrapper is installed) and a chained cause: no obs frame in what is printed."""
    import json

    import obs

    config = tmp_path / "obs.json"
    config.write_text(json.dumps({"rdr": {"enable": True, "path": str(tmp_path / "rdr")}}))
    obs.set_context(env_config_path=str(config))
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(3, 2))

    def step():
        try:
            net(torch.ones(2, 4))
        except RuntimeError as exc:
            raise KeyError("wrapped") from exc

    try:
        record = caught_while_propagating(step)
    finally:
        obs.reset_context()
    text = record["traceback"]
    assert "The above exception was the direct cause" in text and "KeyError: 'wrapped'" in text
    assert "_modules.py" not in text and "obs_module_call" not in text
    assert not any(f["file"].endswith(os.path.join("obs", "runtime", "torch", "_modules.py"))
                   for f in record["frames"])
    assert text.count("linear.py") == 1 and "net(torch.ones(2, 4))" in text


@pytest.mark.native("RECORDER", "OPS")  # ops from the native observer, the dispatch mode, the Python handlers
@pytest.mark.parametrize("granularity", ["op"])
def test_op_dispatch_frames_are_cut(tmp_path, granularity, native_path):
    import json

    import obs

    config = tmp_path / "obs.json"
    config.write_text(json.dumps({"rdr": {"enable": True, "path": str(tmp_path / "rdr"),
                                          "granularity": granularity}}))
    obs.set_context(env_config_path=str(config))
    try:
        record = caught_while_propagating(user_forward)
    finally:
        obs.reset_context()
    last = record["frames"][-1]
    assert last["file"].endswith("linear.py"), record["traceback"]  # as without obs: nothing after linear.py
    assert "_python_dispatch" not in record["traceback"] and "eval_frame.py" not in record["traceback"]
    assert record["raised_in"]["file"].endswith("linear.py") and record["where"]["function"] == "user_forward"


def test_under_obs_run_the_bundle_traceback_starts_at_the_script(tmp_path):
    import json
    import subprocess
    import sys

    from recorder.bundle_reader import list_bundles, load_bundle

    (tmp_path / "obs.json").write_text(json.dumps({"rdr": {"enable": True, "path": str(tmp_path / "rdr")}}))
    (tmp_path / "train.py").write_text("import torch\nnet = torch.nn.Linear(4, 2)\n\ndef main():\n"
                                       "    net(torch.ones(3, 5))\n\nmain()\n")
    result = subprocess.run([sys.executable, "-m", "obs", "run", "--config", "obs.json", "train.py"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    (info,) = list_bundles(str(tmp_path / "rdr")).bundles
    text = load_bundle(info.path).exception["traceback"]
    first = text.splitlines()[1]
    assert first.strip().startswith(f'File "{tmp_path / "train.py"}", line 7, in <module>'), text
    assert "obs/cli" not in text and "runpy" not in text
