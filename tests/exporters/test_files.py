"""The local trace files: rotation by size (each rotated file whole and readable), a leftover file rotated away,
a full disk cut back to the last whole record."""

from __future__ import annotations

import json
import os

import pytest

from exporters.local_files import ChromeTraceWriter, OtlpJsonWriter, RotatingFile
from exporters.otlp import readable_spans, request_json, resource
from exporters.spans import Phase, StepRecord, build_spans
from exporters.trace_reader import read_chrome_trace, read_folder, read_otlp_jsonl


def spans(step):
    r = StepRecord(step, step * 10_000_000, step * 10_000_000 + 5_000_000,
                   phases=[Phase("forward", step * 10_000_000, step * 10_000_000 + 2_000_000)])
    return build_spans(r, run_id="r", rank=0, world_size=1, levels=("training_trace",))


def test_files_rotate_by_size_and_every_file_stays_readable(tmp_path):
    res = resource({"run_id": "r"}, rank=0, world_size=1, pid=1)
    jsonl = OtlpJsonWriter(str(tmp_path), 4000)
    chrome = ChromeTraceWriter(str(tmp_path), 4000, rank=0, pid=1)
    for step in range(1, 81):
        jsonl.write(request_json(readable_spans(spans(step), res)))
        chrome.write(spans(step))
    jsonl.close()
    chrome.close()
    names = sorted(os.listdir(tmp_path))
    assert "trace.json" in names and "traces.otlp.jsonl" in names
    rotated = sorted(int(n.split(".")[1]) for n in names if n.startswith("trace.") and n != "trace.json")
    assert len(rotated) == 5 and rotated[0] > 1  # the 5 newest kept, older ones removed
    for name in names:
        path = str(tmp_path / name)
        if name.endswith(".json"):
            json.loads((tmp_path / name).read_text())  # closed: a whole JSON array
            assert read_chrome_trace(path).spans
        else:
            assert read_otlp_jsonl(path).spans
    steps = [s.attributes["ml.step"] for f in read_folder(str(tmp_path)).files for s in f.spans if s.kind == "step"]
    assert steps == sorted(steps) and steps[-1] == 80  # rotated ones first, oldest first


def test_a_file_left_by_an_earlier_run_is_rotated_away_not_overwritten(tmp_path):
    (tmp_path / "trace.json").write_text("[]")
    f = RotatingFile(str(tmp_path / "trace.json"), 1 << 20)
    f.append(b"x")
    f.close()
    assert (tmp_path / "trace.1.json").read_text() == "[]"
    assert oct(os.stat(tmp_path / "trace.json").st_mode & 0o777) == "0o600"


def test_a_full_disk_cuts_the_file_back_to_its_last_whole_record(tmp_path):
    import resource as rlimit
    import signal

    f = RotatingFile(str(tmp_path / "t.jsonl"), 1 << 20)
    f.append(b"a" * 100 + b"\n")
    old = rlimit.getrlimit(rlimit.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    rlimit.setrlimit(rlimit.RLIMIT_FSIZE, (150, old[1]))
    try:
        with pytest.raises(OSError):
            f.append(b"b" * 100 + b"\n")
    finally:
        rlimit.setrlimit(rlimit.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, previous)
    f.close()
    assert (tmp_path / "t.jsonl").read_bytes() == b"a" * 100 + b"\n"
