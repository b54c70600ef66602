"""``obs rdr ls | show | events | recover``: post-mortem views of RDR bundles (rendering only)."""

from __future__ import annotations

import os
import time
from dataclasses import asdict
from typing import Any

from rich.panel import Panel
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from obs.cli._render import console, print_json
from recorder.bundle_reader import Bundle, list_bundles, load_bundle

__all__ = ["run_events", "run_ls", "run_recover", "run_show"]


def _when(ns: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ns / 1e9)) + f".{ns // 1_000_000 % 1000:03d}"


def default_root() -> str:
    return os.environ.get("MS_RDR_PATH") or os.getcwd()


def run_ls(path: str | None, *, as_json: bool) -> int:
    root = path or default_root()
    listing = list_bundles(root)
    if as_json:
        print_json({"root": root, "bundles": [{**asdict(b), "name": b.name} for b in listing.bundles],
                    "rings_to_recover": [r.path for r in listing.rings], "incomplete": listing.incomplete})
        return 0
    out = console()
    if not listing.bundles:
        out.print(f"no RDR bundles under {root}")
    else:
        table = Table(title=f"RDR bundles under {root}, newest first", title_justify="left")
        table.add_column("bundle (UTC stamp_pid_reason)", overflow="fold")
        for column in ("rank", "reason", "step"):
            table.add_column(column, no_wrap=True)
        for b in listing.bundles:
            reason = Text(b.reason + (" (recovered)" if b.recovered else ""),
                          style="green" if b.reason == "normal_end" else "bold red")
            table.add_row(os.path.relpath(b.path, root), str(b.rank), reason, str(b.step))
        out.print(table)
    for ring in listing.rings:
        out.print(f"[yellow]ring of pid {ring.pid} was never dumped (process killed?):[/] {ring.path}\n"
                  f"  turn it into a bundle with: obs rdr recover {os.path.dirname(ring.path)}", highlight=False)
    for folder in listing.incomplete:
        out.print(f"[dim]interrupted dump (ignored): {folder}[/]", highlight=False)
    return 0


def _what(event: dict[str, Any]) -> str:
    kind = event.get("kind")
    if kind in ("module_enter", "module_exit"):
        return str(event.get("scope"))
    if kind == "op":
        return f"{event.get('name')}  {event.get('inputs', '')}  @ {event.get('scope') or '-'}"
    if kind in ("step_begin", "step_end"):
        return f"step {event.get('step')}"
    if kind == "memory":
        return f"{event.get('device')}: {event.get('used_bytes', 0) / 2**20:.1f} MiB used"
    if kind == "collective":
        return f"{event.get('desc')} #{event.get('group_seq')} {event.get('state')}"
    if kind == "print":
        return " ".join(str(v) for v in event.get("values", []))
    if kind == "fault":
        return f"{event.get('fault')} at {event.get('detail')}: {event.get('error', '')}"
    rest = {k: v for k, v in event.items() if k not in ("seq", "t", "kind")}
    return ", ".join(f"{k}={v}" for k, v in rest.items())


