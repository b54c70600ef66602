"""``obs top [PATH]``: a live table of every rank of a running job, read from its rings (rendering only).

Refreshes in place every ``--interval`` seconds until Ctrl-C; ``--once`` prints one table, ``--json`` one JSON
document.  Exit 0 when rings were read, 2 when PATH is missing or holds no ring (docs/cli.md).
"""

from __future__ import annotations

import time
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from obs.cli._exit import EXIT_OK, EXIT_USAGE
from obs.cli._rdr_view import default_root
from obs.cli._render import clean, error, print_json, show_live
from recorder.live import JobNow, RankNow, read_job

__all__ = ["run_top"]


def run_top(path: str | None, *, once: bool, as_json: bool, interval: float) -> int:
    root = path or default_root()
    if not interval > 0:
        error(f"obs top: --interval must be a number of seconds > 0 (got {interval})")
        return EXIT_USAGE
    job = read_job(root)
    if not job.ranks:
        error(f"obs top: no RDR ring under {root!r} (is the job running with rdr.enable, and rdr.path there?)")
        return EXIT_USAGE
    if as_json:
        print_json(_document(job))
        return EXIT_OK
    return show_live(_view(job), lambda: _view(read_job(root)), once=once, interval=interval)


def _document(job: JobNow) -> dict[str, Any]:
    now = job.taken_ns
    return {
        "root": job.root, "taken_ns": now, "run_id": job.run_id, "waited_for": job.waited_for, "gone": job.gone,
        "collectives_lined_up": job.lineup.collectives, "steps_lined_up": job.lineup.steps,
        "straggler_threshold_s": job.lineup.threshold_s,
        "host_offsets_s": job.lineup.offsets_s,
        "ranks": [{
            "rank": r.rank, "host": r.host, "pid": r.pid, "alive": r.alive, "ring": r.ring, "step": r.step,
            "steps_per_s": r.steps_per_s, "granularity": r.granularity,
            **{f"{key}": None if doing is None else {"name": doing.what, "for_s": round(doing.for_s(now), 6)}
               for key, doing in (("phase", r.phase), ("module", r.module), ("collective", r.collective))},
            "last_seq": r.last_seq, "waited_for": r.waited_for, "lateness_s": r.lateness_s,
            "straggler": r.straggler, "late_phase": r.late_phase, "error": r.error, "rank_known": r.resolved,
        } for r in job.ranks],
    }


def _view(job: JobNow) -> Group:
    now = job.taken_ns
    head = Text.assemble(("obs top  ", "bold"), clean(f"run {job.run_id}  {len(job.ranks)} rank(s)  under {job.root}"
                                                      f"  {time.strftime('%H:%M:%S', time.localtime(now / 1e9))}"))
    table = Table(show_edge=False, pad_edge=False)
    for column, right in (("rank", True), ("host", False), ("pid", True), ("step", True), ("steps/s", True),
                          ("phase", False), ("in now", False), ("last seq", False), ("late", True), ("", False)):
        table.add_column(column, justify="right" if right else "left", overflow="fold")
    for r in job.ranks:
        style = "bold red" if r.rank in job.waited_for else "dim" if not r.alive else ""
        table.add_row(Text(str(r.rank) if r.resolved else "?", style=style), clean(r.host), str(r.pid), str(r.step),
                      f"{r.steps_per_s:.2f}" if r.steps_per_s else "", _doing(r.phase, now), _now_in(r, now),
                      clean(" ".join(f"{g}:{s}" for g, s in sorted(r.last_seq.items()))),
                      f"{r.lateness_s * 1e3:.1f} ms" if r.lateness_s is not None else "",
                      Text(_state(r), style=style))
    parts: list[Any] = [head, table]
    if job.waited_for:
        parts.append(Text(clean(_waited_line(job)), style="bold red"))
    return Group(*parts)


def _doing(doing: Any, now: int) -> str:
    return "" if doing is None else clean(f"{doing.what} {doing.for_s(now):.1f}s")


def _now_in(r: RankNow, now: int) -> str:
    if r.error:
        return clean(f"unreadable: {r.error}")
    inner = r.collective or r.module
    return _doing(inner, now)


def _state(r: RankNow) -> str:
    if r.error:
        return "error"
    marks = [] if r.alive else ["gone (ring left)"]
    if not r.resolved:
        marks.append("rank not known yet")
    if r.waited_for:
        marks.append("others wait for it")
    if r.straggler:
        marks.append(f"straggler{' in ' + r.late_phase if r.late_phase else ''}")
    return ", ".join(marks)


def _waited_line(job: JobNow) -> str:
    late = {x.rank: x for x in job.lineup.ranks}
    parts = []
    for rank in job.waited_for:
        x = late.get(rank)
        why = f": {x.score_s * 1e3:.1f} ms late per step over the last {x.steps}" if x and x.straggler \
            else ": missing from the collective the others wait in"
        if x and x.phase:
            why += f", +{x.phases[x.phase] * 1e3:.1f} ms per step in {x.phase}"
        parts.append(f"rank {rank}{why}")
    return "the others wait for " + "; ".join(parts)
