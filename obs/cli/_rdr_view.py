"""``obs rdr ls | show | events | recover``: post-mortem views of RDR bundles (rendering only).

Conventions (docs/cli.md): paths and commands are printed whole (never wrapped or cut); every string
a bundle supplies is escaped with :func:`clean` and rendered as plain text (never as markup);
``--json`` gives one JSON document for a single object (``ls``, ``show``, ``recover``) and JSON lines
for a stream of records (``events``).  A bad bundle or ring is reported and the rest still shown;
the command then exits 1.
"""

from __future__ import annotations

import os
import shlex
import time
from dataclasses import asdict
from typing import Any

from rich.table import Table
from rich.text import Text

from obs._core import env
from obs.cli._render import clean, console, err_console, print_json, print_json_lines
from recorder.bundle_reader import EVENT_KINDS, Bundle, Selection, list_bundles, load_bundle
from recorder.device_faults import explanation_text
from recorder.stacks import is_hidden, is_wrapper

__all__ = ["default_root", "run_events", "run_ls", "run_recover", "run_show"]

EXIT_OK, EXIT_PROBLEM = 0, 1


def _when(ns: Any) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ns / 1e9)) + f".{ns // 1_000_000 % 1000:03d}"
    except (TypeError, ValueError, OverflowError, OSError):
        return clean(ns)


def default_root() -> str:
    """Where ``ls`` and ``recover`` look without a path: ``$MS_RDR_PATH``, else the current folder."""
    return env.text(env.MS_RDR_PATH) or os.getcwd()


def _plain(text: Any, style: str = "") -> Text:
    """File-supplied text, control characters escaped, never read as markup."""
    return Text(clean(text), style=style)


def _say_problems(problems: list[Exception], what: str) -> None:
    err = err_console()
    for exc in problems:
        err.print(Text.assemble(("obs: error: ", "bold red"), f"{what}: ", clean(str(exc))), soft_wrap=True)


def run_ls(path: str | None, *, as_json: bool) -> int:
    root = path or default_root()
    listing = list_bundles(root)
    status = EXIT_PROBLEM if listing.damaged else EXIT_OK
    if as_json:
        print_json({"root": root, "bundles": [{**asdict(b), "name": b.name} for b in listing.bundles],
                    "rings_to_recover": [r.path for r in listing.rings], "incomplete": listing.incomplete,
                    "damaged": [str(e) for e in listing.damaged], "skipped": [str(e) for e in listing.skipped]})
        return status
    out = console()
    if not listing.bundles:
        out.print(Text(f"no RDR bundles under {clean(root)}"), soft_wrap=True)
    else:
        out.print(Text(f"RDR bundles under {clean(root)}, newest first:"), soft_wrap=True)
        rows = [(clean(os.path.relpath(b.path, root)), str(b.rank), clean(_reason(b.reason, b.recovered)),
                 str(b.step), b.reason) for b in listing.bundles]
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(("bundle", "rank", "reason"))]
        out.print(Text(f"  {'bundle':<{widths[0]}}  {'rank':>{widths[1]}}  {'reason':<{widths[2]}}  step",
                       style="bold"), soft_wrap=True)
        for name, rank, reason, step, raw in rows:
            style = "green" if raw == "normal_end" else "bold red"
            out.print(Text.assemble(f"  {name:<{widths[0]}}  {rank:>{widths[1]}}  ",
                                    (f"{reason:<{widths[2]}}", style), f"  {step}"), soft_wrap=True)
    for ring in listing.rings:
        out.print(Text.assemble(("ring of pid ", "yellow"), (f"{ring.pid} was never dumped (process killed?): ",
                                                               "yellow"), clean(ring.path)), soft_wrap=True)
        ring_folder = shlex.quote(clean(os.path.dirname(ring.path)))
        out.print(Text(f"  turn it into a bundle with: obs rdr recover {ring_folder}"), soft_wrap=True)
    for folder in listing.incomplete:
        out.print(Text(f"interrupted dump (ignored): {clean(folder)}", style="dim"), soft_wrap=True)
    for exc in listing.skipped:
        out.print(Text(f"skipped, not an RDR bundle: {clean(str(exc))}", style="dim"), soft_wrap=True)
    _say_problems(listing.damaged, "cannot read")
    return status


