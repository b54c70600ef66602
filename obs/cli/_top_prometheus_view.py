"""``obs top --prometheus URL [--run RUN_ID]``: the live table of a job's ranks from Prometheus (rendering only).

The same view as the ring-based ``obs top`` (docs/profiling.md says when to use which), built from PromQL by
:mod:`exporters.prometheus_job`: rank, node, step, steps/s, step time, time outside collectives, phase times,
memory, who is late and who is stuck.  ``--once`` prints one table, ``--json`` one JSON document whose ``rank``,
``step``, ``steps_per_s``, ``straggler``, ``late_phase``, ``lateness_s`` and ``waited_for`` mean what the
ring-based document's do.  Exit 0 when the run was read; 2 for a bad URL, window or run id, a Prometheus that
cannot be reached or answers an error, or no run of obs in it.
"""

from __future__ import annotations

import time
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from exporters.prometheus_job import JobSeen, PromQLError, RankSeen, read_job
from exporters.promql import Prometheus
from obs.cli._exit import EXIT_OK, EXIT_USAGE
from obs.cli._render import clean, error, print_json, show_live

__all__ = ["run_top_prometheus"]


def run_top_prometheus(url: str, run_id: str | None, *, once: bool, as_json: bool, interval: float,
                       window: str) -> int:
    if not interval > 0:
        error(f"obs top: --interval must be a number of seconds > 0 (got {interval})")
        return EXIT_USAGE
    try:
        prometheus = Prometheus(url)
        job = read_job(prometheus, run_id, window=window)
    except (ValueError, PromQLError) as exc:
        error(f"obs top: {exc}")
        return EXIT_USAGE
    if not job.ranks:
        known = ", ".join(job.runs[:10]) or "none"
        wanted = f"run {run_id!r}" if run_id is not None else "a run of obs"
        error(f"obs top: Prometheus at {prometheus.url} holds no {wanted} (runs it holds, newest first: {known}; are "
              f"the ranks scraped through the file service-discovery folder prometheus_sd?)")
        return EXIT_USAGE
    if as_json:
        print_json(document(job))
        return EXIT_OK
    seen = [job]

    def refresh() -> Any:
        try:
            seen[0] = read_job(prometheus, seen[0].run_id, window=window)
        except PromQLError as exc:  # the last table stays, with why it is not new
            return Group(_view(seen[0]), Text(clean(f"not refreshed: {exc}"), style="yellow"))
        return _view(seen[0])

    return show_live(_view(job), refresh, once=once, interval=interval)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def document(job: JobSeen) -> dict[str, Any]:
    """The JSON document of ``obs top --prometheus --json``."""
    return {
        "source": "prometheus", "url": job.url, "taken_ns": int(job.taken_s * 1e9), "run_id": job.run_id,
        "runs": job.runs, "window": job.window, "queries": job.queries, "waited_for": job.waited_for,
        "gone": job.gone, "stuck": sorted(r.rank for r in job.ranks if r.stuck),
        "straggler_threshold_s": _round(job.threshold_s),
        "ranks": [{
            "rank": r.rank, "host": r.host, "instance": r.instance, "alive": r.alive, "step": r.step,
            "behind": r.behind, "steps_per_s": _round(r.steps_per_s), "step_s": _round(r.step_s),
            "collectives_s": _round(r.collectives_s), "busy_s": _round(r.busy_s),
            "phases_s": {k: _round(v) for k, v in sorted(r.phases_s.items())},
            "memory_used_bytes": r.memory_used, "memory_peak_bytes": r.memory_peak,
            "since_step_s": _round(r.since_step_s), "median_step_s": _round(r.median_step_s), "stuck": r.stuck,
            "lateness_s": _round(r.lateness_s), "straggler": r.straggler, "late_phase": r.late_phase,
            "phase_excess_s": {k: _round(v) for k, v in sorted(r.phase_excess_s.items())},
        } for r in job.ranks],
    }


def _ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1e3:.1f} ms"


def _bytes(values: dict[str, float]) -> str:
    return " ".join(f"{device} {value / 2**20:.0f} MiB" for device, value in sorted(values.items()))


def _view(job: JobSeen) -> Group:
    head = Text.assemble(("obs top  ", "bold"), clean(f"run {job.run_id}  {len(job.ranks)} rank(s)  from {job.url}"
                                                      f"  over {job.window}  "
                                                      f"{time.strftime('%H:%M:%S', time.localtime(job.taken_s))}"))
    table = Table(show_edge=False, pad_edge=False)
    for column, right in (("rank", True), ("node", False), ("step", True), ("steps/s", True), ("step time", True),
                          ("outside coll.", True), ("phases (mean per step)", False), ("memory used", False),
                          ("late", True), ("", False)):
        table.add_column(column, justify="right" if right else "left", overflow="fold")
    waited = set(job.waited_for)
    for r in job.ranks:
        style = "bold red" if r.rank in waited else "dim" if not r.alive else ""
        phases = " ".join(f"{name} {_ms(took)}" for name, took in sorted(r.phases_s.items()))
        table.add_row(Text(str(r.rank), style=style), clean(r.host), "" if r.step is None else str(r.step),
                      f"{r.steps_per_s:.2f}" if r.steps_per_s else "", _ms(r.step_s), _ms(r.busy_s), clean(phases),
                      _bytes(r.memory_used), _ms(r.lateness_s) if r.straggler else "", Text(_state(r), style=style))
    parts: list[Any] = [head, table]
    if waited:
        parts.append(Text(clean(_waited_line(job)), style="bold red"))
    return Group(*parts)


def _state(r: RankSeen) -> str:
    marks = [] if r.alive else ["gone (not scraped)"]
    if r.stuck:
        marks.append(f"stuck: no step for {r.since_step_s:.0f} s")
    elif r.behind:
        marks.append(f"{r.behind} step(s) behind")
    if r.straggler:
        marks.append(f"straggler{' in ' + r.late_phase if r.late_phase else ''}")
    return ", ".join(marks)


def _waited_line(job: JobSeen) -> str:
    parts = []
    for r in job.ranks:
        if r.stuck:
            parts.append(f"rank {r.rank}: no step for {r.since_step_s:.0f} s")
        elif r.straggler:
            why = f"rank {r.rank}: {_ms(r.lateness_s)} per step more than the others outside collectives"
            if r.late_phase:
                why += f", +{_ms(r.phase_excess_s[r.late_phase])} per step in {r.late_phase}"
            parts.append(why)
    return "the others wait for " + "; ".join(parts)
