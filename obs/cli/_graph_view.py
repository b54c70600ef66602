"""``obs graph``: list dumped graphs, summarize one, diff two, render a ``.dot`` with Graphviz.

Exit codes (docs/cli.md): ``ls`` 1 when a file or index could not be read (the others are listed);
``show`` 1 on a damaged file; ``diff`` 1 when the graphs differ (as diff(1)), 0 when they match;
``render`` 1 when Graphviz's ``dot`` is missing or fails; 2 on bad input everywhere.
"""

from __future__ import annotations

import os
from typing import Any

from rich.table import Table
from rich.tree import Tree

from obs._core import env
from obs._core.errors import NotOurFileError
from obs.cli._exit import EXIT_FAILURE, EXIT_OK, EXIT_USAGE
from obs.cli._render import (
    console,
    error,
    markup_text,
    print_json,
    say_written,
    warning,
)
from obs.features.graphs.code_text import FX_GRAPH, GraphCode, read_code
from obs.features.graphs.reader import read_ir
from obs.features.graphs.summary import diff_graphs, list_graphs, summarize

__all__ = ["run_diff", "run_ls", "run_render", "run_show"]


def _default_folder() -> str:
    return env.text(env.MS_DEV_SAVE_GRAPHS_PATH, ".")


def run_ls(path: str | None, *, as_json: bool) -> int:
    listing = list_graphs(path or _default_folder())
    if as_json:
        print_json(listing.as_dict())
    else:
        out = console()
        if not listing.graphs:
            out.print(f"no graph files in {markup_text(listing.folder)}")
        else:
            table = Table(title=f"graphs in {markup_text(listing.folder)}", title_justify="left")
            for column in ("#", "graph", "stage", "nodes", "step", "file"):
                table.add_column(column, justify="right" if column in ("#", "nodes", "step") else "left",
                                 overflow="fold" if column == "file" else "ellipsis")
            for g in sorted(listing.graphs, key=lambda g: (g.file.count(os.sep), g.number if g.number is not None
                                                           else 1 << 40, g.file)):
                table.add_row("" if g.number is None else f"{g.number:04d}", markup_text(g.graph),
                              markup_text(g.stage), "" if g.nodes is None else str(g.nodes),
                              "" if g.step is None else str(g.step), markup_text(g.file))
            out.print(table)
        _compile_tables(out, listing)
    for problem in listing.problems:
        warning(problem)
    return EXIT_FAILURE if listing.problems else EXIT_OK


def _compile_tables(out: Any, listing: Any) -> None:
    """Graph breaks and recompiles, as PyTorch reported them (index.json's ``breaks`` and ``recompiles``)."""
    if listing.breaks:
        table = Table(title=f"{len(listing.breaks)} graph break(s)", title_justify="left")
        for column in ("compile", "function", "at", "reason"):
            table.add_column(column, overflow="fold")
        for b in listing.breaks:
            reason = b.get("explanation") or b.get("reason") or ""
            table.add_row(markup_text(str(b.get("compile", ""))), markup_text(str(b.get("function", ""))),
                          markup_text(str(b.get("source", ""))), markup_text(str(reason)))
        out.print(table)
    if listing.recompiles:
        table = Table(title=f"{len(listing.recompiles)} recompile(s)", title_justify="left")
        for column in ("compile", "function", "guard that failed"):
            table.add_column(column, overflow="fold")
        for r in listing.recompiles:
            table.add_row(markup_text(str(r.get("compile", ""))), markup_text(str(r.get("function", ""))),
                          markup_text("; ".join(str(x) for x in r.get("reasons", ()))))
        out.print(table)


def _scope_tree(scopes: dict[str, int], title: str, max_depth: int = 6) -> Tree:
    tree = Tree(title)
    nodes: dict[tuple[str, ...], Tree] = {(): tree}
    totals: dict[tuple[str, ...], int] = {}
    for scope, count in scopes.items():
        parts = tuple(scope.split("/"))[:max_depth]
        for depth in range(1, len(parts) + 1):
            totals[parts[:depth]] = totals.get(parts[:depth], 0) + count
    for key in sorted(totals):
        parent = nodes[key[:-1]]
        nodes[key] = parent.add(f"{markup_text(key[-1])} [dim]({totals[key]} ops)[/]")
    return tree


def _bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def run_show(path: str, *, as_json: bool, top: int = 10) -> int:
    try:
        ir = read_ir(path)
    except NotOurFileError:
        if path.endswith(".ir"):
            raise
        return _show_code(read_code(path), as_json=as_json, top=top)  # a graph PyTorch logged only as code
    summary = summarize(ir, top=top)
    if as_json:
        print_json(summary.as_dict())
        return EXIT_OK
    out = console()
    attrs = ", ".join(f"{k}={v}" for k, v in summary.attrs.items())
    out.print(f"[bold]@{markup_text(summary.entry)}[/]  {markup_text(attrs)}")
    out.print(f"{summary.nodes} nodes in {summary.subgraphs} subgraph(s); {len(summary.params)} params, weights "
              f"{_bytes(summary.param_bytes)}")
    out.print(_ops_table(summary.ops, top))
    params = Table(title="params", title_justify="left")
    for column in ("name", "type", "size", "weight"):
        params.add_column(column, justify="right" if column == "size" else "left")
    for p in summary.params:
        params.add_row(markup_text(p["name"]), markup_text(p["type"]), _bytes(p["bytes"]), "yes" if p["weight"] else "")
    out.print(params)
    largest = Table(title=f"largest tensors (top {top})", title_justify="left")
    for column in ("node", "op", "type", "size", "scope"):
        largest.add_column(column, justify="right" if column == "size" else "left")
    for t in summary.largest:
        largest.add_row(markup_text(t["node"]), markup_text(t["op"]), markup_text(t["type"]), _bytes(t["bytes"]),
                        markup_text(t["scope"]))
    out.print(largest)
    out.print(_scope_tree(summary.scopes, "scopes"))
    return EXIT_OK


