"""``obs monitor show``, ``explain`` and ``plot``: a monitor run's series that moved most, its anomalies in causal
order, and the page of its heatmaps.

Exit codes (docs/cli.md): ``explain`` 1 when it found an anomaly, 0 when none; ``show`` and ``plot`` 0; all 1 on a
damaged file and 2 on bad input (no run under PATH, a bad ``--columns``).
"""

from __future__ import annotations

import math
import time
from typing import Any

from rich.table import Table

from obs._core import safe_files
from obs.cli._exit import EXIT_FAILURE, EXIT_OK, EXIT_USAGE
from obs.cli._render import console, error, markup_text, print_json, say_written, warning
from obs.features.monitor.bundle_run import is_bundle, read_bundle_run
from obs.features.monitor.explain import Explanation, Finding, explain, movers
from obs.features.monitor.job import Job, JobExplanation, explain_job, find_job, job_movers, read_job
from obs.features.monitor.reader import MonitorRun, find_run, is_run, read_run

__all__ = ["print_explanation", "run_explain", "run_plot", "run_show"]


def _job(path: str) -> tuple[Job, list[MonitorRun]] | None:
    """A root of runs: the job's runs, one per rank (obs.features.monitor.job); None for a run folder."""
    if is_run(path) or is_bundle(path):
        return None
    job = find_job(path)
    if job.left_out:
        warning(f"{len(job.left_out)} other monitor run(s) under {path} left out: not of the job that ran last, or "
                f"older runs of its ranks ({job.rule})")
    return job, read_job(job)


def _read(path: str) -> tuple[str, object]:
    if is_bundle(path):  # an RDR bundle's monitor part (its last steps, the anomalies flagged while it ran)
        return path, read_bundle_run(path)
    folder, others = find_run(path)
    if others:
        warning(f"{len(others) + 1} monitor runs under {path}; showing the newest, {folder}")
    return folder, read_run(folder)


def _num(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.4g}"


def run_show(path: str, *, top: int, step: int | None, rows: int, as_json: bool) -> int:
    found = _job(path)
    if found is not None:
        table_data = job_movers(*found, top=top, step=step, rows=rows)
        several = len(found[1]) > 1
    else:
        _, run = _read(path)
        table_data = movers(run, top=top, step=step, rows=rows)  # type: ignore[arg-type]
        several = False
    if as_json:
        print_json(table_data.as_dict())
        return EXIT_OK
    out = console()
    if not table_data.movers:
        out.print(f"no series in {markup_text(table_data.folder)}")
        return EXIT_OK
    out.print(f"[bold]{markup_text(table_data.folder)}[/]: the {len(table_data.movers)} series that moved most")
    table = Table(title_justify="left")
    table.add_column("step", justify="right")
    for m in table_data.movers:
        rank = f"rank {m.rank}: " if several else ""
        call = f" (call {m.micro_step})" if m.micro_step else ""  # a module's or a collective's later call
        table.add_column(f"{rank}{markup_text(m.kind)} {markup_text(m.name)}{call}\n{markup_text(m.series)}/"
                         f"{markup_text(m.stat)}", justify="right", overflow="fold")
    for s, row in zip(table_data.steps, table_data.values):
        peaks = {j for j, m in enumerate(table_data.movers) if m.peak_step == s}
        table.add_row(str(s), *[f"[bold red]{_num(v)}[/]" if j in peaks else _num(v) for j, v in enumerate(row)])
    out.print(table)
    return EXIT_OK


def run_explain(path: str, *, step: int | None, span: int, limit: int, as_json: bool) -> int:
    job = _job(path)
    if job is not None:
        return _explain_job(explain_job(*job, step=step, span=span), limit=limit, as_json=as_json)
    _, run = _read(path)
    found: Explanation = explain(run, step=step, span=span)  # type: ignore[arg-type]
    for problem in found.problems:
        warning(problem)
    if as_json:
        print_json(found.as_dict())
        return EXIT_FAILURE if found.first else EXIT_OK
    print_explanation(console(), found, limit)
    return EXIT_FAILURE if found.first else EXIT_OK


def print_explanation(out: Any, found: Explanation, limit: int) -> None:
    """The first anomaly, when the loss moved after it, and the anomalies in causal order (``obs rdr show`` too)."""
    window = f" in steps {found.window[0]}..{found.window[1]}" if found.window else ""
    if found.first is None:
        out.print(f"no anomaly{window} in {markup_text(found.folder)} (rules: {', '.join(found.rules)})")
        return
    f = found.first
    where = f"rank {f.rank}, " if f.rank is not None else ""
    out.print(f"[bold]first anomaly[/]{window}: step {f.step} ({where}{f.stage}): [bold]{markup_text(f.kind)} "
              f"{markup_text(f.name)}[/] {markup_text(f.series)}/{markup_text(f.stat)} = {_num(f.value)}, baseline "
              f"{_num(f.baseline)} ({markup_text(f.rule)})")
    if found.loss_step is not None:
        out.print(f"the loss left its history at step {found.loss_step}, {found.lead_steps} step(s) later")
    else:
        out.print("the loss did not leave its history after it")
    table = Table(title=f"{len(found.anomalies)} anomalies in causal order (step; forward in module order, backward "
                        "in reverse, the collectives, then the optimizer)", title_justify="left")
    for column in ("step", "stage", "kind", "name", "series/stat", "value", "baseline", "rule"):
        table.add_column(column, justify="right" if column in ("step", "value", "baseline") else "left",
                         overflow="fold")
    for a in found.anomalies[:limit]:
        name = a.name if a.micro_step is None else f"{a.name} (call {a.micro_step})"
        table.add_row(str(a.step), a.stage, markup_text(a.kind), markup_text(name),
                      f"{markup_text(a.series)}/{markup_text(a.stat)}", _num(a.value), _num(a.baseline),
                      markup_text(a.rule))
    out.print(table)
    if len(found.anomalies) > limit:
        out.print(f"[dim]... {len(found.anomalies) - limit} more (--limit, --json)[/]")


