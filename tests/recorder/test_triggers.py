"""Each dump trigger in a real training subprocess with real signals; each bundle's content is checked."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recorder.bundle_reader import list_bundles, load_bundle
from recorder.recover import recover_rings

SCRIPT = os.path.join(os.path.dirname(__file__), "train_script.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(SCRIPT)))


def run(tmp_path, scenario, *, mode=1, granularity="module", op_timeout=None, hang_action="dump", enable=True):
    config = tmp_path / "obs.json"
    config.write_text(json.dumps({"rdr": {"enable": enable, "mode": mode, "path": str(tmp_path / "rdr"),
                                          "granularity": granularity, "hang_action": hang_action}}))
    args = [sys.executable, SCRIPT, scenario, str(config)] + ([str(op_timeout)] if op_timeout else [])
    # obs's own settings come from the config alone; the native switches pass (native_path, tests/conftest.py)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MS_RDR", "OBS_")) or k.startswith("OBS_NATIVE")}
    env["PYTHONPATH"] = ROOT
    return subprocess.run(args, capture_output=True, text=True, timeout=240, env=env)


def bundles(tmp_path):
    return list_bundles(str(tmp_path / "rdr")).bundles


def rdr_dir(tmp_path):
    return tmp_path / "rdr" / "rank_0" / "rdr"


def marker(tmp_path):
    return json.loads((rdr_dir(tmp_path) / "marker.json").read_text())


def test_exception_in_forward(tmp_path):
    result = run(tmp_path, "forward")
    assert result.returncode == 1 and "boom in forward" in result.stderr
    (info,) = bundles(tmp_path)  # the module fault dumped; the excepthook saw the same exception and did not
    b = load_bundle(info.path)
    assert info.reason == "module_error" and info.step == 3
    assert b.manifest["fault"] == {"kind": "module_error", "where": "Default/net-Net"}
    assert b.manifest["exception"]["type"] == "ValueError" and "boom in forward" in b.exception["traceback"]
    assert b.manifest["last_module"] == "Default/net-Net/act-ReLU"
    enters = [e["scope"] for e in b.events({"module_enter"})]
    assert enters[-3:] == ["Default/net-Net", "Default/net-Net/fc1-Linear", "Default/net-Net/act-ReLU"]
    assert [e["values"][0] for e in b.events({"print"})] == ["loss", "loss"]
    assert marker(tmp_path)["state"] == "exited" and not list(rdr_dir(tmp_path).glob("ring_*"))


def test_exception_in_backward(tmp_path):
    result = run(tmp_path, "backward")
    assert result.returncode == 1
    (info,) = bundles(tmp_path)
    b = load_bundle(info.path)
    assert info.reason == "exception" and info.step == 3
    assert b.manifest["exception"]["message"] == "boom in backward at step 3"
    assert b.manifest["exception"]["where"]["function"] == "backward"
    assert b.manifest["last_module"] == "Default/net-Net/fc2-Linear" and b.manifest["open_modules"] == []


def test_exception_in_a_worker_thread(tmp_path):
    result = run(tmp_path, "thread")
    assert result.returncode == 0 and "DONE" in result.stdout and "ZeroDivisionError" in result.stderr
    (info,) = bundles(tmp_path)
    b = load_bundle(info.path)
    assert info.reason == "thread_exception" and info.step == 3
    assert b.manifest["fault"] == {"kind": "thread_exception", "where": "loader-worker"}
    assert b.manifest["exception"]["type"] == "ZeroDivisionError"


def exit_status_without_obs(sig):
    """How a Python process ends that sends itself ``sig`` from a function inside a ``with`` block, as
    train_script.py's ``fault`` does in ``obs.step()``, with neither obs nor torch imported (torch leaves SIGTERM and
    SIGINT alone: a run of the script itself would cost seconds of CPU to learn the same status)."""
    code = ("import contextlib, os\n"
            "def fault():\n"
            f"    os.kill(os.getpid(), {int(sig)})\n"
            "with contextlib.nullcontext():\n"
            "    fault()\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60).returncode


@pytest.mark.parametrize("scenario,sig", [("sigterm", signal.SIGTERM), ("sigint", signal.SIGINT)])
def test_termination_signals_dump_and_exit_as_without_obs(tmp_path, scenario, sig):
    result = run(tmp_path, scenario)
    assert result.returncode == exit_status_without_obs(sig) and result.returncode in (-sig, 1, 130)
    (info,) = bundles(tmp_path)
    b = load_bundle(info.path)
    assert info.reason == sig.name and info.step == 3
    assert b.manifest["open_modules"] == ["Default/net-Net"]
    main = next(s for s in b.stacks if s["main"])
    assert any(f["function"] == "fault" for f in main["frames"])
    assert [e["marker"] for e in b.events({"marker"})] == ["signal"]


def test_segfault_leaves_ring_and_stacks_that_recover_turns_into_a_bundle(tmp_path):
    result = run(tmp_path, "segfault")
    assert result.returncode == -signal.SIGSEGV
    assert not bundles(tmp_path)
    listing = list_bundles(str(tmp_path / "rdr"))
    assert len(listing.rings) == 1
    (path,) = recover_rings(str(tmp_path / "rdr"))
    b = load_bundle(path)
    assert b.info.reason == "fatal_signal" and b.info.step == 3 and b.manifest["recovered"]
    assert "Segmentation fault" in b.fatal_stacks and "train_script.py" in b.fatal_stacks
    assert b.manifest["open_modules"] == ["Default/net-Net"]
    assert b.manifest["last_module"] == "Default/net-Net/act-ReLU"
    assert recover_rings(str(tmp_path / "rdr")) == []  # recovered once


@pytest.mark.native("RECORDER")  # a ring written by the C hot path, and one written by the Python handlers
def test_sigkill_then_recover(tmp_path, native_path):
    result = run(tmp_path, "sigkill")
    assert result.returncode == -signal.SIGKILL and not bundles(tmp_path)
    assert marker(tmp_path)["state"] == "running"
    (path,) = recover_rings(str(tmp_path / "rdr"))
    b = load_bundle(path)
    assert b.info.reason == "recovered" and b.info.step == 3
    assert b.manifest["last_module"] == "Default/net-Net/act-ReLU"
    assert [e["step"] for e in b.events({"step_end"})] == [1, 2]
    assert marker(tmp_path)["state"] == "recovered"


def test_hang_dumps_with_stacks_and_training_goes_on(tmp_path):
    result = run(tmp_path, "hang", op_timeout=1)
    assert result.returncode == 0 and "DONE" in result.stdout
    (info,) = bundles(tmp_path)
    b = load_bundle(info.path)
    assert info.reason == "hang" and info.step == 3 and "op_timeout 1 s" in b.manifest["fault"]["where"]
    main = next(s for s in b.stacks if s["main"])
    assert main["frames"][-1]["function"] == "fault" and "sleep" in main["frames"][-1]["code"]


def test_hang_with_abort(tmp_path):
    result = run(tmp_path, "hang", op_timeout=1, hang_action="abort")
    assert result.returncode == -signal.SIGABRT and "DONE" not in result.stdout
    assert [b.reason for b in bundles(tmp_path)] == ["hang"]


def test_mode_2_dumps_at_normal_end_and_mode_1_does_not(tmp_path):
    (tmp_path / "m1").mkdir()
    assert run(tmp_path / "m1", "none", mode=1).returncode == 0
    assert not (tmp_path / "m1" / "rdr").exists()  # nothing to report: nothing left behind
    assert run(tmp_path, "none", mode=2).returncode == 0
    (info,) = bundles(tmp_path)
    assert info.reason == "normal_end" and info.step == 5
    assert marker(tmp_path)["dumped"] is True


def test_several_faults_make_several_bundles(tmp_path):
    result = run(tmp_path, "caught_twice")
    assert result.returncode == 0
    infos = bundles(tmp_path)
    assert [i.reason for i in infos] == ["module_error", "module_error"]
    assert len({i.path for i in infos}) == 2
    for info in infos:
        assert load_bundle(info.path).manifest["fault"]["where"] == "Default/net-Net/fc2-Linear"


@pytest.mark.native("OPS")  # ops from the native observer, and from the dispatch mode
def test_op_granularity_records_ops_with_scope_and_inputs(tmp_path, native_path):
    result = run(tmp_path, "forward", granularity="op")
    assert result.returncode == 1
    (info,) = bundles(tmp_path)
    b = load_bundle(info.path)
    ops = b.events({"op"})
    addmm = [o for o in ops if o["name"] == "addmm"]
    assert addmm and addmm[-1]["scope"] == "Default/net-Net/fc1-Linear"
    assert "float32[4, 8]@cpu" in addmm[-1]["inputs"]
    assert b.manifest["last_op"]["scope"] == "Default/net-Net/act-ReLU"
    assert "relu" in [o["name"] for o in ops[-3:]]


def test_a_kill_during_a_dump_leaves_no_half_bundle(tmp_path):
    config = tmp_path / "obs.json"
    config.write_text(json.dumps({"rdr": {"enable": True, "path": str(tmp_path / "rdr")}}))
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.Popen([sys.executable, SCRIPT, "dump_loop", str(config)], stdout=subprocess.PIPE, text=True,
                            env=env)
    try:
        while proc.stdout.readline().strip() != "DUMPING":
            pass
        # killed once a few dumps are on disk, however long a loaded machine takes to write them: the loop is then
        # in its next dump
        deadline = time.monotonic() + 60
        while len(list_bundles(str(tmp_path / "rdr")).bundles) <= 3 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    listing = list_bundles(str(tmp_path / "rdr"))
    assert len(listing.bundles) > 3
    for info in listing.bundles:
        manifest = json.loads((Path(info.path) / "manifest.json").read_text())
        for name in manifest["files"]:
            assert os.path.exists(os.path.join(info.path, name)), (info.path, name)
