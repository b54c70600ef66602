"""The request folder (recorder/requests.py): request and answer files, the watcher's rules, hostile files, and the
recorder's watcher answering a snapshot request in process."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import stat
import sys
import threading
import time
import warnings

import pytest

import obs
from obs._core.errors import DamagedFileError, NotOurFileError, UnsafePathError
from obs._core.internal import internal_error_counts, set_raise_internal_errors
from recorder.bundle_reader import load_bundle
from recorder.requests import (
    MAX_BYTES,
    REQUESTS,
    RequestWatcher,
    answer_path,
    make_request,
    read_answers,
    read_request,
    remove_request,
    request_path,
    requests_dir,
    write_answer,
    write_request,
)


def foreign(request, **changes):
    """``request`` as if another process (pid 1, the same host) had made it."""
    return dataclasses.replace(request, pid=1, **changes)


def files(folder):
    return sorted(os.listdir(folder))


@pytest.fixture(name="reports")
def _reports(caplog):
    """Internal errors swallowed and logged (production), not raised; yields the log records of obs."""
    old = set_raise_internal_errors(False)
    caplog.set_level(logging.ERROR, logger="obs")
    try:
        yield caplog
    finally:
        set_raise_internal_errors(old)


def test_a_request_is_written_atomically_into_a_private_folder_and_read_back(tmp_path):
    request = make_request("snapshot", asked_by="cli", params={"why": "slow"})
    path = write_request(str(tmp_path), request)
    folder = requests_dir(str(tmp_path))
    assert path == os.path.join(str(tmp_path), REQUESTS, f"snapshot-{request.id}.json")
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700 and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert files(folder) == [os.path.basename(path)]  # no temporary file left
    assert read_request(path) == request
    with open(path) as fh:
        data = json.load(fh)
    assert set(data) == {"kind", "id", "created_ns", "asked_by", "params", "host", "pid"}
    assert len(request.id) == 16 and request.created_ns <= time.time_ns()
    with pytest.raises(ValueError, match="lowercase"):
        make_request("../x", asked_by="cli")


def test_answers_sit_beside_the_request_and_go_with_it(tmp_path):
    request = make_request("snapshot", asked_by="cli")
    write_request(str(tmp_path), request)
    folder = requests_dir(str(tmp_path))
    path = write_answer(folder, request, 3, {"bundle": "/b"})
    assert path == answer_path(folder, request, 3) and path.endswith(f"snapshot-{request.id}.rank_3.json")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    answers, problems = read_answers(folder, request)
    assert problems == [] and answers[3]["bundle"] == "/b" and answers[3]["rank"] == 3
    assert answers[3]["pid"] == os.getpid() and answers[3]["request"] == request.id
    other = make_request("snapshot", asked_by="cli")
    write_request(str(tmp_path), other)
    remove_request(folder, request)
    assert files(folder) == [f"snapshot-{other.id}.json"]  # only its own files go
    remove_request(folder, other)
    assert not os.path.exists(folder)  # the folder too, once empty
    assert write_answer(folder, request, 3, {"bundle": "/b"}) is None  # its asker left: nothing made again
    assert not os.path.exists(folder)


def test_each_request_is_handled_once_and_old_foreign_and_own_requests_are_left_alone(tmp_path):
    seen = []
    watcher = RequestWatcher(str(tmp_path), {"snapshot": lambda r: seen.append(r.id) or {"bundle": "b"}},
                             rank=lambda: 1, max_age_s=60)
    assert watcher.poll() == []  # no folder yet: nothing made
    assert not os.path.exists(requests_dir(str(tmp_path)))
    now = time.time_ns()
    fresh = foreign(make_request("snapshot", asked_by="cli"))
    before = foreign(make_request("snapshot", asked_by="cli"), created_ns=watcher.started_ns - 1)
    old = foreign(make_request("snapshot", asked_by="cli"), created_ns=now - 61 * 10**9)
    other_kind = foreign(make_request("capture", asked_by="cli"))  # a kind this watcher has no handler for
    mine = make_request("snapshot", asked_by="rank 1")  # made by this very process
    for request in (fresh, before, old, other_kind, mine):
        write_request(str(tmp_path), request)
    assert watcher.poll() == [f"snapshot-{fresh.id}.json"] and seen == [fresh.id]
    assert watcher.poll() == [] and seen == [fresh.id]  # once per process
    folder = requests_dir(str(tmp_path))
    answers, _ = read_answers(folder, fresh)
    assert list(answers) == [1] and answers[1]["bundle"] == "b"
    for request in (before, old, other_kind, mine):
        assert read_answers(folder, request) == ({}, [])
    late = foreign(make_request("snapshot", asked_by="cli"))
    write_request(str(tmp_path), late)
    assert watcher.poll() == [f"snapshot-{late.id}.json"]


def test_hostile_files_are_skipped_with_a_report_and_the_watcher_goes_on(tmp_path, reports):
    folder = requests_dir(str(tmp_path))
    real = foreign(make_request("snapshot", asked_by="cli"))
    write_request(str(tmp_path), real)
    planted = foreign(make_request("snapshot", asked_by="cli"))
    os.symlink(request_path(folder, real), request_path(folder, planted))  # a symlink under a request's name
    garbage = request_path(folder, foreign(make_request("snapshot", asked_by="cli")))
    with open(garbage, "w") as fh:
        fh.write("{not json")
    huge = request_path(folder, foreign(make_request("snapshot", asked_by="cli")))
    with open(huge, "w") as fh:
        fh.write(" " * (MAX_BYTES + 1))
    lying = foreign(make_request("snapshot", asked_by="cli"))
    with open(request_path(folder, lying), "w") as fh:  # a request whose content names another one
        json.dump({**dataclasses.asdict(lying), "id": "0" * 16}, fh)
    with open(os.path.join(folder, "notes.txt"), "w") as fh:  # not a request's name: not even read
        fh.write("hello")
    handled = []
    watcher = RequestWatcher(str(tmp_path), {"snapshot": lambda r: handled.append(r.id) or {}}, rank=lambda: 0,
                             started_ns=0)
    counts = internal_error_counts()
    site = "rdr requests: a request file that is not one, skipped"
    assert watcher.poll() == [f"snapshot-{real.id}.json"] and handled == [real.id]
    assert internal_error_counts().get(site, 0) - counts.get(site, 0) == 4
    assert watcher.poll() == []  # each bad file reported once
    assert internal_error_counts().get(site, 0) - counts.get(site, 0) == 4
    said = [r.getMessage() for r in reports.records]
    assert len(said) == (0 if counts.get(site) else 1)  # logged once per site (per process), counted each time
    assert all(site in text for text in said)
    kinds = {type(r.exc_info[1]) for r in reports.records}
    assert kinds <= {UnsafePathError, DamagedFileError, NotOurFileError}
    # the refusals, each naming its file and why
    with pytest.raises(UnsafePathError, match="symlink"):
        read_request(request_path(folder, planted))
    with pytest.raises(DamagedFileError, match="not valid JSON"):
        read_request(garbage)
    with pytest.raises(NotOurFileError, match="more than a request"):
        read_request(huge)
    with pytest.raises(DamagedFileError, match="must match the file's name"):
        read_request(request_path(folder, lying))


def test_in_tests_a_hostile_file_is_a_loud_internal_error(tmp_path):
    folder = requests_dir(str(tmp_path))
    os.makedirs(folder)
    with open(request_path(folder, foreign(make_request("snapshot", asked_by="cli"))), "w") as fh:
        fh.write("[]")
    watcher = RequestWatcher(str(tmp_path), {"snapshot": lambda r: {}}, rank=lambda: 0, started_ns=0)
    with pytest.raises(NotOurFileError, match="not a request"):
        watcher.poll()


def test_a_handler_that_raises_answers_with_its_error_and_is_reported(tmp_path, reports):
    def broken(request):
        raise RuntimeError("no disk")

    request = foreign(make_request("snapshot", asked_by="cli"))
    write_request(str(tmp_path), request)
    watcher = RequestWatcher(str(tmp_path), {"snapshot": broken}, rank=lambda: 2, started_ns=0)
    assert watcher.poll() == [f"snapshot-{request.id}.json"]
    answers, _ = read_answers(requests_dir(str(tmp_path)), request)
    assert answers[2]["error"] == "RuntimeError: no disk"
    assert "rdr requests: snapshot handler" in reports.records[0].getMessage()


def test_the_watcher_thread_answers_and_stops(tmp_path):
    answered = threading.Event()

    def handler(request):
        answered.set()
        return {"bundle": "b"}

    watcher = RequestWatcher(str(tmp_path), {"snapshot": handler}, rank=lambda: 0, interval=0.05).start()
    try:
        (thread,) = [t for t in threading.enumerate() if t.name == "obs-rdr-requests"]
        assert thread.daemon and watcher.running
        write_request(str(tmp_path), foreign(make_request("snapshot", asked_by="cli")))
        assert answered.wait(10)
    finally:
        watcher.stop()
    assert not thread.is_alive() and not watcher.running
    watcher.stop()  # twice is fine


def enable(tmp_path, **rdr):
    config = tmp_path / "obs.json"
    config.write_text(json.dumps({"rdr": {"enable": True, "path": str(tmp_path / "rdr"), **rdr}}))
    obs.set_context(env_config_path=str(config), op_timeout=0)


def wait_for_answer(folder, request, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        answers, _ = read_answers(folder, request)
        if answers:
            return answers
        time.sleep(0.05)
    raise AssertionError(f"no answer to {request.name} in {timeout} s")


@pytest.mark.parametrize("granularity", ["off", "module"])
def test_a_recorder_answers_a_snapshot_request_with_a_bundle_and_goes_on(tmp_path, granularity):
    enable(tmp_path, granularity=granularity)  # op_timeout 0: no hang watchdog, the watcher runs all the same
    assert [t for t in threading.enumerate() if t.name == "obs-rdr-requests"]
    request = foreign(make_request("snapshot", asked_by="cli"))
    write_request(str(tmp_path / "rdr"), request)
    folder = requests_dir(str(tmp_path / "rdr"))
    (answer,) = wait_for_answer(folder, request).values()
    b = load_bundle(answer["bundle"])
    assert b.info.reason == "snapshot" and answer["rank"] == 0 and answer["pid"] == os.getpid()
    assert b.manifest["fault"] == {"kind": "snapshot", "where": "asked by cli", "request": request.id}
    assert b.manifest["now"] == answer["now"] == {"step": 0, "phase": None, "module": None, "module_since_ns": None,
                                                  "collective": None, "last_seq": {}}
    assert any(s["main"] for s in b.stacks)  # every thread's stack, the main thread's too
    assert obs.rdr.recorder() is not None  # it goes on
    remove_request(folder, request)
    obs.reset_context()
    assert not [t for t in threading.enumerate() if t.name == "obs-rdr-requests"]
    assert not os.path.exists(folder)


def test_a_forked_child_does_not_keep_the_watcher(tmp_path):
    enable(tmp_path)
    watcher = obs.features.rdr.feature.triggers._requests
    assert watcher is not None and watcher.running
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads: the child only checks and exits
        pid = os.fork()
    if pid == 0:
        alone = obs.features.rdr.feature.triggers is None and not watcher.running \
            and not [t for t in threading.enumerate() if t.name.startswith("obs-")]
        os._exit(0 if alone else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert watcher.running  # the parent's goes on
    obs.reset_context()
    assert not watcher.running


def test_the_shorter_switch_interval_of_overlapping_dumps_is_restored_after_the_last():
    from recorder.triggers import _eager_gil

    before = sys.getswitchinterval()
    first, second = _eager_gil(), _eager_gil()
    first.__enter__()
    assert sys.getswitchinterval() == pytest.approx(0.0005)
    second.__enter__()  # a hang dump waiting while a snapshot dumps, on two threads
    first.__exit__(None, None, None)
    assert sys.getswitchinterval() == pytest.approx(0.0005)  # the second still dumps
    second.__exit__(None, None, None)
    assert sys.getswitchinterval() == before
