"""What ``obs graph`` shows, computed from files: folder listings, one graph's summary, two graphs' differences.

Pure functions of :class:`~obs.features.graphs.model.IrFile` (and, for listings, of a folder's ``index.json``
and ``.ir`` files) returning dataclasses; the CLI renders them.
"""

from __future__ import annotations

import difflib
import glob
import os
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from obs._core import rank_folders
from obs._core.errors import DamagedFileError, NotOurFileError, UnsafePathError
from obs._core.json_files import read_json
from obs.features.graphs.folder import INDEX, INDEX_LIMIT
from obs.features.graphs.model import Abstract, IrFile, format_abstract
from obs.features.graphs.reader import read_ir

__all__ = ["GraphDiff", "Listed", "Listing", "Summary", "diff_graphs", "list_graphs", "summarize"]

_NUMBER = re.compile(r"^(\d{4,})_")
_OP_SUFFIX = re.compile(r"-op\d+$")


@dataclass
class Listed:
    """One graph file of a folder."""

    number: int | None
    graph: str
    stage: str
    nodes: int | None
    step: int | None
    file: str
    files: dict[str, str] = field(default_factory=dict)


@dataclass
class Listing:
    """A folder's graphs, and what its index says of each compile: ``compiles``, ``breaks`` (graph breaks:
    compile, function, source, reason, explanation) and ``recompiles`` (compile, function, reasons)."""

    folder: str
    graphs: list[Listed]
    problems: list[str] = field(default_factory=list)
    compiles: list[dict[str, Any]] = field(default_factory=list)
    breaks: list[dict[str, Any]] = field(default_factory=list)
    recompiles: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _folders(path: str) -> list[str]:
    """``path`` and its ``rank_*`` folders (graphs of a distributed job)."""
    ranks = sorted(glob.glob(os.path.join(glob.escape(path), rank_folders.GLOB)))
    return [path] + [r for r in ranks if os.path.isdir(r) and not os.path.islink(r)]


