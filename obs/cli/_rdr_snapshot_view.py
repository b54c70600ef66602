"""``obs rdr snapshot [PATH]``: every live rank of a running job writes a bundle now, and the job goes on.

The live ranks are the rings under PATH whose writer still holds its lock (:func:`recorder.ring_files.live_ranks`).
A ``snapshot`` request goes into the request folder of each RDR root they are under (:mod:`recorder.requests`);
each rank's watcher dumps (reason ``snapshot``: every thread's stack, the ring, ``now`` in the manifest) and
answers.  The command waits up to ``--timeout`` seconds for every live rank, shows the answers, and removes its
request.  Exit 0 when every live rank answered with a bundle, 1 when one did not (in time, or with an error), 2 on
bad input (no live ring under PATH).  ``--json``: one document.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from rich.table import Table
from rich.text import Text

from obs._core.errors import NotOurFileError
from obs.cli._exit import EXIT_FAILURE, EXIT_OK
from obs.cli._rdr_view import default_root
from obs.cli._render import clean, console, err_console, print_json
from recorder.requests import ask
from recorder.ring_files import LiveRank, live_ranks

__all__ = ["run_snapshot"]


def run_snapshot(path: str | None, *, timeout: float, as_json: bool) -> int:
    if not timeout > 0:
        raise ValueError(f"--timeout must be a number of seconds > 0 (got {timeout})")
    where = path or default_root()
    ranks = live_ranks(where)
    if not ranks:
        raise NotOurFileError(f"no running job under {where!r}: no ring there whose process is alive (obs rdr ls "
                              "lists its bundles, obs rdr recover turns the rings of dead processes into bundles)",
                              path=where)
    requests, answers, waited = ask({r.root for r in ranks}, "snapshot", [(r.root, r.rank, r.pid) for r in ranks],
                                    timeout=timeout)
    rows = [_row(r, answers.get((r.root, r.rank, r.pid))) for r in ranks]
    missing = [row for row in rows if not row["answered"]]
    failed = [row for row in rows if row["answered"] and not row.get("bundle")]
    status = EXIT_OK if not missing and not failed else EXIT_FAILURE
    if as_json:
        print_json({"path": where, "requests": {root: r.name for root, r in requests.items()}, "timeout_s": timeout,
                    "waited_s": waited, "ranks": rows, "missing": [row["rank"] for row in missing],
                    "failed": [row["rank"] for row in failed], "complete": status == EXIT_OK})
        return status
    _render(where, rows, waited, timeout)
    return status


def _row(rank: LiveRank, answer: dict[str, Any] | None) -> dict[str, Any]:
    row: dict[str, Any] = {**asdict(rank), "answered": answer is not None}
    if answer is not None:
        for key in ("bundle", "step", "now", "error", "note", "answered_ns"):
            if answer.get(key) is not None:
                row[key] = answer[key]
    return row


def _doing(row: dict[str, Any]) -> str:
    """What the rank was doing when it dumped: the collective it waits in, the innermost module it is in."""
    now = row.get("now")
    if not isinstance(now, dict):
        return ""
    parts = []
    coll = now.get("collective")
    if isinstance(coll, dict):
        since, answered = coll.get("since_ns"), row.get("answered_ns")
        age = f", {(answered - since) / 1e9:.1f} s" if isinstance(since, int) and isinstance(answered, int) else ""
        parts.append(f"in {coll.get('op')} ({coll.get('group')} #{coll.get('seq')}, {coll.get('state')}{age})")
    if now.get("module"):
        parts.append(f"module {now['module']}")
    return "; ".join(parts) or "no open collective or module"


def _render(where: str, rows: list[dict[str, Any]], waited: float, timeout: float) -> None:
    out = console()
    answered = [r for r in rows if r["answered"]]
    out.print(Text.assemble(("snapshot: ", "bold"), clean(f"{len(answered)} of {len(rows)} live rank(s) under "
                                                           f"{where} answered in {waited:.1f} s")), soft_wrap=True)
    table = Table(title=Text("ranks (the job goes on)"), title_justify="left")
    for column in ("rank", "host", "pid", "bundle", "step", "now"):
        table.add_column(column, justify="right" if column in ("rank", "pid", "step") else "left", overflow="fold")
    for r in rows:
        if not r["answered"]:
            bundle, style = Text(f"no answer within {timeout:g} s", style="bold red"), "bold red"
        elif not r.get("bundle"):
            bundle, style = Text(clean(f"error: {r.get('error')}"), style="bold red"), "bold red"
        else:
            bundle, style = Text(clean(r["bundle"])), ""
        table.add_row(Text(str(r["rank"]), style=style), Text(clean(r["host"])), str(r["pid"]), bundle,
                      clean(r.get("step", "")), Text(clean(_doing(r))))
    out.print(table)
    missing = [r for r in rows if not r["answered"]]
    if missing:
        err = err_console()
        for r in missing:
            err.print(Text(clean(f"obs: rank {r['rank']} (pid {r['pid']} on {r['host']}) did not answer within "
                                 f"{timeout:g} s: its recorder may have started after the request, or it is stuck in "
                                 f"C code holding the GIL; its ring: {r['ring']}"), style="yellow"), soft_wrap=True)
