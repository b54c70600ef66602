"""The local trace files: rotation by size (each rotated file whole and readable), a leftover file rotated away,
a full disk cut back to the last whole record."""

from __future__ import annotations

import json
import os

import pytest

from exporters.local_files import ChromeTraceWriter, OtlpJsonWriter, RotatingFile
from exporters.otlp import readable_spans, request_json, resource
from exporters.spans import ModuleCall, Phase, StepRecord, build_spans
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


# -- times in trace.json ---------------------------------------------------------------------------

EPOCH_NS = 1_760_000_420_396_698_329  # 2025: epoch µs as a float are only good to 0.25 µs here


def nested_step(step, start, forward_start, end):
    """A step whose forward, model and layer all end when the step does (as on GPT-2: the last module returns,
    the step ends)."""
    record = StepRecord(step, start, end, phases=[Phase("forward", forward_start, end)],
                        modules=[ModuleCall("Default/net-Net", forward_start, end),
                                 ModuleCall("Default/net-Net/fc-Linear", forward_start + 1_001, end)])
    return build_spans(record, run_id="r", rank=0, world_size=1, levels=("training_trace", "task_trace"))


def chrome_x_events(path):
    text = path.read_text()
    return json.loads(text if text.rstrip().endswith("]") else text.rstrip().rstrip(",") + "]")


def test_trace_json_keeps_every_ns_and_no_child_ends_after_its_parent(tmp_path):
    """Issue: epoch µs as floats let a child end 0.25 µs after its parent (5 of 30 GPT-2 steps)."""
    import random

    rng = random.Random(7)
    steps = [nested_step(1, EPOCH_NS, EPOCH_NS + 227_121, EPOCH_NS + 93_138_303)]
    for n in range(2, 200):
        start = EPOCH_NS + n * 10**9 + rng.randrange(10**6)
        steps.append(nested_step(n, start, start + rng.randrange(1, 10**6), start + rng.randrange(10**6, 10**8)))
    chrome = ChromeTraceWriter(str(tmp_path), 1 << 30, rank=0, pid=1)
    for spans_ in steps:
        chrome.write(spans_)
    chrome.close()

    events = chrome_x_events(tmp_path / "trace.json")
    (origin,) = [e for e in events if e["name"] == "obs.trace_start"]
    assert origin["ph"] == "M" and origin["args"]["unix_ns"] == EPOCH_NS  # absolute times stay recoverable
    spans_ = [e for e in events if e["ph"] == "X"]
    by_id = {e["args"]["span_id"]: e for e in spans_}

    def end_ns(e):  # as Perfetto reads them: llround(µs * 1000.0), then integers
        return round(e["ts"] * 1000) + round(e["dur"] * 1000)

    children = [(e, by_id[e["args"]["parent_span_id"]]) for e in spans_ if "parent_span_id" in e["args"]]
    assert len(children) == 3 * len(steps)
    assert all(end_ns(child) <= end_ns(parent) for child, parent in children)
    assert all(end_ns(child) == end_ns(parent) for child, parent in children if child["cat"] == "phase")
    written = [(s.span_id, s.start_ns, s.end_ns) for spans_ in steps for s in spans_]
    read = [(s.span_id, s.start_ns, s.end_ns) for s in read_chrome_trace(str(tmp_path / "trace.json")).spans]
    assert read == written  # to the ns


def test_each_rotated_trace_json_has_its_own_start_and_reads_back_exactly(tmp_path):
    chrome = ChromeTraceWriter(str(tmp_path), 3000, rank=0, pid=1)
    steps = [nested_step(n, EPOCH_NS + n * 10**9 + 7, EPOCH_NS + n * 10**9 + 1_234, EPOCH_NS + n * 10**9 + 5_678_901)
             for n in range(1, 21)]
    for spans_ in steps:
        chrome.write(spans_)
    chrome.counter("obs.dropped_spans", steps[-1][-1].end_ns, 3)
    chrome.close()
    files = read_folder(str(tmp_path)).files
    assert len(files) > 2
    for f in files:
        starts = [e for e in chrome_x_events(tmp_path / os.path.basename(f.path)) if e["name"] == "obs.trace_start"]
        assert len(starts) == 1 and starts[0]["args"]["unix_ns"] == min(s.start_ns for s in f.spans)
    read = [(s.span_id, s.start_ns, s.end_ns) for f in files for s in f.spans]
    written = [(s.span_id, s.start_ns, s.end_ns) for spans_ in steps for s in spans_]
    assert read == written[-len(read):]  # the 5 newest files, to the ns
    assert files[-1].dropped == 3


def test_a_trace_json_written_with_epoch_times_is_still_read(tmp_path):
    """Files written before ``obs.trace_start`` hold epoch µs (floats): read as they are."""
    args = {"ml.step": 1, "ml.rank": 0, "trace_id": "0" * 31 + "1", "span_id": "0" * 15 + "1"}
    events = [{"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "obs rank 0 (pid 1)"}},
              {"name": "step", "cat": "step", "ph": "X", "ts": 1760000420396698.2, "dur": 93139.974, "pid": 0,
               "tid": 1, "args": args}]
    (tmp_path / "trace.json").write_text("[\n" + ",\n".join(json.dumps(e) for e in events))
    (step,) = read_chrome_trace(str(tmp_path / "trace.json")).spans
    assert (step.start_ns, step.end_ns) == (1_760_000_420_396_698_200, 1_760_000_420_396_698_200 + 93_139_974)
    assert step.attributes == {"ml.step": 1, "ml.rank": 0}
