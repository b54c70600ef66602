"""``obs trace summary PATH`` and ``obs trace export PATH --endpoint URL`` (rendering only; the readers are in
:mod:`exporters.trace_reader`, the numbers in :mod:`exporters.trace_summary`).

``summary`` takes a ``trace.json``, a ``traces.otlp.jsonl`` or an output folder (``obs_profile``, or one
rank's folder, whose exporter status files add the drop counts and the endpoint).  Exit 1 when spans were
dropped or a file is damaged.  ``export`` re-sends saved OTLP JSON lines to a collector (air-gapped
clusters: copy the folder out, export it from a machine that reaches the collector).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from obs.cli._render import console, err_console, markup_text, print_json

__all__ = ["load_summary", "print_exit_summary", "render_summary", "run_export", "run_summary"]

EXIT_OK, EXIT_PROBLEM = 0, 1


def load_summary(path: str) -> Any:
    """The :class:`TraceSummary` of a file or an output folder."""
    from exporters.trace_reader import folder_files, read_status
    from exporters.trace_summary import SummaryBuilder, Timing, TraceSummary

    builder = SummaryBuilder()
    if os.path.isdir(path):
        paths, status_paths = folder_files(path)
        files, statuses = _read_with_progress(paths), [read_status(p) for p in status_paths]
    else:
        files, statuses = _read_with_progress([path]), []
    dropped: dict[str, int] = {}
    for status in statuses:
        for key, value in (status.get("dropped") or {}).items():
            dropped[key] = dropped.get(key, 0) + int(value)
    for f in files:
        builder.add(f.spans)
        if f.dropped and not statuses:
            dropped["recorded_in_file"] = dropped.get("recorded_in_file", 0) + f.dropped
    endpoint = next((s.get("endpoint") for s in statuses if s.get("endpoint")), "")
    if not files and statuses:  # sent to a collector: the exporter's own summary is all there is here
        data = dict(statuses[-1]["summary"])
        for key in ("phases", "modules", "ops"):
            data[key] = [Timing(**row) for row in data.get(key, [])]
        data.update(dropped=sum(dropped.values()), dropped_detail=dropped, sources=[path])
        return TraceSummary(**data)
    return builder.result(dropped=dropped, endpoint=endpoint, sources=[f.path for f in files])


def _read_with_progress(paths: list[str]) -> list[Any]:
    """Read trace files; on a terminal, with a transient progress bar (by bytes) when there is much to read."""
    import sys

    from exporters.trace_reader import read_path

    sizes = [os.path.getsize(p) for p in paths]
    if not sys.stderr.isatty() or sum(sizes) < 16 << 20:
        return [read_path(p) for p in paths]
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

    out = []
    with Progress(TextColumn("reading traces"), BarColumn(), DownloadColumn(), console=err_console(),
                  transient=True) as bar:
        task = bar.add_task("read", total=sum(sizes))
        for p, size in zip(paths, sizes):
            out.append(read_path(p))
            bar.advance(task, size)
    return out


def run_summary(path: str, *, as_json: bool) -> int:
    if not os.path.exists(path):
        raise FileNotFoundError(2, f"{path!r} does not exist", path)
    summary = load_summary(path)
    if as_json:
        print_json(asdict(summary))
    else:
        render_summary(summary, title=f"trace summary: {path}")
    return EXIT_PROBLEM if summary.dropped else EXIT_OK


def render_summary(summary: Any, *, title: str) -> None:
    from rich.table import Table

    out = console()
    s = summary.step_ms
    out.print(f"[bold]{markup_text(title, newlines=False)}[/]", soft_wrap=True)
    out.print(f"steps {summary.steps}" + (f" ({summary.incomplete_steps} incomplete)" if summary.incomplete_steps
                                          else "")
              + f"   step time p50 {s['p50']:.3f} ms  p90 {s['p90']:.3f}  p99 {s['p99']:.3f}  max {s['max']:.3f}")
    out.print(f"spans {summary.spans}   aggregated into parents {summary.aggregated}   dropped {summary.dropped}"
              + ("" if not summary.dropped_detail else " (" + ", ".join(
                  f"{k.replace('_', ' ')} {v}" for k, v in summary.dropped_detail.items()) + ")")
              + (f"   endpoint {markup_text(summary.endpoint)}" if summary.endpoint else ""), soft_wrap=True)
    for heading, rows, share in (("phase", summary.phases, True), ("module", summary.modules, False),
                                 ("op", summary.ops, False)):
        if not rows:
            continue
        table = Table(title=f"{heading}s by total time", title_justify="left")
        table.add_column(heading)
        for column in ("count", "total ms", "self ms") + (("of step time",) if share else ()):
            table.add_column(column, justify="right")
        for row in rows:
            cells = [str(row.count), f"{row.total_ms:.3f}", f"{row.self_ms:.3f}"]
            if share:
                cells.append(f"{row.share * 100:.1f}%")
            table.add_row(markup_text(row.name), *cells)
        out.print(table)


def print_exit_summary(status: Mapping[str, Any]) -> None:
    """At the end of ``obs run`` / ``obs demo`` with profiling on: the summary and where the trace went (stderr)."""
    from exporters.trace_summary import Timing, TraceSummary

    data = dict(status.get("summary") or {})
    if not data:
        return
    for key in ("phases", "modules", "ops"):
        data[key] = [Timing(**row) for row in data.get(key, [])]
    summary = TraceSummary(**data)
    err = err_console()
    err.print("[dim]obs:[/] profile", soft_wrap=True)
    s = summary.step_ms
    phases = ", ".join(f"{p.name} {p.share * 100:.0f}%" for p in summary.phases)
    err.print(f"  {summary.steps} steps, step time p50 {s['p50']:.3f} ms, p99 {s['p99']:.3f} ms, max "
              f"{s['max']:.3f} ms; {phases}", soft_wrap=True, markup=False)
    err.print(f"  {summary.spans} spans, {summary.aggregated} aggregated into their parents, {summary.dropped} "
              "dropped", soft_wrap=True, markup=False)
    if status.get("endpoint"):
        err.print(f"  sent to {status['endpoint']} ({status.get('protocol')})", soft_wrap=True, markup=False)
    files = [f for f in status.get("files", []) if f.endswith("trace.json")]
    if files:
        err.print(f"  open {files[0]} in https://ui.perfetto.dev (or chrome://tracing); "
                  f"obs trace summary {os.path.dirname(files[0])}", soft_wrap=True, markup=False)


def run_export(path: str, *, endpoint: str, protocol: str, as_json: bool) -> int:
    """Re-send the OTLP JSON lines of ``path`` (a file or a folder) to ``endpoint``."""
    from opentelemetry.sdk.resources import Resource

    from exporters.otlp import OtlpSender, readable_spans
    from exporters.trace_reader import iter_otlp_requests, read_otlp_jsonl, request_spans

    if os.path.isdir(path):
        from exporters.trace_reader import folder_files

        paths = [p for p in folder_files(path)[0] if p.endswith(".jsonl")]
        if not paths:
            raise FileNotFoundError(2, f"{path!r} holds no traces.otlp.jsonl file to export", path)
    else:
        paths = [path]
    sender = OtlpSender(endpoint, protocol, max_spans=1 << 30)
    total = 0
    for p in paths:
        read_otlp_jsonl(p)  # the whole file is checked before anything is sent
        for _, request in iter_otlp_requests(p):
            spans, attrs = request_spans(request)
            batch = readable_spans(spans, Resource(attrs))
            total += len(batch)
            sender.submit(batch)
    sender.close(deadline_s=60.0)
    dropped = sum(sender.dropped.values())
    result = {"files": paths, "endpoint": endpoint, "protocol": protocol, "spans": total, "sent": sender.exported,
              "dropped": dropped, "last_error": sender.last_error}
    if as_json:
        print_json(result)
    else:
        console().print(f"sent {sender.exported} of {total} spans to {markup_text(endpoint)} ({protocol})"
                        + (f"; {dropped} dropped: {markup_text(sender.last_error)}" if dropped else ""),
                        soft_wrap=True)
    return EXIT_PROBLEM if dropped else EXIT_OK