def _reason(reason: str, recovered: bool) -> str:
    """The reason, marked when the bundle was recovered from a ring (once: a reason may already say so)."""
    return f"{reason} (recovered)" if recovered and "recovered" not in reason else reason


def _num(value: Any, scale: float = 1.0, fmt: str = ".1f") -> str:
    return format(value / scale, fmt) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        else clean(value)


def _what(event: dict[str, Any]) -> str:
    kind = event.get("kind")
    if kind == "module_exit" and event.get("error") is True:
        return f"{clean(event.get('scope'))} raised"
    if kind in ("module_enter", "module_exit"):
        return clean(event.get("scope"))
    if kind == "op":
        return (f"{clean(event.get('name'))}  {clean(event.get('inputs', ''))}  @ {clean(event.get('scope') or '-')}"
                + ("  raised" if event.get("error") is True else ""))
    if kind in ("step_begin", "step_end"):
        return f"step {clean(event.get('step'))}"
    if kind == "phase":
        took = event.get("end_t", 0) - event.get("begin_t", 0) if all(
            isinstance(event.get(k), int) for k in ("begin_t", "end_t")) else None
        return f"{clean(event.get('phase'))} {_num(took, 1e6, '.2f')} ms"
    if kind == "memory":
        return f"{clean(event.get('device'))}: {_num(event.get('used_bytes', 0), 2**20)} MiB used"
    if kind == "memory_peak":
        return (f"{clean(event.get('device'))}: peak {_num(event.get('peak_allocated_bytes', 0), 2**20)} MiB "
                f"allocated, {_num(event.get('peak_reserved_bytes', 0), 2**20)} MiB reserved in the step")
    if kind == "collective":
        return f"{clean(event.get('desc'))} #{clean(event.get('group_seq'))} {clean(event.get('state'))}"
    if kind == "print":
        values = event.get("values", [])
        return clean(" ".join(str(v) for v in values) if isinstance(values, list) else values)
    if kind == "fault":
        return clean(_fault_text(event.get("fault"), event.get("detail"), event.get("error")))
    rest = {k: v for k, v in event.items() if k not in ("seq", "t", "kind", "step")}
    return clean(", ".join(f"{k}={v}" for k, v in rest.items()))


def _fault_text(kind: Any, where: Any, error: Any) -> str:
    """``kind at where``, then what the fault said (an exception, what a check found), when it said anything."""
    return f"{kind} at {where}" + (f": {error}" if error else "")


def _kind(event: dict[str, Any]) -> str:
    kind = clean(event.get("kind"))
    return f"{kind} (raised)" if event.get("error") is True and kind in ("module_exit", "op") else kind


def _timeline(events: list[dict[str, Any]], title: str) -> Table:
    table = Table(title=Text(clean(title)), title_justify="left")  # a bundle name is never read as markup
    for column in ("seq", "t (ms)", "step", "kind", "what", "duration"):
        table.add_column(column, justify="right" if column in ("seq", "t (ms)", "step", "duration") else "left")
    end = events[-1]["t"] if events else 0
    for e in events:
        duration = e.get("duration_ns")
        style = "bold red" if e.get("error") is True or e.get("kind") == "fault" else ""
        table.add_row(str(e["seq"]), f"{(e['t'] - end) / 1e6:+.3f}", clean(e.get("step", "")),
                      Text(_kind(e), style=style), Text(_what(e), style=style),
                      f"{duration / 1e3:.1f} µs" if isinstance(duration, int) and duration else "")
    return table


def _where(where: Any) -> str:
    if not isinstance(where, dict):
        return clean(where)
    return clean(f"{where.get('file')}:{where.get('line')} in {where.get('function')}")