def _ops_table(counts: list[tuple[str, int]], top: int) -> Table:
    """Nodes by op, the most common first: ``2 * top`` rows, then how many more."""
    ops = Table(title="nodes by op", title_justify="left")
    ops.add_column("op")
    ops.add_column("count", justify="right")
    for op, count in counts[:top * 2]:
        ops.add_row(markup_text(op), str(count))
    if len(counts) > top * 2:
        ops.add_row(f"[dim]... {len(counts) - top * 2} more ops[/]", "")
    return ops


def _show_code(code: GraphCode, *, as_json: bool, top: int) -> int:
    if as_json:
        print_json(code.as_dict())
        return EXIT_OK
    out = console()
    attrs = ", ".join(f"{k}={v}" for k, v in code.entry.items() if k != "graph")
    out.print(f"[bold]@{markup_text(str(code.entry.get('graph') or os.path.basename(code.path)))}[/]  "
              f"{markup_text(attrs)}", soft_wrap=True)
    if code.kind == FX_GRAPH:
        out.print(f"{code.nodes} nodes; PyTorch's code of the graph (no .ir: the compile logged only this text)")
        out.print(_ops_table(code.ops, top))
    else:
        out.print("the code Inductor generated for the graph")
    out.print(code.text.rstrip("\n"), markup=False, highlight=False, soft_wrap=True)
    return EXIT_OK


def run_diff(a: str, b: str, *, as_json: bool) -> int:
    result = diff_graphs(read_ir(a), read_ir(b))
    if as_json:
        print_json(result.as_dict())
        return EXIT_OK if result.same else EXIT_FAILURE
    out = console()
    if result.same:
        out.print(f"same graph: {result.nodes[0]} nodes, same inputs and ops")
        return EXIT_OK
    out.print(f"nodes: {result.nodes[0]} -> {result.nodes[1]}")
    if result.inputs_added or result.inputs_removed or result.inputs_changed:
        table = Table(title="inputs", title_justify="left")
        for column in ("input", "in A", "in B"):
            table.add_column(column)
        for name in result.inputs_removed:
            table.add_row(markup_text(name), "present", "[red]removed[/]")
        for name in result.inputs_added:
            table.add_row(markup_text(name), "[green]added[/]", "present")
        for name, ta, tb in result.inputs_changed:
            table.add_row(markup_text(name), markup_text(ta), markup_text(tb))
        out.print(table)
    if result.ops_changed:
        table = Table(title="op counts", title_justify="left")
        for column in ("op", "A", "B"):
            table.add_column(column, justify="left" if column == "op" else "right")
        for op, ca, cb in result.ops_changed:
            table.add_row(markup_text(op), str(ca), str(cb))
        out.print(table)
    for line in result.lines:
        style = "green" if line.startswith("+") else "red" if line.startswith("-") else "cyan" \
            if line.startswith("@@") else ""
        text = markup_text(line, newlines=False)
        out.print(f"[{style}]{text}[/]" if style else text)
    return EXIT_FAILURE


def run_render(path: str, *, output: str | None, fmt: str) -> int:
    from obs._core import safe_files
    from obs.features.graphs import graphviz
    from obs.features.graphs.dot import dot_text

    if path.endswith(".ir"):
        dot = dot_text(read_ir(path))
    else:
        data = safe_files.read_private(path, owned=False)
        if not data.lstrip().startswith((b"digraph", b"graph", b"strict")):
            from obs._core.errors import NotOurFileError

            raise NotOurFileError(f"{path}: not a Graphviz file (expected 'digraph' at the start) nor an .ir file",
                                  path=path)
        dot = data.decode("utf-8", "replace")
    target = output or os.path.splitext(path)[0] + f".{fmt}"
    if os.path.abspath(target) == os.path.abspath(path):
        error(f"the output {target!r} would replace the input; choose another with -o")
        return EXIT_USAGE
    try:
        rendered = graphviz.render(dot, fmt=fmt, timeout_s=300)
    except graphviz.GraphvizError as exc:
        error(f"{exc}; nothing was rendered from {path}"
              + (" (or open the .dot file in any Graphviz viewer)" if exc.missing else ""))
        return EXIT_FAILURE
    safe_files.write_atomic(target, rendered)
    say_written(f"{fmt.upper()} rendering", target)
    return EXIT_OK
