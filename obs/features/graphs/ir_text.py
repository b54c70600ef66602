"""Write an :class:`~obs.features.graphs.model.IrFile` as MindSpore ``.ir`` text (plain or verbose).  Pure.

The plain text keeps what a reader of MindSpore's files expects: types with shapes, the scope, and the
user's own source line.  The verbose text (``verbose_ir_files/``) adds every extra of a type
(strides, device, ...) and every source frame.
"""

from __future__ import annotations

import os
import sysconfig

from obs.features.graphs.model import Abstract, Graph, IrFile, Node, format_abstract

__all__ = ["PLAIN_EXTRAS", "ir_text", "user_frame"]

#: the extras a plain file keeps (the others are verbose-only)
PLAIN_EXTRAS = ("ref_key", "is_parameter", "value")
OBS_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep
_LIBRARY = tuple({OBS_DIR,
                  *(sysconfig.get_paths()[k] + os.sep for k in ("stdlib", "purelib", "platlib"))})


def user_frame(frames: list[str]) -> str | None:
    """The innermost frame outside obs, the standard library and installed packages (torch); else the innermost."""
    for frame in reversed(frames):
        path = frame.split(":", 1)[0]
        if not path.startswith(_LIBRARY) and not path.startswith("<"):
            return frame
    return frames[-1] if frames else None


def _abstract(a: Abstract, verbose: bool) -> str:
    if not verbose and a.extras:
        a = Abstract(a.kind, a.dtype, a.shape, tuple(x for x in a.extras if x.split("=", 1)[0] in PLAIN_EXTRAS),
                     tuple(_plain(e) for e in a.elements))
    elif not verbose and a.elements:
        a = Abstract(a.kind, a.dtype, a.shape, a.extras, tuple(_plain(e) for e in a.elements))
    return format_abstract(a)


def _plain(a: Abstract) -> Abstract:
    return Abstract(a.kind, a.dtype, a.shape, tuple(x for x in a.extras if x.split("=", 1)[0] in PLAIN_EXTRAS),
                    a.elements)


def _types(items: list[Abstract], verbose: bool, memo: dict[int, str]) -> str:
    parts = []
    for a in items:  # the same Abstract object is often an output and then several inputs: format it once
        text = memo.get(id(a))
        if text is None:
            text = memo[id(a)] = _abstract(a, verbose)
        parts.append(text)
    return "(" + ", ".join(parts) + ")"


def _frames(frames: list[str], verbose: bool) -> list[str]:
    if verbose:
        return frames
    one = user_frame(frames)
    return [one] if one else []


def _node(node: Node, verbose: bool, out: list[str], memo: dict[int, str]) -> None:
    line = f"  %{node.index}({node.name}) = {node.op}({', '.join(node.args)})"
    if node.attrs:
        line += " primitive_attrs: {" + ", ".join(f"{k}: {v}" for k, v in node.attrs.items()) + "}"
    out.append(line)
    out.append(f"      : {_types(node.inputs, verbose, memo)} -> {_types(node.outputs, verbose, memo)}")
    out.append(f"      # Fullname with scope: ({node.scope})")
    for frame in _frames(node.frames, verbose):
        out.append(f"      # In file {frame}")


def _graph(graph: Graph, verbose: bool, out: list[str]) -> None:
    out.append("subgraph attr:")
    for key, value in graph.attrs.items():
        out.append(f"{key}: {value}")
    out.append(f"subgraph instance: {graph.name} : 0x{id(graph):x}")
    if graph.params:
        out.append(f"# Parameters: {len(graph.params)}, "
                   f"({', '.join(_abstract(p.abstract, verbose) for p in graph.params)})")
    for frame in _frames(graph.frames, verbose):
        out.append(f"# In file {frame}")
    out.append(f"subgraph @{graph.name}({', '.join(p.ref for p in graph.params)}) {{")
    memo: dict[int, str] = {}
    for node in graph.nodes:
        _node(node, verbose, out, memo)
    out.append(f"  Return({', '.join(graph.returns)})")
    out.append(f"      : {_types(graph.return_types, verbose, memo)}")
    out.append(f"      # Fullname with scope: ({graph.return_scope})")
    out.append("}")


def ir_text(doc: IrFile, *, verbose: bool = False) -> str:
    """The ``.ir`` text of ``doc``: header, parameters, node counts, then one block per subgraph."""
    main = doc.main
    out = [f"# IR entry: @{doc.entry}", f"# Total subgraphs: {len(doc.graphs)}", ""]
    if doc.attrs:
        out.append("# Attrs:")
        out.extend(f"{key}: {value}" for key, value in doc.attrs.items())
        out.append("")
    out.append(f"# Total params: {len(main.params)}")
    if main.params:
        out.append("# Params:")
        for p in main.params:
            out.append(f"{p.ref}: {_abstract(p.abstract, verbose)}" + ("  :  has_default" if p.has_default else ""))
    out.append("")
    cnodes = sum(len(g.nodes) + 1 for g in doc.graphs)
    out += ["Node counting information:", f"Total number of nodes: {cnodes + sum(len(g.params) for g in doc.graphs)}",
            f"Total number of cnodes: {cnodes}", ""]
    for graph in doc.graphs:
        _graph(graph, verbose, out)
        out.append("")
    return "\n".join(out)
