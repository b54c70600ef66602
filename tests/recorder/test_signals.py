"""SIGTERM / SIGINT in real processes with real signals: exit status and the bundle.

The C handler (recorder/_hotpath.c) wakes the recorder's signal thread even while the main thread
is blocked in C; the dump is bounded; one bundle per fault; the process ends as the signal would.
No test times the exit: a process that would not end (blocked in C, dumping forever, its signal swallowed) is
still running at :data:`ENDS_WITHIN_S`, where it is killed and fails its exit-status check; each script keeps
running well past that bound if nothing ends it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from recorder.bundle_reader import list_bundles, load_bundle
from recorder.signals import DUMP_BUDGET_S, GRACE_S

HERE = os.path.dirname(__file__)
SCRIPT = os.path.join(HERE, "signals_script.py")
RANKS = os.path.join(HERE, "ranks_script.py")
ROOT = os.path.dirname(os.path.dirname(HERE))
ENDS_WITHIN_S = 60  #: a liveness bound, not a timing: far above a loaded machine's exit, far below a hang's end


def env(**extra):
    out = {k: v for k, v in os.environ.items() if not k.startswith(("MS_RDR", "OBS_"))}
    return {**out, "PYTHONPATH": ROOT, **extra}


def start(tmp_path, scenario, **extra):
    rdr = tmp_path / "rdr"
    rdr.mkdir()
    proc = subprocess.Popen([sys.executable, SCRIPT, scenario, str(rdr)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env(**extra))
    return proc, rdr


def wait_for(proc, line, timeout=180):
    """Read the child's stdout until ``line``; returns the lines before it."""
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = proc.stdout.readline()
        if not text:
            raise AssertionError(f"child ended before {line!r}: {seen} {proc.stderr.read()[-3000:]}")
        if text.strip() == line:
            return seen
        seen.append(text.strip())
    raise AssertionError(f"no {line!r} within {timeout} s")


def signal_and_wait(proc, *signums, gap=0.0, timeout=ENDS_WITHIN_S):
    """Send ``signums`` (``gap`` s apart); returns the exit status (the process is killed, -9, if it has not ended
    within ``timeout``)."""
    for i, signum in enumerate(signums):
        if i:
            time.sleep(gap)
        os.kill(proc.pid, signum)
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        code = -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()  # closes its pipes too: left open, they fail a later test as unraisable warnings
    return code


def finish(proc):
    out, err = proc.communicate(timeout=60)
    return out, err


def only_bundle(rdr, reason):
    listing = list_bundles(str(rdr))
    assert [b.reason for b in listing.bundles] == [reason], listing
    assert not listing.rings  # the ring went once its bundle was on disk
    return load_bundle(listing.bundles[0].path)


def marker(rdr):
    return json.loads((rdr / "rank_0" / "rdr" / "marker.json").read_text())


