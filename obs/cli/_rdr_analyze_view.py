"""``obs rdr analyze ROOT``: line the ranks of a job up and name the culprit (rendering only).

Exit 1 when a culprit or a problem is found (a rank that raised, disagreed, left no bundle, or a
hang), 0 when every rank agrees, 2 on bad input.  ``--json``: one document.
"""

from __future__ import annotations

import shlex
from dataclasses import asdict
from typing import Any

from rich.table import Table
from rich.text import Text

from obs.cli._rdr_view import _reason, default_root
from obs.cli._render import clean, console, err_console, print_json
from recorder.analyze import Analysis, analyze
from recorder.arrival import OTHER
from recorder.layout import PHASE_NAMES

__all__ = ["run_analyze"]

EXIT_OK, EXIT_PROBLEM = 0, 1
PHASE_ORDER = (*PHASE_NAMES, OTHER)


def run_analyze(path: str | None, *, as_json: bool) -> int:
    result = analyze(path or default_root())
    status = EXIT_OK if result.consistent else EXIT_PROBLEM
    if as_json:
        print_json({**asdict(result), "consistent": result.consistent})
        return status
    _render(result)
    return status


def _render(a: Analysis) -> None:
    out = console()
    out.print(Text.assemble(("job: ", "bold"), clean(f"run {a.run_id}  {a.world_size} rank(s)  under {a.root}")),
              soft_wrap=True)
    style = "green" if a.consistent else "bold red"
    out.print(Text.assemble(("verdict: ", "bold"), (clean(a.verdict), style)), soft_wrap=True)
    if a.culprits:
        out.print(Text.assemble(("culprit rank(s): ", "bold"), (", ".join(map(str, a.culprits)), "bold red")),
                  soft_wrap=True)
    out.print(_ranks_table(a))
    for m in a.mismatches:
        out.print(Text(clean(f"── first disagreement in group {m.group}: collective #{m.seq} (step {m.step}), "
                             f"{m.kind} ──"), style="bold red"), soft_wrap=True)
        for what, ranks in m.sides.items():
            out.print(Text(clean(f"  rank(s) {', '.join(map(str, ranks))}: {what}")), soft_wrap=True)
    if a.stuck is not None:
        out.print(Text(clean(f"every rank waits in {a.stuck.group} collective #{a.stuck.seq}: "
                             f"{a.stuck.describe()} ({a.stuck.state})"), style="bold red"), soft_wrap=True)
    for s in a.stragglers:
        lag = " and ".join(f"{n} {what}" for n, what in ((s.behind_steps, "step(s)"),
                                                         (s.behind_collectives, "world-group collective(s)")) if n)
        if lag:
            out.print(Text(f"straggler: rank {s.rank} is {lag} behind the furthest rank", style="yellow"),
                      soft_wrap=True)
    if any(s.lateness_s is not None for s in a.stragglers):
        out.print(_late_table(a))
    if a.nan:
        out.print(Text(clean(f"first NaN/Inf: rank {a.nan['rank']} at step {a.nan['step']}: {a.nan['detail']}"),
                       style="bold red"), soft_wrap=True)
    for state in a.ranks:
        if state.bundle is None and state.note and "obs rdr recover" in state.note:
            out.print(Text(f"  recover it with: obs rdr recover {shlex.quote(clean(a.root))}"), soft_wrap=True)
            break
    if a.other_runs:
        out.print(Text(clean(f"other runs under this root (not analyzed): {', '.join(a.other_runs)}"), style="dim"),
                  soft_wrap=True)
    err = err_console()
    for problem in a.problems:
        err.print(Text.assemble(("obs: error: ", "bold red"), "cannot read: ", clean(problem)), soft_wrap=True)


def _late_table(a: Analysis) -> Table:
    """The stragglers by arrival: how late they come to collectives, and their busy time per step in each phase
    against the other ranks' median (ms; where the time went)."""
    late = {x.rank: x for x in a.lineup.ranks}
    rows = [late[s.rank] for s in a.stragglers if s.lateness_s is not None and s.rank in late]
    phases = sorted({p for x in rows for p in x.phases}, key=lambda p: (PHASE_ORDER.index(p) if p in PHASE_ORDER
                                                                        else len(PHASE_ORDER), p))
    table = Table(title=Text(f"stragglers by arrival ({a.lineup.collectives} collectives of {a.lineup.steps} steps "
                             "lined up; phases: ms per step against the other ranks)"), title_justify="left")
    table.add_column("rank", justify="right")
    table.add_column("late per step", justify="right")
    table.add_column("latest in", justify="right")
    for p in phases:
        table.add_column(p, justify="right")
    for x in rows:
        table.add_row(str(x.rank), f"{x.score_s * 1e3:.1f} ms", f"{x.last_share:.0%} of steps",
                      *[Text(f"{x.phases[p] * 1e3:+.1f}" if p in x.phases else "", style="bold red" if p == x.phase
                             else "") for p in phases])
    return table


def _ranks_table(a: Analysis) -> Table:
    table = Table(title=Text("ranks (newest bundle of each)"), title_justify="left")
    where = any(s.where for s in a.ranks)  # the main thread's innermost frame of the user's code (live dumps)
    for column in ("rank", "bundle", "step", "last collective", "raised / note") + (("at",) if where else ()):
        table.add_column(column, justify="right" if column in ("rank", "step") else "left", overflow="fold")
    for s in a.ranks:
        last = s.last_collective
        last_text = f"{last.group} #{last.seq} {last.op} {last.state}" if last else ""
        bundle = _reason(s.reason or "?", s.recovered) if s.bundle else "none"
        note: Any = s.exception or s.note or ""
        if s.exception and s.raised_in_collective:
            note = f"{s.exception} (in a collective)"
        style = "bold red" if s.rank in a.culprits else ""
        cells = [Text(str(s.rank), style=style), Text(clean(bundle), style=style),
                 str(s.step) if s.step is not None else "", Text(clean(last_text)),
                 Text(_short(str(note)), style=style)]
        table.add_row(*cells, *([Text(clean(s.where or ""))] if where else []))
    return table


def _short(text: str, limit: int = 120) -> str:
    """The first line of an exception or note, cut at ``limit`` (``--json`` has it whole)."""
    line = clean(text.strip().splitlines()[0] if text.strip() else "")
    return line if len(line) <= limit else line[:limit - 1] + "…"
