"""``obs trace capture [PATH] --steps N [--level task_trace|op_trace]``: detail for the next N steps of every live
rank of a running job, from the profiler's output folder.

The live ranks are the profiler rings (``{output}/rank_{r}/profile_{pid}_{n}.obsring``) whose writer still holds
its lock.  A ``capture`` request goes into ``{output}/requests/`` (:mod:`recorder.requests`); each rank's profiling
session watches that folder itself (with or without the RDR), records module (and, with ``op_trace``, op) spans for
its next N steps and answers with their numbers.  The command waits up to ``--timeout`` seconds, shows the answers
and removes its request.  Exit 0 when every live rank answered without an error, 1 when one did not, 2 on bad input
(no live profiler ring under PATH).  ``--json``: one document.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from rich.table import Table
from rich.text import Text

from obs._core.errors import NotOurFileError
from obs.cli._exit import EXIT_FAILURE, EXIT_OK
from obs.cli._render import clean, console, err_console, print_json
from obs.settings.profiler_options import capture_params
from recorder.requests import ask
from recorder.ring_files import PROFILE_RINGS, LiveRank, find_rings, live_ranks

__all__ = ["run_capture"]


def _no_live_ring(where: str) -> NotOurFileError:
    rdr = [r for r in find_rings(where) if r.alive]
    hint = (" (it holds the RDR's rings: obs trace capture asks the profiler through its own output folder, "
            "profiler.output, default ./obs_profile)" if rdr else
            " (is the profiler on? obs trace capture needs a running profiling session: enable_profiling or the env "
            "config's profiler.enable)")
    return NotOurFileError(f"no running profiler under {where!r}: no profile_*.obsring there whose process is alive"
                           + hint, path=where)


def run_capture(path: str | None, *, steps: int, level: str, timeout: float, as_json: bool) -> int:
    if not timeout > 0:
        raise ValueError(f"--timeout must be a number of seconds > 0 (got {timeout})")
    params = {"steps": steps, "level": level}
    capture_params(params, "--steps/--level")  # the ranks check it too; a bad value is said here first
    where = path or "obs_profile"
    ranks = live_ranks(where, PROFILE_RINGS)
    if not ranks:
        raise _no_live_ring(where)
    requests, answers, waited = ask({r.root for r in ranks}, "capture", [(r.root, r.rank, r.pid) for r in ranks],
                                    timeout=timeout, params=params)
    rows = [_row(r, answers.get((r.root, r.rank, r.pid))) for r in ranks]
    missing = [row for row in rows if not row["answered"]]
    failed = [row for row in rows if row["answered"] and row.get("error")]
    status = EXIT_OK if not missing and not failed else EXIT_FAILURE
    if as_json:
        print_json({"path": where, "requests": {o: r.name for o, r in requests.items()}, "steps": steps,
                    "level": level, "timeout_s": timeout, "waited_s": waited, "ranks": rows,
                    "missing": [row["rank"] for row in missing], "failed": [row["rank"] for row in failed],
                    "complete": status == EXIT_OK})
        return status
    _render(where, rows, waited, timeout, steps, level)
    return status


def _row(rank: LiveRank, answer: dict[str, Any] | None) -> dict[str, Any]:
    fields = asdict(rank)
    row: dict[str, Any] = {"output": fields.pop("root"), **fields, "answered": answer is not None}
    if answer is not None:
        for key in ("steps", "queued", "after_step", "error", "note", "answered_ns"):
            if answer.get(key) is not None:
                row[key] = answer[key]
    return row


def _steps_text(row: dict[str, Any]) -> str:
    steps = row.get("steps")
    if isinstance(steps, list) and len(steps) == 2:
        return f"{steps[0]}-{steps[1]}" if steps[0] != steps[1] else str(steps[0])
    if row.get("queued"):
        return f"queued: from the first boundary after step {row.get('after_step')}"
    return ""


def _render(where: str, rows: list[dict[str, Any]], waited: float, timeout: float, steps: int, level: str) -> None:
    out = console()
    answered = [r for r in rows if r["answered"]]
    out.print(Text.assemble(("capture: ", "bold"), clean(f"{level} for {steps} step(s); {len(answered)} of "
                                                          f"{len(rows)} live rank(s) under {where} answered in "
                                                          f"{waited:.1f} s")), soft_wrap=True)
    table = Table(title=Text("ranks (spans in their trace files as the steps end)"), title_justify="left")
    for column in ("rank", "host", "pid", "steps"):
        table.add_column(column, justify="right" if column in ("rank", "pid") else "left", overflow="fold")
    for r in rows:
        if not r["answered"]:
            text, style = Text(f"no answer within {timeout:g} s", style="bold red"), "bold red"
        elif r.get("error"):
            text, style = Text(clean(f"error: {r['error']}"), style="bold red"), "bold red"
        else:
            text, style = Text(clean(_steps_text(r))), ""
        table.add_row(Text(str(r["rank"]), style=style), Text(clean(r["host"])), str(r["pid"]), text)
    out.print(table)
    for r in rows:
        if not r["answered"]:
            err_console().print(Text(clean(f"obs: rank {r['rank']} (pid {r['pid']} on {r['host']}) did not answer "
                                           f"within {timeout:g} s: its session may have started after the request, "
                                           f"or it is stuck in C code holding the GIL; its ring: {r['ring']}"),
                                     style="yellow"), soft_wrap=True)
