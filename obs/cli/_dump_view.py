"""``obs dump``: list a data dump and its exception/NaN fault folders, show statistics, diff two runs.

Exit codes (docs/cli.md): ``ls`` and ``stats`` 0, or 1 when a file of the dump is damaged; ``diff`` 1
when the runs diverge (as diff(1)) and 0 when they agree; 2 on bad input (no dump there, bad regex).
``--json``: ``ls`` and ``diff`` one document, ``stats`` JSON lines (one row per line).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterator
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from obs.cli._exit import EXIT_FAILURE, EXIT_OK, EXIT_USAGE
from obs.cli._render import console, err_console, error, markup_text, print_json, print_json_lines, say_written
from obs.features.dump.reader import DumpReader, StatRow

__all__ = ["run_diff", "run_ls", "run_stats"]

_PROGRESS_FROM = 20  # steps; fewer finish before a bar would help
_STEP_CAPTION = ("step: the training step as the RDR, Print, the NaN check and the profiler number it, from 1; "
                 "iteration N is step N + 1 - initial_iteration (docs/dumps.md)")


def _progress(total: int, what: str) -> Progress | None:
    if total < _PROGRESS_FROM or not err_console().is_terminal:
        return None
    return Progress(TextColumn(what), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=err_console(),
                    transient=True)


def _fmt(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


# -- ls ------------------------------------------------------------------------------------------
def run_ls(path: str, *, as_json: bool) -> int:
    reader = DumpReader(path)
    steps: list[dict[str, Any]] = []
    for step in reader.steps():
        names = os.listdir(step.path)
        tensors = [n for n in names if n.endswith(".npy")]
        size = sum(os.path.getsize(os.path.join(step.path, n)) for n in tensors)
        steps.append({"rank": step.rank, "net": step.net, "graph": step.graph, "iteration": step.iteration,
                      "step": step.training_step, "tensors": len(tensors), "bytes": size,
                      "statistic_csv": "statistic.csv" in names, "path": step.path})
    faults: list[dict[str, Any]] = [
        {"kind": c.kind, "path": c.path, "step": c.meta.get("step"), "iteration": c.iteration, "op": c.meta.get("op"),
         "scope": c.meta.get("scope"), "phase": c.meta.get("phase"),
         "exception": (c.meta.get("exception") or {}).get("message") or c.meta.get("message")}
        for c in reader.fault_folders()]
    if as_json:  # "captures": the list's former name, kept for scripts that read it
        print_json({"path": reader.path, "steps": steps, "fault_folders": faults, "captures": faults})
        return EXIT_OK
    out = console()
    if steps:
        # the two numberings side by side: the folders' iterations, and the steps other records name
        table = Table(title=f"data dump in {markup_text(reader.path)}", title_justify="left",
                      caption=_STEP_CAPTION, caption_justify="left")
        for column in ("rank", "net", "graph", "iteration", "step", "tensors", "MB", "statistic.csv"):
            table.add_column(column, justify="left" if column == "net" else "right")
        for s in steps:
            table.add_row(str(s["rank"]), markup_text(s["net"]), str(s["graph"]), str(s["iteration"]),
                          _fmt(s["step"]) if s["step"] is not None else "?", str(s["tensors"]),
                          f"{s['bytes'] / 1e6:.2f}", "yes" if s["statistic_csv"] else "no")
        out.print(table)
    if faults:
        # a fault folder beside a data dump of its rank also names the data dump's iteration of its step
        numbered = any(c["iteration"] is not None for c in faults)
        table = Table(title="exception and NaN/Inf fault folders", title_justify="left")
        for column in ("kind", "step", *(("iteration",) if numbered else ()), "op", "scope", "what", "folder"):
            table.add_column(column, overflow="fold" if column == "folder" else "ellipsis")
        for c in faults:
            iteration = (_fmt(c["iteration"]) if c["iteration"] is not None else "",) if numbered else ()
            table.add_row(c["kind"], _fmt(c["step"]), *iteration, markup_text(str(c["op"])),
                          markup_text(str(c["scope"] or "")), markup_text(str(c["exception"] or ""), newlines=False),
                          markup_text(c["path"]))
        out.print(table)
    return EXIT_OK


# -- stats ---------------------------------------------------------------------------------------
def _rows(reader: DumpReader, op: re.Pattern[str] | None, iteration: int | None, io: str | None) -> Iterator[StatRow]:
    steps = [s for s in reader.steps() if iteration is None or s.iteration == iteration]
    bar = _progress(len(steps), "reading statistic.csv")
    task = bar.add_task("read", total=len(steps)) if bar else None
    if bar:
        bar.start()
    try:
        for step in steps:
            for row in reader.statistics(step):
                if (op is None or op.search(row.op_name) or op.search(row.op_type)) and (io is None or row.io == io):
                    yield row
            if bar and task is not None:
                bar.advance(task)
    finally:
        if bar:
            bar.stop()


def run_stats(path: str, *, op: str | None, iteration: int | None, io: str | None, as_json: bool,
              limit: int | None) -> int:
    try:
        pattern = re.compile(op) if op else None
    except re.error as exc:
        error(f"--op {op!r} is not a valid regular expression: {exc}")
        return EXIT_USAGE
    reader = DumpReader(path)
    rows = _rows(reader, pattern, iteration, io)
    if limit is not None:
        rows = (r for i, r in zip(range(limit), rows))
    if as_json:
        def records() -> Iterator[dict[str, Any]]:
            for r in rows:
                record = dataclasses.asdict(r)
                step = record.pop("step") or {}
                record.update(rank=step.get("rank"), iteration=step.get("iteration"))
                yield record
        print_json_lines(records())
        return EXIT_OK
    table = Table(title=f"statistics in {markup_text(reader.path)}" + (f" (ops matching {markup_text(op)})"
                                                                        if op else ""), title_justify="left")
    columns: list[str] = []
    count = 0
    for r in rows:
        if not columns:
            columns = list(r.stats)
            for c in ("iter", "op", "io", "slot", "dtype", "shape", *columns):
                table.add_column(c, justify="right" if c not in ("op", "io", "dtype", "shape") else "left",
                                 overflow="fold" if c == "op" else "ellipsis")
        table.add_row(str(r.step.iteration if r.step else ""), markup_text(r.op_name), r.io, str(r.slot),
                      markup_text(r.data_type), "(" + ",".join(map(str, r.shape)) + ")",
                      *(_fmt(r.stats.get(c)) for c in columns))
        count += 1
    if count:
        console().print(table)
    else:
        console().print("no statistics match" + ("" if reader.steps() else ": the dump has no iteration folders"))
    return EXIT_OK


# -- diff ----------------------------------------------------------------------------------------
def _op_table(title: str, ops: list[Any]) -> Table:
    from obs.features.dump.diff.metrics import METRIC_LABELS
    from obs.features.dump.diff.render import metric_text

    table = Table(title=title, title_justify="left")
    for column in ("iter", "#", "status", "op", "updates", "from", *METRIC_LABELS.values()):
        table.add_column(column, justify="left" if column in ("status", "op", "updates", "from") else "right",
                         overflow="fold" if column == "op" else "ellipsis")
    for op in ops:
        name = op.name_a or ""
        if op.name_b and (op.renamed or not op.name_a):
            name += f" (B: {op.name_b})"
        style = {"producer": "bold red", "carried": "yellow"}.get(op.status, "")
        updates = op.parameter if op.parameter and op.op_type != "Parameter" else ""
        table.add_row(str(op.iteration), str(op.index), f"[{style}]{op.status}[/]" if style else op.status,
                      markup_text(name), markup_text(updates), op.source or "",
                      *(metric_text(op, key) for key in METRIC_LABELS))
    return table


def _producer_table(op: Any) -> Table:
    from obs.features.dump.diff.render import metrics_text, number_text

    table = Table(show_header=False, box=None)
    table.add_row("op", markup_text(op.name_a or ""))
    if op.renamed:
        table.add_row("in B", markup_text(op.name_b or ""))
    table.add_row("type", markup_text(op.op_type))
    if op.parameter and op.op_type != "Parameter":
        table.add_row("updates", f"parameter {markup_text(op.parameter)}")
    table.add_row("where", f"iteration {op.iteration} (rank {op.rank}), op #{op.index} of the aligned ops")
    inputs = [t for t in op.tensors if t.io == "input"]
    if not inputs:
        table.add_row("inputs", "none compared (its first divergence)")
    else:
        worst = max((t.metrics.max_rel or 0.0) for t in inputs)
        table.add_row("inputs", "agree exactly" if worst == 0 else
                      f"agree within the tolerance (max rel {number_text(worst)}: a difference below it, grown here)")
    table.add_row("outputs", metrics_text(op))
    for t in op.tensors:
        if not t.metrics.within:
            table.add_row(f"{t.io} {t.slot}", markup_text(f"differs in {t.metrics.what}: A {_fmt(t.metrics.a)}, "
                                                          f"B {_fmt(t.metrics.b)}"))
    return table


def run_diff(a: str, b: str, *, rtol: float | None, atol: float | None, tolerance: str | None,
             iteration: int | None, top: int, html: str | None, as_json: bool) -> int:
    from obs._core import safe_files
    from obs.features.dump.diff import compare_dumps
    from obs.features.dump.diff.metrics import Tolerance
    from obs.features.dump.diff.render import render_html, report_dict

    ra, rb = DumpReader(a), DumpReader(b)
    tol = Tolerance(tolerance, rtol, atol)
    total = len(ra.steps())
    bar = _progress(total, "comparing")
    if bar:
        task = bar.add_task("diff", total=total)
        bar.start()
    try:
        report = compare_dumps(ra, rb, tolerance=tol, iterations=[iteration] if iteration is not None else None,
                               progress=(lambda done, n: bar.update(task, completed=done, total=n)) if bar else None)
    finally:
        if bar:
            bar.stop()
    code = EXIT_FAILURE if report.diverged else EXIT_OK
    if not report.steps and not as_json:
        error(f"the dumps share no (rank, iteration): A has {sorted(s.iteration for s in ra.steps())}, "
              f"B has {sorted(s.iteration for s in rb.steps())}")
        return EXIT_USAGE
    if html:
        safe_files.write_atomic(html, render_html(report, a=ra.path, b=rb.path, top=top), fsync=False)
        say_written("HTML report", html)
    if as_json:
        print_json(report_dict(report, a=ra.path, b=rb.path, top=top))
        return code
    out = console()
    inserted, removed, divergent = report.inserted, report.removed, report.divergent
    out.print(f"compared {report.compared} tensors of {len(report.steps)} step(s) by {report.mode} "
              f"({markup_text(tol.describe())}); {len(report.ops)} ops aligned: {len(inserted)} only in B (inserted), "
              f"{len(removed)} only in A (removed)")
    if report.only_in_a or report.only_in_b:
        out.print(f"[dim]steps only in A: {report.only_in_a}; only in B: {report.only_in_b}[/]")
    for what, ops in (("inserted (only in B)", inserted), ("removed (only in A)", removed)):
        if ops:
            more = f" and {len(ops) - top} more" if len(ops) > top else ""
            out.print(f"{what}: " + ", ".join(f"{markup_text(op.name)} (iteration {op.iteration})"
                                              for op in ops[:top]) + more)
    if not divergent:
        out.print("[green]no divergence[/] beyond the tolerance")
        return code
    p = report.producer
    if p is not None:
        out.print("[bold red]producer[/]: the first op whose inputs agree and whose outputs do not")
        out.print(_producer_table(p))
    else:
        out.print(f"[bold red]no producer[/]: the first divergent op, {markup_text(divergent[0].name)}, has inputs "
                  "that already differ (made by an op not dumped, or not paired)")
    out.print(_op_table(f"first divergences ({min(top, len(divergent))} of {len(divergent)} divergent ops: "
                        f"{sum(op.status == 'producer' for op in divergent)} producing, "
                        f"{sum(op.status == 'carried' for op in divergent)} carrying a difference on)",
                        divergent[:top]))
    return code


# -- config check --------------------------------------------------------------------------------
def run_config_check(path: str, *, as_json: bool) -> int:
    """``obs config check`` of a dump config file: exit 0 valid, 1 with every problem listed."""
    from obs.settings.dump_config import DumpConfigError, describe_dump, load_dump_config

    try:
        cfg = load_dump_config(path)
    except DumpConfigError as exc:
        if as_json:
            print_json({"file": path, "kind": "dump", "valid": False,
                        "problems": [{"key": key, "message": message} for key, message in exc.problems]})
        else:
            err = err_console()
            count = len(exc.problems)
            err.print(f"[bold red]obs: dump config {markup_text(path)} is invalid[/] ({count} "
                      f"problem{'s' * (count != 1)}):", markup=True)
            for _, message in exc.problems:
                err.print(f"  [red]✗[/] {markup_text(message)}", markup=True)
        return EXIT_FAILURE
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
              if f.name not in ("raw", "iterations", "kernel_filter", "source")}
    if as_json:
        print_json({"file": path, "kind": "dump", "valid": True, "settings": fields, "turns_on": describe_dump(cfg)})
        return EXIT_OK
    out = console()
    table = Table(title=f"{markup_text(path)}: valid dump config", title_justify="left")
    table.add_column("key")
    table.add_column("value")
    for key, value in fields.items():
        table.add_row(key, markup_text(repr(value)))
    out.print(table)
    for line in describe_dump(cfg):
        out.print(f"• {markup_text(line)}")
    return EXIT_OK