def _timeline(events: list[dict[str, Any]], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for column in ("seq", "t (ms)", "kind", "what", "duration"):
        table.add_column(column, justify="right" if column in ("seq", "t (ms)", "duration") else "left")
    end = events[-1]["t"] if events else 0
    for e in events:
        duration = e.get("duration_ns")
        style = "bold red" if e.get("error") or e.get("kind") == "fault" else ""
        table.add_row(str(e.get("seq")), f"{(e['t'] - end) / 1e6:+.3f}", str(e.get("kind")), Text(_what(e), style=style),
                      f"{duration / 1e3:.1f} µs" if isinstance(duration, int) and duration else "")
    return table


def _header(b: Bundle) -> Panel:
    m = b.manifest
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    grid.add_row("reason", Text(m.get("reason", "?"), style="bold red" if m.get("reason") != "normal_end" else "green"))
    grid.add_row("when", _when(int(m.get("created_ns", 0))))
    grid.add_row("where", f"host {m.get('host')}  pid {m.get('pid')}  rank {m.get('rank')}/{m.get('world_size')}  "
                          f"run {m.get('run_id')}")
    grid.add_row("step reached", str(m.get("step")))
    if m.get("fault"):
        grid.add_row("fault", f"{m['fault'].get('kind')}: {m['fault'].get('where')}")
    if m.get("exception"):
        e = m["exception"]
        where = e.get("where") or {}
        grid.add_row("exception", Text(f"{e['type']}: {e['message']}", style="bold red"))
        if where:
            grid.add_row("raised at", f"{where.get('file')}:{where.get('line')} in {where.get('function')}")
    if m.get("last_module"):
        grid.add_row("last module", str(m["last_module"]))
    if m.get("open_modules"):
        grid.add_row("inside modules", " > ".join(m["open_modules"]))
    if m.get("last_op"):
        op = m["last_op"]
        grid.add_row("last op", f"{op['name']} {op.get('inputs', '')} @ {op.get('scope') or '-'}"
                                + (" (raised)" if op.get("error") else ""))
    dropped = {k: v for k, v in (m.get("dropped") or {}).items() if v}
    grid.add_row("recorded", f"{m.get('recorded', {}).get('events', 0)} events at {m.get('granularity')} granularity"
                             + (f"; overwritten: {dropped}" if dropped else ""))
    versions = m.get("versions") or {}
    grid.add_row("versions", "  ".join(f"{k} {v}" for k, v in versions.items()))
    return Panel(grid, title=os.path.basename(b.info.path), title_align="left", expand=False)


def _stacks(b: Bundle, frames: int) -> Tree:
    tree = Tree("stacks of all threads at the dump")
    for s in b.stacks:
        node = tree.add(f"[bold]{s['thread']}[/]" + (" (main)" if s.get("main") else ""))
        for f in s["frames"][-frames:]:
            node.add(Text(f"{f['file']}:{f['line']} in {f['function']}" + (f"  — {f['code']}" if f.get("code") else ""),
                          style="dim" if "/obs/" in f["file"] or "/recorder/" in f["file"] else ""))
    return tree


def run_show(path: str, *, last: int, as_json: bool) -> int:
    b = load_bundle(path)
    events = b.events(last=last)
    if as_json:
        print_json({"bundle": b.info.path, "manifest": b.manifest, "exception": b.exception, "last_events": events,
                    "memory": b.events({"memory"}, last=5), "stacks": b.stacks, "fatal_stacks": b.fatal_stacks,
                    "graphs": b.graphs})
        return 0
    out = console()
    out.print(_header(b))
    if b.exception:
        out.print(Panel(Text(b.exception["traceback"].rstrip()), title="exception", title_align="left",
                        border_style="red"))
    out.print(_timeline(events, f"last {len(events)} events (t relative to the last one)"))
    memory = b.events({"memory"}, last=3)
    if memory:
        out.print("memory: " + "  |  ".join(f"step {e['step']}: {e['used_bytes'] / 2**20:.1f} MiB" for e in memory))
    if b.fatal_stacks:
        out.print(Panel(Text(b.fatal_stacks.rstrip()), title="fatal signal (faulthandler)", title_align="left",
                        border_style="red"))
    if b.stacks:
        out.print(_stacks(b, frames=8))
    for graph in b.graphs:
        out.print(f"graph: {graph}")
    return 0


def run_events(path: str, *, kinds: list[str], last: int | None, as_json: bool) -> int:
    b = load_bundle(path)
    wanted = {k.strip() for item in kinds for k in item.split(",") if k.strip()} or None
    events = b.events(wanted, last=last)
    if as_json:
        print_json(events)
        return 0
    console().print(_timeline(events, f"{b.info.name}: {len(events)} events"
                                      + (f" of kind {', '.join(sorted(wanted))}" if wanted else "")))
    return 0


def run_recover(path: str, *, as_json: bool) -> int:
    from recorder.recover import recover_rings

    made = recover_rings(path)
    if as_json:
        print_json({"recovered": made})
        return 0
    out = console()
    if not made:
        out.print(f"nothing to recover under {path} (no ring of a dead process)")
    for bundle in made:
        out.print(f"recovered [bold]{bundle}[/]\n  see it with: obs rdr show {bundle}", highlight=False)
    return 0
