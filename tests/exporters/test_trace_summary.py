"""The summary's numbers against small hand-made traces, in both file formats, through the API and the CLI."""

from __future__ import annotations

import json
import os

import pytest

from exporters.trace_reader import read_chrome_trace, read_folder, read_otlp_jsonl, read_path
from exporters.trace_summary import percentile
from obs._core.errors import DamagedFileError, NotOurFileError
from obs.cli import main
from obs.cli._trace_view import load_summary


def _x(name, cat, ts_us, dur_us, span, parent="", **args):
    event = {"name": name, "cat": cat, "ph": "X", "ts": ts_us, "dur": dur_us, "pid": 0, "tid": 1,
             "args": {**args, "trace_id": "0" * 31 + "1", "span_id": f"{span:016x}"}}
    if parent:
        event["args"]["parent_span_id"] = f"{parent:016x}"
    return event


def hand_made_chrome(path, *, close=True):
    """Four steps of 10, 20, 30, 40 ms; each: forward 4 ms holding module net (3 ms, of which op mm 1 ms), backward
    5 ms; step 4 also aggregated 3 ops into its forward (addmm x2 = 0.5 ms, relu x1 = 0.25 ms)."""
    events = [{"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "obs rank 0"}}]
    for i, ms in enumerate((10, 20, 30, 40), start=1):
        t, base = i * 100_000, i * 100
        step_args = {"ml.step": i, "ml.rank": 0}
        fwd_args = {"ml.phase": "forward"}
        if i == 4:
            step_args["obs.spans.aggregated"] = 3
            fwd_args.update({"ml.ops.names": ["addmm", "relu"], "ml.ops.counts": [2, 1],
                             "ml.ops.total_ns": [500_000, 250_000]})
        events += [_x("step", "step", t, ms * 1000, base, **step_args),
                   _x("forward", "phase", t, 4000, base + 1, base, **fwd_args),
                   _x("net-Net", "module", t, 3000, base + 2, base + 1, **{"ml.module.scope": "Default/net-Net"}),
                   _x("mm", "op", t, 1000, base + 3, base + 2, **{"ml.op.name": "mm"}),
                   _x("backward", "phase", t + 4000, 5000, base + 4, base, **{"ml.phase": "backward"})]
    events.append({"ph": "C", "name": "obs.dropped_spans", "pid": 0, "tid": 1, "ts": 1, "args": {"dropped": 2}})
    text = "[\n" + ",\n".join(json.dumps(e) for e in events) + ("\n]\n" if close else "")
    with open(path, "w") as fh:
        fh.write(text)
    return path


def test_percentiles_interpolate():
    assert percentile([10, 20, 30, 40], 50) == 25
    assert percentile([10, 20, 30, 40], 90) == pytest.approx(37)
    assert percentile([10, 20, 30, 40], 99) == pytest.approx(39.7)
    assert percentile([], 50) == 0.0


@pytest.mark.parametrize("close", [True, False], ids=["closed", "killed writer: no closing bracket"])
def test_summary_numbers_match_a_hand_made_trace(tmp_path, close):
    summary = load_summary(hand_made_chrome(str(tmp_path / "trace.json"), close=close))
    assert summary.steps == 4 and summary.spans == 20
    assert summary.step_ms == {"p50": 25.0, "p90": 37.0, "p99": 39.7, "max": 40.0, "mean": 25.0}
    phases = {p.name: p for p in summary.phases}
    assert phases["backward"].total_ms == 20.0 and phases["backward"].count == 4
    assert phases["forward"].total_ms == 16.0 and phases["forward"].share == pytest.approx(16 / 100)
    (net,) = summary.modules
    assert (net.name, net.count, net.total_ms, net.self_ms) == ("Default/net-Net", 4, 12.0, 8.0)
    ops = {o.name: o for o in summary.ops}
    assert (ops["mm"].count, ops["mm"].total_ms) == (4, 4.0)
    assert (ops["addmm"].count, ops["addmm"].total_ms, ops["relu"].count) == (2, 0.5, 1)
    assert summary.aggregated == 3 and summary.dropped == 2


def test_cli_summary_json_and_exit_status(tmp_path, capsys):
    path = hand_made_chrome(str(tmp_path / "trace.json"))
    assert main(["trace", "summary", path, "--json"]) == 1  # spans were dropped: a check found a problem
    doc = json.loads(capsys.readouterr().out)
    assert doc["step_ms"]["p50"] == 25.0 and doc["dropped"] == 2
    assert main(["trace", "summary", path]) == 1
    out = capsys.readouterr().out
    assert "p50 25.000 ms" in out and "Default/net-Net" in out and "dropped 2" in out


def test_bad_input_is_exit_2_and_damage_exit_1(tmp_path, capsys):
    assert main(["trace", "summary", str(tmp_path / "missing.json")]) == 2
    other = tmp_path / "other.jsonl"
    other.write_text('{"hello": 1}\n')
    assert main(["trace", "summary", str(other)]) == 2
    damaged = tmp_path / "traces.otlp.jsonl"
    damaged.write_text('{"resourceSpans": []}\n{"resourceSpans": [{"scopeSpans": [{"spans": [{"name": 1}]}]}]}\n')
    assert main(["trace", "summary", str(damaged)]) == 1
    err = capsys.readouterr().err
    assert "at byte 22" in err and "Traceback" not in err


def test_readers_raise_clear_errors(tmp_path):
    bad = tmp_path / "trace.json"
    bad.write_text('[{"name": "step", "cat": "step", "ph": "X", "ts": "x"')
    with pytest.raises(DamagedFileError):
        read_chrome_trace(str(bad))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(NotOurFileError):
        read_otlp_jsonl(str(empty))
    with pytest.raises(NotOurFileError):
        read_folder(str(tmp_path / "nothing_here")) if os.makedirs(tmp_path / "nothing_here") is None else None


def test_read_path_tells_the_formats_apart(tmp_path):
    chrome = hand_made_chrome(str(tmp_path / "trace.json"))
    assert read_path(chrome).format == "chrome"
