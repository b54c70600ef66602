"""Fuzz targets: the profiler's trace files (OTLP JSON lines, Chrome trace) through the readers, the summary
and ``obs trace summary``."""

from __future__ import annotations

import os

from tests.fuzz import Target, cli_exit


def _spans(step: int) -> list:
    from exporters.spans import ModuleCall, OpCall, Phase, StepRecord, build_spans

    ms = 1_000_000
    record = StepRecord(step, step * 20 * ms, step * 20 * ms + 10 * ms)
    base = record.start_ns
    record.phases = [Phase("data", base - ms, base), Phase("forward", base, base + 3 * ms),
                     Phase("backward", base + 3 * ms, base + 8 * ms), Phase("optimizer", base + 8 * ms, base + 9 * ms)]
    record.modules = [ModuleCall("Default/net-Net", base, base + 3 * ms),
                      ModuleCall("Default/net-Net/fc1-Linear", base, base + ms, error=step == 2)]
    record.ops = [OpCall("addmm", "Default/net-Net/fc1-Linear", base + 10, base + 900_000)] + \
        [OpCall("mm", "", base + 4 * ms + i, base + 4 * ms + i + 1000) for i in range(6)]
    return build_spans(record, run_id="fuzz", rank=0, world_size=1,
                       levels=("training_trace", "task_trace", "op_trace"), budget=9)


def _write_both(folder: str) -> tuple[str, str]:
    from exporters.local_files import ChromeTraceWriter, OtlpJsonWriter
    from exporters.otlp import readable_spans, request_json, resource

    res = resource({"run_id": "fuzz", "host": "h", "versions": {"torch": "2.13.0"}}, rank=0, world_size=1, pid=1)
    jsonl, chrome = OtlpJsonWriter(folder, 1 << 20), ChromeTraceWriter(folder, 1 << 20, rank=0, pid=1)
    for step in (1, 2, 3):
        spans = _spans(step)
        jsonl.write(request_json(readable_spans(spans, res)))
        chrome.write(spans)
    chrome.counter("obs.dropped_spans", 1, 4)
    jsonl.close()
    chrome.close()
    return os.path.join(folder, "traces.otlp.jsonl"), os.path.join(folder, "trace.json")


def _otlp_seeds(scratch: str) -> list[bytes]:
    path, _ = _write_both(scratch)
    with open(path, "rb") as fh:
        data = fh.read()
    return [data, data.splitlines(keepends=True)[0]]


def _chrome_seeds(scratch: str) -> list[bytes]:
    _, path = _write_both(scratch)
    with open(path, "rb") as fh:
        data = fh.read()
    return [data, data.rstrip().rstrip(b"]")]  # the closed file and a killed writer's


def _read_otlp(path: str) -> None:
    from exporters.trace_reader import read_otlp_jsonl
    from exporters.trace_summary import summarize

    summarize(read_otlp_jsonl(path).spans)


def _read_chrome(path: str) -> None:
    from exporters.trace_reader import read_chrome_trace
    from exporters.trace_summary import summarize

    summarize(read_chrome_trace(path).spans)


def _place_folder(name: str):  # noqa: ANN202 - a Target.place
    def place(folder: str, data: bytes) -> str:
        rank = os.path.join(folder, "rank_0")
        os.mkdir(rank, 0o700)
        with open(os.path.join(rank, name), "wb") as fh:
            fh.write(data)
        return folder
    return place


def _cli(path: str) -> None:
    try:
        cli_exit("trace", "summary", path)
    finally:
        cli_exit("trace", "summary", path, "--json")


TARGETS = [
    Target("trace_otlp_jsonl", _otlp_seeds, _read_otlp),
    Target("trace_chrome", _chrome_seeds, _read_chrome),
    Target("trace_cli_otlp", _otlp_seeds, _cli, place=_place_folder("traces.otlp.jsonl")),
    Target("trace_cli_chrome", _chrome_seeds, _cli, place=_place_folder("trace.json")),
]