def run_plot(path: str, *, html: str, columns: int) -> int:
    from obs.features.monitor.plot import build_plot
    from obs.features.monitor.plot_html import render_html

    if columns < 1:
        error(f"--columns must be at least 1 (got {columns})")
        return EXIT_USAGE
    _, run = _read(path)
    found: Explanation = explain(run)  # type: ignore[arg-type]
    for problem in found.problems:
        warning(problem)
    page = render_html(build_plot(run, found, max_columns=columns))  # type: ignore[arg-type]
    safe_files.write_atomic(html, page, fsync=False)
    say_written("monitor plot", html)
    return EXIT_OK


def _label(kind: str, series: str) -> str:
    """After the kind: a file's prefix, or for scalars the row (the loss: nothing, the global gradient norm)."""
    return f" {series}" if series != "scalars" else ("" if kind == "loss" else " grad_norm")


def _ranks(ranks: list[int | None]) -> str:
    return ", ".join("?" if r is None else str(r) for r in ranks)


def _when(t: float | None) -> str:
    if t is None:
        return ""
    return time.strftime(" at %H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d} UTC"


def _first_line(f: Finding, window: str, t: float | None) -> str:
    where = f"rank {f.rank}, " if f.rank is not None else ""
    return (f"[bold]first anomaly[/]{window}: step {f.step} ({where}{f.stage}): [bold]{markup_text(f.kind)} "
            f"{markup_text(f.name)}[/] {markup_text(f.series)}/{markup_text(f.stat)} = {_num(f.value)}, baseline "
            f"{_num(f.baseline)} ({markup_text(f.rule)}){_when(t)}")


def _explain_job(found: JobExplanation, *, limit: int, as_json: bool) -> int:
    """A job's anomalies, its ranks merged: where it began (one rank or all) and how it spread at that step."""
    for problem in found.problems:
        warning(problem)
    if as_json:
        print_json(found.as_dict())
        return EXIT_FAILURE if found.first else EXIT_OK
    out = console()
    several = len(found.ranks) > 1
    if several:
        clocks = sorted({(r.host or "?", r.offset_s) for r in found.ranks})
        clock = "; ".join(f"{markup_text(h)} {o:+.3f} s" for h, o in clocks) if len(clocks) > 1 else "one clock"
        out.print(f"job of {len(found.ranks)} ranks ({_ranks([r.rank for r in found.ranks])}) under "
                  f"{markup_text(found.root)}; clocks: {clock}")
    window = f" in steps {found.window[0]}..{found.window[1]}" if found.window else ""
    if found.first is None:
        out.print(f"no anomaly{window} in {markup_text(found.root)} (rules: {', '.join(found.rules)})")
        return EXIT_OK
    f = found.first
    out.print(_first_line(f, window, found.times[0]))
    if found.scope == "one rank":
        out.print(f"it began on [bold]one rank[/], rank {_ranks(found.scope_ranks)} of {len(found.ranks)}: a bad "
                  "data shard or a faulty device there is likely")
    elif found.scope is not None:
        out.print(f"it began on [bold]{found.scope}[/]: ranks {_ranks(found.scope_ranks)} of {len(found.ranks)}")
    if several and found.spread:
        steps = "; ".join(f"{s.stage} {markup_text(s.kind)}{markup_text(_label(s.kind, s.series))} on rank"
                          f"{'s' if len(s.ranks) > 1 else ''} {_ranks(s.ranks)}" for s in found.spread)
        out.print(f"at step {f.step}: {steps}")
    if found.loss_step is not None:
        out.print(f"the loss left its history at step {found.loss_step}, {found.lead_steps} step(s) later")
    else:
        out.print("the loss did not leave its history after it")
    order = "step; forward in module order, backward in reverse, the collectives, then the optimizer"
    table = Table(title=f"{len(found.anomalies)} anomalies in causal order ({order}{'; then rank' if several else ''})",
                  title_justify="left")
    columns = ("step", "rank", "stage", "kind", "name", "series/stat", "value", "baseline", "rule")
    for column in columns:
        table.add_column(column, justify="right" if column in ("step", "rank", "value", "baseline") else "left",
                         overflow="fold")
    for a in found.anomalies[:limit]:
        name = a.name if a.micro_step is None else f"{a.name} (call {a.micro_step})"
        table.add_row(str(a.step), "-" if a.rank is None else str(a.rank), a.stage, markup_text(a.kind),
                      markup_text(name), f"{markup_text(a.series)}/{markup_text(a.stat)}", _num(a.value),
                      _num(a.baseline), markup_text(a.rule))
    out.print(table)
    if len(found.anomalies) > limit:
        out.print(f"[dim]... {len(found.anomalies) - limit} more (--limit, --json)[/]")
    return EXIT_FAILURE