def _header(b: Bundle, faults: Selection) -> list[tuple[str, Text]]:
    """The summary rows of ``show``: (label, value), printed as plain lines (never wrapped: they hold paths).
    ``faults``: the bundle's fault events (the first few kept)."""
    m = b.manifest
    rows: list[tuple[str, Text]] = []
    reason = _reason(b.info.reason, b.info.recovered)
    rows.append(("reason", _plain(reason, "bold red" if b.info.reason != "normal_end" else "green")))
    rows.append(("when", Text(_when(b.info.created_ns))))
    rows.append(("where", _plain(f"host {m.get('host')}  pid {m.get('pid')}  rank {m.get('rank')}/"
                                 f"{m.get('world_size')}  run {m.get('run_id')}")))
    rows.append(("step reached", Text(str(b.info.step))))
    fault = m.get("fault")
    if fault:
        rows.append(("fault", _plain(f"{fault.get('kind')}: {fault.get('where')}"
                                     + (f": {fault['error']}" if fault.get("error") else ""))))
    only = faults.events[0] if faults.matched == 1 else None
    if faults.matched and not (fault and only and (only.get("fault"), only.get("detail")) ==
                               (fault.get("kind"), fault.get("where"))):  # not the fault of the row above again
        shown = "; ".join(_fault_text(e.get("fault"), e.get("detail"), e.get("error")) + f" (step {e.get('step')})"
                          for e in faults.events)
        more = faults.matched - len(faults.events)
        rows.append(("faults", _plain(f"{faults.matched} recorded: {shown}" + (f"; {more} more" if more else ""))))
    exc = m.get("exception")
    if exc:
        rows.append(("exception", _plain(f"{exc.get('type')}: {exc.get('message')}", "bold red")))
        if exc.get("where"):
            raised = Text(_where(exc["where"]))
            if exc.get("raised_in"):
                raised.append(f"  (in {_where(exc['raised_in'])})", style="dim")
            rows.append(("raised at", raised))
    device = b.device_fault
    if device:
        rows.append(("device fault", _plain(device.title + (f" in {device.module}" if device.module else "")
                                            + ("; reported after the kernel failed: not where it happened"
                                               if device.asynchronous and not device.launch_blocking else ""),
                                            "bold red")))
    if m.get("last_module"):
        rows.append(("last module", _plain(m["last_module"])))
    elif m.get("granularity") in ("module", "op") and b.info.step:
        rows.append(("last module", _plain(f"none in step {b.info.step}")))
    if m.get("open_modules"):
        rows.append(("inside modules", _plain(" > ".join(str(x) for x in m["open_modules"]))))
    op = m.get("last_op")
    if op:
        rows.append(("last op", _plain(f"{op.get('name')} {op.get('inputs', '')} @ {op.get('scope') or '-'}"
                                       + (" (raised)" if op.get("error") else ""))))
    dropped = {k: v for k, v in (m.get("dropped") or {}).items() if v}
    rows.append(("recorded", _plain(f"{(m.get('recorded') or {}).get('events', 0)} events at "
                                    f"{m.get('granularity')} granularity"
                                    + (f"; overwritten: {dropped}" if dropped else ""))))
    versions = m.get("versions") or {}
    rows.append(("versions", _plain("  ".join(f"{k} {v}" for k, v in versions.items()))))
    return rows


_OUR_CODE = tuple(f"{os.sep}{pkg}{os.sep}" for pkg in ("obs", "recorder", "watchdog"))


def _ours(thread: dict[str, Any]) -> bool:
    """obs's own threads: named ``obs-*`` (the config watcher, the hang watchdog), or running obs's code (the
    ``watchdog`` package's observer threads behind the config watcher).  The main thread never is."""
    if thread.get("main") is True:
        return False
    name = thread["thread"]
    if name.startswith("obs-") or "watchdog" in name:
        return True
    targets = [f["file"] for f in thread["frames"] if not f["file"].endswith(f"{os.sep}threading.py")]
    return bool(targets) and any(part in targets[0] for part in _OUR_CODE)