def list_graphs(path: str) -> Listing:
    """The graphs under ``path`` (and its ``rank_*`` folders), by ``index.json`` where there is one, else by
    reading each ``.ir`` file's header.  Unreadable files and indexes are named in ``problems``."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no such graph folder: {path!r}")
    out = Listing(os.path.abspath(path), [])
    for folder in _folders(path):
        prefix = os.path.relpath(folder, path)
        prefix = "" if prefix == "." else prefix + os.sep
        indexed = _from_index(folder, prefix, out)
        seen = {g.file for g in indexed}
        out.graphs.extend(indexed)
        for file in sorted(glob.glob(os.path.join(glob.escape(folder), "*.ir"))):
            rel = prefix + os.path.basename(file)
            if rel in seen:
                continue
            try:
                ir = read_ir(file)
            except (DamagedFileError, NotOurFileError, UnsafePathError, OSError) as exc:
                out.problems.append(str(exc))
                continue
            m = _NUMBER.match(os.path.basename(file))
            step = ir.attrs.get("step", "")
            out.graphs.append(Listed(int(m.group(1)) if m else None, ir.entry, ir.attrs.get("stage", ""),
                                     sum(len(g.nodes) for g in ir.graphs), int(step) if step.isdigit() else None,
                                     rel, {"ir": rel}))
    return out


def _from_index(folder: str, prefix: str, listing: Listing) -> list[Listed]:
    path = os.path.join(folder, INDEX)
    if not os.path.lexists(path):
        return []
    try:
        data = read_json(path, what="a graph index", limit=INDEX_LIMIT, owned=False)
        entries = data["graphs"]
        out = []
        for e in entries:
            files = {k: prefix + str(v) for k, v in e["files"].items()}
            out.append(Listed(int(e["number"]), str(e["graph"]), str(e["stage"]), e.get("nodes"), e.get("step"),
                              files.get("ir") or files["code"], files))
        for section in ("compiles", "breaks", "recompiles"):
            found = data.get(section, [])
            if not isinstance(found, list) or not all(isinstance(x, dict) for x in found):
                raise TypeError(f"{section!r} is not a list of objects")
            getattr(listing, section).extend({**x, "folder": prefix} if prefix else x for x in found)
        return out
    except (OSError, ValueError, KeyError, TypeError) as exc:
        listing.problems.append(f"{path}: unreadable index ({type(exc).__name__}: {exc}); its graphs are listed "
                                "from their files")
        return []


@dataclass
class Summary:
    """One graph file: counts, ops, parameters, largest tensors and the scope tree (scope -> ops under it)."""

    path: str
    entry: str
    stage: str
    attrs: dict[str, str]
    subgraphs: int
    nodes: int
    ops: list[tuple[str, int]]
    params: list[dict[str, Any]]
    param_bytes: int
    largest: list[dict[str, Any]]
    scopes: dict[str, int]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _size(a: Abstract) -> int:
    return a.nbytes() or 0


def summarize(ir: IrFile, *, top: int = 10) -> Summary:
    """The summary ``obs graph show`` prints."""
    ops: Counter[str] = Counter()
    scopes: Counter[str] = Counter()
    tensors = []
    params = []
    for graph in ir.graphs:
        for p in graph.params:
            params.append({"name": p.name, "type": format_abstract(Abstract(p.abstract.kind, p.abstract.dtype,
                                                                              p.abstract.shape)),
                           "bytes": _size(p.abstract), "weight": p.has_default})
        for node in graph.nodes:
            ops[node.op] += 1
            scope = node.scope.rsplit("/", 1)[0] if "/" in node.scope else node.scope
            scopes[scope] += 1
            for out in node.outputs:
                items = out.elements if out.kind == "Tuple" else (out,)
                for a in items:
                    if a.is_tensor:
                        tensors.append({"node": f"%{node.index}({node.name})", "op": node.op,
                                        "type": format_abstract(Abstract(a.kind, a.dtype, a.shape)),
                                        "bytes": _size(a), "scope": node.scope})
    tensors.sort(key=lambda t: -t["bytes"])
    return Summary(ir.path, ir.entry, ir.attrs.get("stage", ""), dict(ir.attrs), len(ir.graphs),
                   sum(len(g.nodes) for g in ir.graphs), ops.most_common(), params,
                   sum(p["bytes"] for p in params if p["weight"]), tensors[:top], dict(sorted(scopes.items())))


@dataclass
class GraphDiff:
    """What changed from graph ``a`` to graph ``b``: inputs, op counts, and the node lines that differ."""

    a: str
    b: str
    inputs_added: list[str]
    inputs_removed: list[str]
    inputs_changed: list[tuple[str, str, str]]  # name, type in a, type in b
    ops_changed: list[tuple[str, int, int]]  # op, count in a, count in b
    nodes: tuple[int, int]
    lines: list[str]  # a unified diff of the nodes (op, output types, scope)

    @property
    def same(self) -> bool:
        return not (self.inputs_added or self.inputs_removed or self.inputs_changed or self.ops_changed
                    or self.lines)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "same": self.same}


def _node_lines(ir: IrFile) -> list[str]:
    out = []
    for graph in ir.graphs:
        for node in graph.nodes:
            types = ", ".join(format_abstract(Abstract(a.kind, a.dtype, a.shape, elements=a.elements))
                              for a in node.outputs)
            out.append(f"{node.op} -> ({types})  {_OP_SUFFIX.sub('', node.scope)}")
    return out


def diff_graphs(a: IrFile, b: IrFile, *, context: int = 2, limit: int = 400) -> GraphDiff:
    """Differences between two graphs, as a recompilation shows them (shapes, dtypes, ops, structure)."""
    pa = {p.name: format_abstract(Abstract(p.abstract.kind, p.abstract.dtype, p.abstract.shape))
          for g in a.graphs[:1] for p in g.params}
    pb = {p.name: format_abstract(Abstract(p.abstract.kind, p.abstract.dtype, p.abstract.shape))
          for g in b.graphs[:1] for p in g.params}
    ca = Counter(n.op for g in a.graphs for n in g.nodes)
    cb = Counter(n.op for g in b.graphs for n in g.nodes)
    lines = list(difflib.unified_diff(_node_lines(a), _node_lines(b), a.path or "a", b.path or "b", n=context,
                                      lineterm=""))
    return GraphDiff(a.path, b.path, sorted(set(pb) - set(pa)), sorted(set(pa) - set(pb)),
                     [(k, pa[k], pb[k]) for k in pa if k in pb and pa[k] != pb[k]],
                     [(op, ca[op], cb[op]) for op in sorted(set(ca) | set(cb)) if ca[op] != cb[op]],
                     (sum(ca.values()), sum(cb.values())), lines[:limit])
