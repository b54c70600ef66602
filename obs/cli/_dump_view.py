"""``obs dump``: list a data dump and its exception/NaN captures, show statistics, diff two runs.

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
from obs.cli._render import console, err_console, error, markup_text, print_json, print_json_lines
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
    captures: list[dict[str, Any]] = [
        {"kind": c.kind, "path": c.path, "step": c.meta.get("step"), "iteration": c.iteration, "op": c.meta.get("op"),
         "scope": c.meta.get("scope"), "phase": c.meta.get("phase"),
         "exception": (c.meta.get("exception") or {}).get("message") or c.meta.get("message")}
        for c in reader.captures()]
    if as_json:
        print_json({"path": reader.path, "steps": steps, "captures": captures})
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
    if captures:
        # a capture beside a data dump of its rank also names the data dump's iteration of its step
        numbered = any(c["iteration"] is not None for c in captures)
        table = Table(title="exception and NaN/Inf captures", title_justify="left")
        for column in ("kind", "step", *(("iteration",) if numbered else ()), "op", "scope", "what", "folder"):
            table.add_column(column, overflow="fold" if column == "folder" else "ellipsis")
        for c in captures:
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
def run_diff(a: str, b: str, *, rtol: float, atol: float, iteration: int | None, as_json: bool) -> int:
    from obs.features.dump.diff import diff_dumps

    ra, rb = DumpReader(a), DumpReader(b)
    total = len(ra.steps())
    bar = _progress(total, "comparing")
    if bar:
        task = bar.add_task("diff", total=total)
        bar.start()
    try:
        result = diff_dumps(ra, rb, rtol=rtol, atol=atol, iterations=[iteration] if iteration is not None else None,
                            progress=(lambda done, n: bar.update(task, completed=done, total=n)) if bar else None)
    finally:
        if bar:
            bar.stop()
    if as_json:
        print_json({**dataclasses.asdict(result), "a": ra.path, "b": rb.path, "rtol": rtol, "atol": atol,
                    "diverged": result.first is not None})
        return EXIT_FAILURE if result.first is not None else EXIT_OK
    out = console()
    if not result.steps:
        error(f"the dumps share no (rank, iteration): A has {sorted(s.iteration for s in ra.steps())}, "
              f"B has {sorted(s.iteration for s in rb.steps())}")
        return EXIT_USAGE
    out.print(f"compared {result.compared} tensors of {len(result.steps)} step(s) by {result.mode} "
              f"(rtol={rtol:g}, atol={atol:g})")
    if result.only_in_a or result.only_in_b:
        out.print(f"[dim]steps only in A: {result.only_in_a}; only in B: {result.only_in_b}[/]")
    d = result.first
    if d is None:
        out.print("[green]no divergence[/] beyond the tolerance")
        return EXIT_OK
    out.print(f"[bold red]first divergence[/] at iteration {d.iteration} (rank {d.rank}), op #{d.index} in "
              f"execution order:")
    table = Table(show_header=False, box=None)
    table.add_row("op", markup_text(d.op_name))
    table.add_row("type", markup_text(d.op_type))
    table.add_row("tensor", f"{d.io} {d.slot}")
    table.add_row("differs in", markup_text(d.what))
    table.add_row("A", markup_text(_fmt(d.a)))
    table.add_row("B", markup_text(_fmt(d.b)))
    out.print(table)
    return EXIT_FAILURE


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