def main_frames(bundle):
    return next(s for s in bundle.stacks if s["main"])["frames"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_rank_blocked_in_all_reduce_dumps_and_dies_of_the_signal(tmp_path, sig):
    config = tmp_path / "obs.json"
    config.write_text(json.dumps({"rdr": {"enable": True, "path": str(tmp_path / "rdr")}}))
    procs = [subprocess.Popen([sys.executable, RANKS, str(r), "2", str(tmp_path / "store"), str(config), "blocks"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
             for r in range(2)]
    try:
        wait_for(procs[0], "BLOCKED")
        time.sleep(0.5)  # into the all_reduce that rank 1 never joins
        code = signal_and_wait(procs[0], sig)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate(timeout=60)
    assert code == -sig, code
    listing = list_bundles(str(tmp_path / "rdr" / "rank_0"))
    (info,) = listing.bundles
    b = load_bundle(info.path)
    assert (info.reason, info.rank, info.step) == (sig.name, 0, 3)
    assert b.manifest["world_size"] == 2 and b.manifest["fault"] == {"kind": "signal", "where": sig.name}
    assert any("all_reduce" in f["code"] for f in main_frames(b))  # the stack shows where it was stuck
    stuck = [e for e in b.events({"collective"}) if e["state"] == "started"]
    assert "all_reduce" in stuck[-1]["desc"]
    assert not listing.rings and marker(tmp_path / "rdr")["state"] == f"killed by {sig.name}"


def test_sigterm_to_a_main_thread_blocked_in_another_c_call(tmp_path):
    proc, rdr = start(tmp_path, "blocked_in_c")
    wait_for(proc, "BLOCKED")
    time.sleep(0.3)
    code = signal_and_wait(proc, signal.SIGTERM)
    finish(proc)
    assert code == -signal.SIGTERM, code
    b = only_bundle(rdr, "SIGTERM")
    assert b.manifest["step"] == 3
    assert main_frames(b)[-1]["function"] == "blocked_in_c"
    assert marker(rdr)["state"] == "killed by SIGTERM" and marker(rdr)["dumped"] is True


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_50ms_into_a_dump_of_full_rings_lets_it_finish_then_ends(tmp_path, sig):
    proc, rdr = start(tmp_path, "full_dump")
    wait_for(proc, "DUMPING")
    # The first dump starts right after the line; full rings take far longer than 50 ms to dump.
    time.sleep(0.05)
    code = signal_and_wait(proc, sig)
    finish(proc)
    assert code == -sig, code
    listing = list_bundles(str(rdr))
    # The dump under way was the signal's one dump: no bundle of its own.  The script dumps in a loop, and a
    # dump it started before the end came is let finish rather than cut short (never a half bundle).
    assert {b.reason for b in listing.bundles} == {"manual"}
    assert load_bundle(listing.bundles[-1].path).manifest["dropped"]["module"] > 0  # the rings were full
    assert not listing.rings and not listing.incomplete


def test_two_sigterms_in_quick_succession_make_one_bundle(tmp_path):
    proc, rdr = start(tmp_path, "sleep")
    wait_for(proc, "WAITING")
    code = signal_and_wait(proc, signal.SIGTERM, signal.SIGTERM, gap=0.01)
    finish(proc)
    assert code == -signal.SIGTERM, code
    b = only_bundle(rdr, "SIGTERM")
    assert [e["marker"] for e in b.events({"marker"})] == ["signal"]
    # The main thread waited in the relay while the watcher dumped: its stack ends where the script was.
    assert main_frames(b)[-1]["file"].endswith("signals_script.py"), main_frames(b)[-3:]


def test_sigint_while_python_runs_raises_keyboard_interrupt_after_the_dump(tmp_path):
    proc, rdr = start(tmp_path, "sleep")
    wait_for(proc, "WAITING")
    code = signal_and_wait(proc, signal.SIGINT)
    _, err = finish(proc)
    # raised where the main thread was: in time.sleep, or (on a loaded machine) between two of the loop's sleeps, or
    # still returning from the print that told the test it was waiting
    assert "KeyboardInterrupt" in err and any(line in err for line in (
        "time.sleep(0.1)", "for _ in range(600)", 'print("WAITING", flush=True)')), err
    assert code == -signal.SIGINT  # Python ends an uncaught KeyboardInterrupt by SIGINT
    only_bundle(rdr, "SIGINT")  # and the excepthook did not dump the KeyboardInterrupt a second time


def test_a_handler_installed_before_obs_is_still_called(tmp_path):
    proc, rdr = start(tmp_path, "prev_handler")
    wait_for(proc, "WAITING")
    code = signal_and_wait(proc, signal.SIGTERM)
    out, _ = finish(proc)
    assert code == 7 and "PREV" in out  # the user's handler decided how it ends
    b = only_bundle(rdr, "SIGTERM")
    assert b.manifest["step"] == 3


def test_a_second_signal_after_the_grace_period_ends_the_process_at_once(tmp_path):
    proc, rdr = start(tmp_path, "user_ignores")
    wait_for(proc, "WAITING")
    os.kill(proc.pid, signal.SIGTERM)
    assert wait_for(proc, "PREV") == []  # obs dumped, then called the user's handler, which carried on
    time.sleep(GRACE_S + 0.2)
    assert proc.poll() is None
    code = signal_and_wait(proc, signal.SIGTERM)
    finish(proc)
    assert code == -signal.SIGTERM, code
    b = only_bundle(rdr, "SIGTERM")
    assert [e["marker"] for e in b.events({"marker"})] == ["signal"]
    # The main thread waited in the relay while the watcher dumped: its stack ends where the script was.
    assert main_frames(b)[-1]["file"].endswith("signals_script.py"), main_frames(b)[-3:]


def test_an_asyncio_program_keeps_its_wakeup_fd(tmp_path):
    proc, rdr = start(tmp_path, "asyncio")
    before = wait_for(proc, "WAITING")
    report = json.loads(before[-1])
    assert report["wakeup_fd_before"] > 0 and report["wakeup_fd_after"] == report["wakeup_fd_before"]
    assert report["sigusr1"] is True  # the loop's own signal handling still works with obs on
    code = signal_and_wait(proc, signal.SIGTERM)
    finish(proc)
    assert code == -signal.SIGTERM
    only_bundle(rdr, "SIGTERM")


def test_without_the_c_extension_signals_still_dump_while_python_runs(tmp_path):
    proc, rdr = start(tmp_path, "sleep", OBS_NATIVE_RECORDER="0")
    wait_for(proc, "WAITING")
    code = signal_and_wait(proc, signal.SIGTERM)
    finish(proc)
    assert code == -signal.SIGTERM
    only_bundle(rdr, "SIGTERM")


def test_a_dump_that_does_not_fit_the_budget_is_left_in_the_ring_for_recover(tmp_path):
    from recorder.recover import recover_rings

    proc, rdr = start(tmp_path, "slow_dump")
    wait_for(proc, "WAITING")
    signalled = time.monotonic()
    code = signal_and_wait(proc, signal.SIGTERM)
    finish(proc)
    # ended (its dump would take 600 s), and not before the dump's budget ran out (a lower bound: load only adds)
    assert code == -signal.SIGTERM and time.monotonic() - signalled >= DUMP_BUDGET_S, code
    listing = list_bundles(str(rdr))
    assert not listing.bundles and len(listing.rings) == 1  # the ring stays: nothing else holds the record
    assert marker(rdr)["state"] == "killed by SIGTERM" and marker(rdr)["ring"].endswith(".obsring")
    (path,) = recover_rings(str(rdr))
    b = load_bundle(path)
    assert b.manifest["step"] == 3 and [e["marker"] for e in b.events({"marker"})] == ["signal"]


def test_without_the_c_extension_a_main_thread_blocked_in_c_is_not_dumped_and_recover_has_its_ring(tmp_path):
    """What the pure-Python fallback cannot do (as its docs say): the signal waits for the main thread."""
    from recorder.recover import recover_rings

    proc, rdr = start(tmp_path, "blocked_in_c", OBS_NATIVE_RECORDER="0")
    wait_for(proc, "BLOCKED")
    os.kill(proc.pid, signal.SIGTERM)
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(2 + DUMP_BUDGET_S)
    proc.kill()
    finish(proc)
    assert not list_bundles(str(rdr)).bundles and marker(rdr)["state"] == "running"
    (path,) = recover_rings(str(rdr))
    assert load_bundle(path).manifest["step"] == 3
