"""An :class:`~obs.features.graphs.model.IrFile` as Graphviz DOT, in MindSpore's layout.  Pure.

``digraph mindspore {`` with ``compound=true``, one ``subgraph cluster_0x…`` per graph (``label``,
``fontname="Courier New"``), parameters as octagons, nodes as HTML tables whose ``core`` port holds
the op (``cornsilk`` cell), edges from each argument to its user, and the ``Return`` node.
"""

from __future__ import annotations

import re

from obs.features.graphs.model import Graph, IrFile, format_abstract

__all__ = ["dot_text"]

_REF = re.compile(r"%(?:para(\d+)_[^\s,()\[\]{}]+|(\d+))")


def _html(text: str) -> str:
    return (text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")
            .replace("\n", " "))


def _quoted(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ") + '"'


def _sources(args: list[str]) -> list[tuple[str, int]]:
    """(kind, number) of every ``%n`` / ``%paraN_x`` an argument list refers to, in order."""
    out = []
    for arg in args:
        for m in _REF.finditer(arg):
            out.append(("para", int(m.group(1))) if m.group(1) else ("node", int(m.group(2))))
    return out


def _graph(graph: Graph, k: int, out: list[str]) -> None:
    cluster = f"cluster_0x{k:x}"
    out.append(f"subgraph {cluster}{{")
    out.append(f"id={cluster}")
    out.append(f"label={_quoted(graph.name)}")
    out.append('fontname="Courier New"')
    prefix = f"g{k}_"
    for p in graph.params:
        out.append(f"{prefix}para{p.index}[shape=octagon, label={_quoted(p.name)}, style=filled, "
                   'fillcolor="paleturquoise"]')
    for node in graph.nodes:
        types = ", ".join(format_abstract(a) for a in node.outputs)
        label = ("<<table border='0' cellborder='1' cellspacing='0' cellpadding='2' port='core'>"
                 f"<tr><td bgcolor='cornsilk'>{_html(node.op)}</td></tr>"
                 f"<tr><td>%{node.index}({_html(node.name)})</td></tr>"
                 f"<tr><td><font point-size='9'>{_html(types)}</font></td></tr>"
                 f"<tr><td><font point-size='8'>{_html(node.scope)}</font></td></tr></table>>")
        out.append(f"{prefix}node{node.index}[shape=plaintext, label={label}]")
        for kind, number in _sources(node.args):
            out.append(f"{prefix}{kind}{number} -> {prefix}node{node.index}:core")
    out.append(f"{prefix}return[shape=box, label={_quoted('Return')}]")
    for kind, number in _sources(graph.returns):
        out.append(f"{prefix}{kind}{number} -> {prefix}return")
    out.append("}")


def dot_text(doc: IrFile) -> str:
    """The DOT text of every graph of ``doc`` (render with ``dot -Tsvg`` or ``obs graph render``)."""
    out = ["digraph mindspore {", "compound=true", 'fontname="Courier New"']
    for k, graph in enumerate(doc.graphs):
        _graph(graph, k, out)
    out.append("}")
    return "\n".join(out) + "\n"