def _stacks(b: Bundle, frames: int, all_threads: bool) -> list[Text]:
    """The innermost ``frames`` frames of each thread, one line each (obs's own threads collapsed)."""
    lines = [Text("stacks of all threads at the dump (innermost last):", style="bold")]
    hidden = []
    for s in b.stacks:
        if _ours(s) and not all_threads:
            hidden.append(clean(s["thread"]))
            continue
        lines.append(Text.assemble("  ", (clean(s["thread"]), "bold"), " (main)" if s.get("main") else ""))
        # obs's own threads show their frames (--all-threads); the others never obs's or runpy's (bundles written
        # before obs left them out: by this installation's folders, and the wrappers' anywhere)
        shown = s["frames"] if _ours(s) else [f for f in s["frames"]
                                              if not is_hidden(f["file"]) and not is_wrapper(f["file"])]
        for f in shown[-frames:]:
            lines.append(Text(clean(f"    {f['file']}:{f.get('line')} in {f['function']}"
                                    + (f"  — {f['code']}" if f.get("code") else "")),
                              style="dim" if is_hidden(f["file"]) else ""))
        if not shown:
            lines.append(Text("    (no frame of your code)", style="dim"))
    if hidden:
        lines.append(Text(f"  {len(hidden)} thread(s) of obs itself hidden ({', '.join(hidden)}); --all-threads "
                          "shows them", style="dim"))
    return lines


def _how_many(picked: Selection) -> str:
    """``last N of M events`` when ``--last`` left events out, else ``M events``: M is always how many matched."""
    shown = len(picked.events)
    return f"last {shown} of {picked.matched} events" if picked.matched > shown else f"{picked.matched} events"


def _section(out: Any, title: str, text: str, style: str = "bold red") -> None:
    out.print(Text(f"── {title} ──", style=style), soft_wrap=True)
    out.print(_plain(text.rstrip()), soft_wrap=True)


def _positive(value: int | None, option: str) -> None:
    if value is not None and value < 1:
        raise ValueError(f"{option} must be a whole number >= 1 (got {value})")


def run_show(path: str, *, last: int, as_json: bool, all_threads: bool = False) -> int:
    _positive(last, "--last")
    b = load_bundle(path)
    events = b.events(last=last)
    if as_json:
        print_json({"bundle": b.info.path, "manifest": b.manifest, "exception": b.exception, "last_events": events,
                    "memory": b.events({"memory", "memory_peak"}, last=10), "stacks": b.stacks,
                    "fatal_stacks": b.fatal_stacks, "graphs": b.graphs,
                    "device_fault": asdict(b.device_fault) if b.device_fault else None,
                    "monitor": _monitor(b).as_dict() if b.monitor is not None else None})
        return EXIT_OK
    out = console()
    out.print(Text.assemble(("bundle: ", "bold"), clean(b.info.path)), soft_wrap=True)
    for label, value in _header(b, b.pick({"fault"}, first=3)):  # the first fault most often caused the rest
        out.print(Text.assemble((f"  {label:<15}", "bold"), value), soft_wrap=True)
    if b.exception:
        _section(out, "exception", b.exception.get("traceback", ""))
    if b.device_fault:
        _device_fault(out, b)
    if b.monitor is not None:  # the training-health monitor's explanation, as `obs monitor explain BUNDLE` gives it
        from obs.cli._monitor_view import print_explanation

        out.print(Text("── training health (obs monitor explain) ──", style="bold"))
        print_explanation(out, _monitor(b), limit=10)
        out.print("[dim]the monitor counts optimizer steps from 0, as msprobe does: its step N is the recorder's step "
                  "N+1 below[/]")
    out.print(_timeline(events, f"last {len(events)} events (t relative to the last one)"))
    memory = b.events({"memory"}, last=3)
    peaks = {e.get("step"): e for e in b.events({"memory_peak"}, last=3)}
    if memory:
        out.print(_plain("memory: " + "  |  ".join(f"step {e.get('step')}: {_num(e.get('used_bytes'), 2**20)} MiB"
                                                    + _peak(peaks.get(e.get("step"))) for e in memory)))
    if b.fatal_stacks:
        _section(out, "fatal signal (faulthandler)", b.fatal_stacks)
    if b.stacks:
        for line in _stacks(b, frames=8, all_threads=all_threads):
            out.print(line, soft_wrap=True)
    for graph in b.graphs:
        out.print(Text(f"graph: {clean(graph)}"), soft_wrap=True)
    return EXIT_OK


