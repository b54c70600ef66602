"""The native op observer (RecordFunction, recorder/native_ops.py) records what the dispatch mode records, and more.

It is built once per machine into the user's cache (``python -m recorder.native_ops``; ``.ci/run``
builds it before the suite); the fallback test builds into its own tmp folder with a compiler
that cannot work.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import shutil
import threading

import pytest
import torch

import obs
from obs.runtime.steps import tracker
from recorder import native_ops
from recorder.bundle_reader import load_bundle
from tests.recorder.op_training import train_and_fail

if not (shutil.which("c++") or shutil.which("g++")):
    pytest.skip("no C++ compiler here: op events use the dispatch mode (test_fallback_* covers it)",
                allow_module_level=True)
try:
    from recorder import _hotpath  # noqa: F401
except ImportError:
    pytest.skip("the C hot path is not built", allow_module_level=True)


def start(tmp_path, monkeypatch, *, native: bool, name: str = "rdr") -> None:
    monkeypatch.setenv("OBS_NATIVE_OPS", "1" if native else "0")
    monkeypatch.delenv("OBS_NATIVE_RECORDER", raising=False)
    monkeypatch.delenv("OBS_NATIVE", raising=False)  # this test picks each part's path itself
    config = tmp_path / f"{name}.json"
    config.write_text(json.dumps({"rdr": {"enable": True, "path": str(tmp_path / name), "granularity": "op"}}))
    tracker.reset()
    obs.set_context(env_config_path=str(config))
    assert (native_ops._attached is not None) is native, native_ops.unavailable_reason()


def events(kinds: tuple[str, ...] = ("module_enter", "module_exit", "op", "step_begin", "step_end")) -> list[dict]:
    path = obs.rdr.dump("native")
    obs.reset_context()
    return [e for e in load_bundle(path).iter_events() if e["kind"] in kinds]


def test_native_ops_record_what_the_dispatch_mode_records_in_order(tmp_path, monkeypatch):
    start(tmp_path, monkeypatch, native=False, name="dispatch")
    train_and_fail()
    dispatch = events()
    start(tmp_path, monkeypatch, native=True, name="native")
    train_and_fail()
    native = events()
    # Module and step events are the same.
    def plain(evs: list[dict]) -> list[dict]:
        return [{k: v for k, v in e.items() if k not in ("seq", "t", "duration_ns")} for e in evs if e["kind"] != "op"]
    assert plain(native) == plain(dispatch)
    # Every op the dispatch mode saw, as often, in the same scope and step, with its positional inputs first
    # (the native record adds defaulted arguments).  Not compared: PyTorch's own profiler ops, which it does not
    # observe (record_function's enter and exit), and detach, which autograd adds for the dispatch mode itself
    # when it saves a module output.  Order may differ: records are written when an op ends.
    seen = collections.Counter((e["name"], e["scope"], e["step"]) for e in native if e["kind"] == "op")
    compared = [e for e in dispatch if e["kind"] == "op" and e["name"] != "detach"
                and not e["name"].startswith("_record_function")]
    wanted = collections.Counter((e["name"], e["scope"], e["step"]) for e in compared)
    assert not wanted - seen, wanted - seen
    inputs = {(e["name"], e["inputs"]) for e in native if e["kind"] == "op"}
    for want in compared:
        assert any(name == want["name"] and got.startswith(want["inputs"]) for name, got in inputs), want
    native_ops_seen = [e for e in native if e["kind"] == "op"]
    assert len(native_ops_seen) > len([e for e in dispatch if e["kind"] == "op"])
    assert all(e["thread"] >= 1 for e in native_ops_seen)
    linear = next(e for e in native_ops_seen if e["name"] == "linear")
    assert linear["scope"] == "Default/net-Sequential/0-Linear" and "nested" not in linear
    addmm = next(e for e in native_ops_seen if e["name"] == "addmm")
    assert addmm["nested"] is True and addmm["inputs"].startswith("float32[8]@cpu float32[3, 4]@cpu float32[4, 8]@cpu")


def test_names_and_signatures_are_interned_once_whatever_buffer_holds_them(tmp_path, monkeypatch):
    # The autograd engine names its records with a new string per call; the string table must not grow per step.
    from recorder.ring_reader import read_ring

    start(tmp_path, monkeypatch, native=True)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def strings(steps: int) -> list[str]:
        for _ in range(steps):
            with obs.step():
                opt.zero_grad()
                model(torch.randn(4, 8)).sum().backward()
                opt.step()
        return read_ring(obs.rdr.recorder().ring.buffer()).strings

    try:
        warm = strings(2)
        later = strings(20)
    finally:
        obs.reset_context()
    assert any(s.startswith("autograd::engine::evaluate_function: AddmmBackward0") for s in warm)
    assert later == warm
    repeated = [text for text, n in collections.Counter(warm).items() if n > 1]
    assert repeated in ([], [""]), repeated  # "": the Python writer's id 0, and records without inputs


def test_a_failing_op_is_flagged_and_the_training_sees_its_error(tmp_path, monkeypatch):
    start(tmp_path, monkeypatch, native=True)
    train_and_fail()
    failed = [e for e in events(("op",)) if e.get("error")]
    assert {e["name"] for e in failed} >= {"addmm", "linear"}
    assert all(e["scope"] == "Default/net-Sequential/2-Linear" for e in failed if e["name"] == "linear")


def test_ops_of_other_threads_are_recorded_with_their_thread_number(tmp_path, monkeypatch):
    start(tmp_path, monkeypatch, native=True)
    torch.mul(torch.ones(2), 2.0)
    worker = threading.Thread(target=lambda: torch.mul(torch.ones(3), 3.0))
    worker.start()
    worker.join()
    muls = [e for e in events(("op",)) if e["name"] == "mul.Tensor"]
    assert [e["inputs"].split(" ")[0] for e in muls] == ["float32[2]@cpu", "float32[3]@cpu"]
    assert muls[0]["thread"] != muls[1]["thread"]


def test_forked_dataloader_workers_never_write_into_the_parents_ring(tmp_path, monkeypatch):
    start(tmp_path, monkeypatch, native=True)
    observer = native_ops._attached
    before = observer.recorded()

    class Squares(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> torch.Tensor:
            return torch.full((4,), float(i)) ** 2  # ops in the worker process

    loader = torch.utils.data.DataLoader(Squares(), batch_size=8, num_workers=2, multiprocessing_context="fork")
    total = sum(float(batch.sum()) for batch in loader)
    assert total == sum(4 * i * i for i in range(64))
    recorded = observer.recorded() - before
    ops = events(("op",))
    # Only this process's ops: the ring's op count matches the observer's, and no worker op (pow) is there.
    assert len(ops) <= recorded + 8 and not any(e["name"].startswith("pow") for e in ops)


def test_one_ring_at_a_time_and_release_is_idempotent(tmp_path, monkeypatch):
    start(tmp_path, monkeypatch, native=True)
    live = obs.rdr.recorder()
    assert native_ops.attach(live.ring, live._subs.module_writer) is None  # already recording this process's ops
    observer = native_ops._attached
    obs.reset_context()
    assert native_ops._attached is None
    observer.release()  # a second release does nothing
    torch.add(torch.ones(2), 1)  # nothing records, nothing crashes


def test_fallback_without_a_compiler_says_why_once_and_uses_the_dispatch_mode(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(native_ops.EXTENSION, "module", None)
    monkeypatch.setattr(native_ops.EXTENSION, "reason", None)
    monkeypatch.setenv("OBS_NATIVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("OBS_NATIVE_OPS", "1")
    monkeypatch.delenv("OBS_NATIVE_RECORDER", raising=False)  # the observer needs the C hot path's ring
    config = tmp_path / "rdr.json"
    config.write_text(json.dumps({"rdr": {"enable": True, "path": str(tmp_path / "rdr"), "granularity": "op"}}))
    with caplog.at_level(logging.WARNING, logger="obs"):
        tracker.reset()
        obs.set_context(env_config_path=str(config))
        assert native_ops._attached is None and "could not be built" in native_ops.unavailable_reason()
        torch.add(torch.ones(2), 1)
        ops = [e for e in events(("op",)) if e["name"] == "add.Tensor"]
        obs.set_context(env_config_path=str(config))
        obs.reset_context()
    assert ops and "thread" not in ops[0]  # recorded by the dispatch mode
    said = [r.getMessage() for r in caplog.records if "native op observer" in r.getMessage()]
    assert len(said) == 2 and "building" in said[0] and "Python dispatch mode" in said[1], said
    assert os.path.isdir(tmp_path / "cache")  # the build was tried there, not in the user's cache
