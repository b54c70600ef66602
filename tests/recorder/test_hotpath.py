"""The C hot path writes exactly what the Python handlers write, and refuses bad use."""

from __future__ import annotations

import itertools
import json
import shutil

import pytest

import obs
from obs.runtime.steps import tracker
from recorder.bundle_reader import load_bundle
from recorder.layout import SLOT
from tests.recorder.op_training import train_and_fail

try:
    from recorder import _hotpath as hotpath
except ImportError:  # built by `pip install -e .` (setup.py); optional where there is no C compiler
    if shutil.which("cc") or shutil.which("gcc"):
        raise
    pytest.skip("no C compiler here, so the C hot path is not built", allow_module_level=True)


def record(tmp_path, monkeypatch, pure: bool):
    monkeypatch.setenv("OBS_NATIVE_OPS", "0")  # both through the dispatch mode (tests/recorder/test_native_ops.py)
    monkeypatch.delenv("OBS_NATIVE", raising=False)  # this test picks each part's path itself
    if pure:
        monkeypatch.setenv("OBS_NATIVE_RECORDER", "0")
    else:
        monkeypatch.delenv("OBS_NATIVE_RECORDER", raising=False)
    config = tmp_path / f"obs-{pure}.json"
    config.write_text(json.dumps({"rdr": {"enable": True, "path": str(tmp_path / str(pure)), "granularity": "op"}}))
    tracker.reset()
    obs.set_context(env_config_path=str(config))
    assert bool(obs.rdr.recorder()._subs.writers) is not pure
    train_and_fail()
    path = obs.rdr.dump("parity")
    obs.reset_context()
    keep = ("kind", "scope", "name", "inputs", "step", "error", "phase", "device")
    return [{k: e[k] for k in keep if k in e} for e in load_bundle(path).iter_events()
            if e["kind"] in ("module_enter", "module_exit", "op", "step_begin", "step_end", "phase", "memory")]


def test_c_and_python_paths_record_the_same_events(tmp_path, monkeypatch):
    c_events = record(tmp_path, monkeypatch, pure=False)
    py_events = record(tmp_path, monkeypatch, pure=True)
    assert c_events == py_events
    assert any(e["kind"] == "op" and e["name"] == "addmm" and "float32[3, 4]@cpu" in e["inputs"] for e in c_events)
    assert {"kind": "module_exit", "scope": "Default/net-Sequential/2-Linear", "step": 3, "error": True} in c_events
    assert {e["kind"] for e in c_events} >= {"phase", "memory", "step_begin", "step_end"}  # SlotWriter.append's


def test_append_writes_the_slot_the_python_appender_writes():
    from recorder.ring import RingWriter

    ids: dict[str, int] = {}
    slots = []
    for native in (True, False):
        buf = bytearray(56 * 2)
        counter, seq = itertools.count(), itertools.count(7)
        if native:
            append = hotpath.SlotWriter(buf, 0, 2, counter, seq, ids, lambda s: 0).append
        else:
            ring = RingWriter.__new__(RingWriter)  # only slots() is used: the region, counters and clock
            target = (SLOT.pack_into, buf, 0, 2, SLOT.size, counter, seq, lambda: 5)
            ring.slots = lambda name, target=target: target
            append = RingWriter.appender(ring, "step")
        for value in (1, 2, 3):  # the third wraps onto the first slot
            append(13, 1, -value, 2**40 + value, -(2**62), value)
        slots.append([SLOT.unpack_from(buf, i * 56) for i in range(2)])
    (c_first, c_second), (py_first, py_second) = slots
    drop_time = lambda slot: slot[:2] + slot[3:]  # noqa: E731
    assert [drop_time(s) for s in (c_first, c_second)] == [drop_time(s) for s in (py_first, py_second)]
    assert drop_time(c_first) == (9, 3, 13, 1, -3, 2**40 + 3, -(2**62), 3)
    with pytest.raises(TypeError, match="append"):
        hotpath.SlotWriter(bytearray(56), 0, 1, itertools.count(), itertools.count(), ids, len).append(1, 2)


def test_bad_construction_and_release():
    buf = bytearray(56 * 4)
    ids: dict[str, int] = {}
    args = (buf, 0, 4, itertools.count(), itertools.count(1), ids, lambda s: ids.setdefault(s, len(ids)))
    with pytest.raises(ValueError, match="outside the buffer"):
        hotpath.SlotWriter(buf, 56, 4, *args[3:])
    with pytest.raises(ValueError, match="capacity must be positive"):
        hotpath.SlotWriter(buf, 0, 0, *args[3:])
    with pytest.raises(BufferError, match="not writable"):
        hotpath.SlotWriter(b"read-only", 0, 1, *args[3:])
    writer = hotpath.SlotWriter(*args)
    with pytest.raises(TypeError, match="enter"):
        writer.enter("only one")
    with pytest.raises(RuntimeError, match="not set up for ops"):
        writer.op("addmm", (), {}, 1, None)
    writer.step = 9
    writer.enter("scope", None)
    assert int.from_bytes(buf[0:8], "little") == 1 and int.from_bytes(buf[32:40], "little") == 9  # seq, b=step
    writer.release()
    writer.exit("scope", None, None)  # after release: dropped, no crash
    assert buf[56:112] == bytes(56)