def _monitor(b: Bundle) -> Any:
    """The explanation of the bundle's monitor part (its recorded anomalies in causal order)."""
    from obs.features.monitor.bundle_run import run_of_part
    from obs.features.monitor.explain import explain

    assert b.monitor is not None
    return explain(run_of_part(b.monitor, b.info.path, b.info.rank))


def _peak(event: dict[str, Any] | None) -> str:
    return f" (peak {_num(event.get('peak_allocated_bytes'), 2**20)} MiB)" if event else ""


def _device_fault(out: Any, b: Bundle) -> None:
    """The CUDA fault's section: what it is, where it surfaced, the ops before it, what to do; an OOM's memory files."""
    fault = b.device_fault
    assert fault is not None
    _section(out, f"device fault: {fault.title}", explanation_text(asdict(fault)))
    if fault.memory_summary:
        out.print(Text(f"memory summary: {clean(os.path.join(b.info.path, 'memory_summary.txt'))}"), soft_wrap=True)
    if fault.memory_snapshot:
        out.print(Text(f"memory snapshot: {clean(fault.memory_snapshot)}"), soft_wrap=True)


def _kinds(items: list[str]) -> set[str] | None:
    wanted = {k.strip() for item in items for k in item.split(",") if k.strip()}
    unknown = sorted(wanted - set(EVENT_KINDS))
    if unknown:
        raise ValueError(f"unknown event kind{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
                         f"(expected one of: {', '.join(EVENT_KINDS)})")
    return wanted or None


def run_events(path: str, *, kinds: list[str], last: int | None, as_json: bool, step: int | None = None) -> int:
    wanted = _kinds(kinds)
    _positive(last, "--last")
    b = load_bundle(path)
    if as_json:  # streamed: a bundle of any size is printed in constant memory (unless --last keeps N)
        print_json_lines(b.select(wanted, step) if last is None else b.events(wanted, last=last, step=step))
        return EXIT_OK
    picked = b.pick(wanted, last=last, step=step)
    events = picked.events
    title = f"{b.info.name}: {_how_many(picked)}" + (f" of kind {', '.join(sorted(wanted))}" if wanted else "") \
        + (f" in step {step}" if step is not None else "")
    out = console()
    out.print(Text.assemble(("bundle: ", "bold"), clean(b.info.path)), soft_wrap=True)
    out.print(_timeline(events, title) if events else Text(clean(title)), soft_wrap=True)
    granularity = b.manifest.get("granularity")
    if not events and wanted and "op" in wanted and granularity != "op":
        out.print(Text(f"no op events: this run recorded at {clean(granularity)} granularity; op events need "
                       '"granularity": "op" in the rdr section of the env config'), soft_wrap=True)
    return EXIT_OK


def run_recover(path: str | None, *, as_json: bool) -> int:
    from recorder.recover import recover

    root = path or default_root()
    result = recover(root)
    status = EXIT_PROBLEM if result.problems else EXIT_OK
    if as_json:
        print_json({"recovered": result.made, "alive": result.alive, "problems": [str(e) for e in result.problems]})
        return status
    out = console()
    if not result.made and not result.problems:
        out.print(Text(f"nothing to recover under {clean(root)} (no ring of a dead process)"), soft_wrap=True)
    for bundle in result.made:
        out.print(Text.assemble("recovered ", (clean(bundle), "bold")), soft_wrap=True)
        out.print(Text(f"  see it with: obs rdr show {shlex.quote(clean(bundle))}"), soft_wrap=True)
    _say_problems(result.problems, "not recovered")
    return status
