"""A graph save_graphs wrote as PyTorch's code (``.py``), read back for ``obs graph show``.

Where a compile's record holds only text (Inductor's generated code, AOT autograd's graphs from its cache), the
graph is written as PyTorch printed it (:mod:`obs.features.graphs.compiles`).  Pure: text in, a
:class:`GraphCode` out, with the ops it calls counted for an FX graph's code; the index beside the file, when
there is one, gives the graph's name, stage, compile and step.  A file that is neither is
:class:`NotOurFileError`.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from obs._core.errors import NotOurFileError
from obs._core.json_files import read_json
from obs.features.graphs.folder import INDEX, INDEX_LIMIT
from obs.features.graphs.reader import read_graph_file

__all__ = ["FX_GRAPH", "INDUCTOR_CODE", "GraphCode", "fx_ops", "parse_code", "read_code"]

FX_GRAPH = "FX graph"  #: PyTorch's code of an FX graph (``print_readable``)
INDUCTOR_CODE = "Inductor code"  #: the Python module Inductor generated for a graph
#: one FX node calling something: ``addmm: "f32[8, 3]" = torch.ops.aten.addmm.default(...)``, ``relu = y.relu()``
_CALL = re.compile(r'^\s+\w+(?:: "[^"]*")? = (?P<target>[A-Za-z_][\w.]*)\(', re.MULTILINE)
#: how ``print_readable`` starts an FX graph's code: its class, and at once its forward (no ``__init__``)
_FX_START = re.compile(r"class [\w<>]+\(torch\.nn\.Module\):\n\s*def forward\(\s*self\b")


@dataclass
class GraphCode:
    """One ``.py`` graph file: what it is, the ops an FX graph calls (most first), its text, its index entry."""

    path: str
    kind: str  #: FX_GRAPH or INDUCTOR_CODE
    nodes: int | None  #: an FX graph's calls; None for Inductor's code
    ops: list[tuple[str, int]]
    text: str
    entry: dict[str, Any] = field(default_factory=dict)  #: graph, stage, compile, step, source (from index.json)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _op(target: str) -> str:
    """``torch.ops.aten.addmm.default`` -> ``aten.addmm``; ``torch._C._nn.linear``, ``y.relu`` -> the last name."""
    if target.startswith("torch.ops."):
        parts = target.split(".")[2:]
        return ".".join(parts[:-1] if len(parts) > 2 else parts)
    return target.rsplit(".", 1)[-1]


def fx_ops(text: str) -> Counter[str]:
    """The ops an FX graph's code calls, counted (a node per call)."""
    return Counter(_op(m.group("target")) for m in _CALL.finditer(text))


def parse_code(text: str, path: str = "<code>", entry: dict[str, Any] | None = None) -> GraphCode:
    """The :class:`GraphCode` of a graph's code text; NotOurFileError when it is no graph PyTorch printed."""
    if text.startswith("# AOT ID:"):
        return GraphCode(path, INDUCTOR_CODE, None, [], text, dict(entry or {}))
    if not _FX_START.match(text):
        raise NotOurFileError(f"{path}: not a graph's code (expected PyTorch's code of an FX graph, 'class "
                              "GraphModule(torch.nn.Module):', or Inductor's, '# AOT ID:') nor an IR text file",
                              path=path)
    ops = fx_ops(text)
    return GraphCode(path, FX_GRAPH, sum(ops.values()), ops.most_common(), text, dict(entry or {}))


def _entry(path: str) -> dict[str, Any]:
    """The index entry of ``path`` in the ``index.json`` beside it ({} where there is none or it is unreadable)."""
    folder, name = os.path.split(os.path.abspath(path))
    try:
        data = read_json(os.path.join(folder, INDEX), what="a graph index", limit=INDEX_LIMIT, owned=False)
        found = next((e for e in data["graphs"] if isinstance(e, dict) and e.get("files", {}).get("code") == name), {})
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}
    keys = ("graph", "stage", "compile", "step", "source")
    return {k: found[k] for k in keys if found.get(k) not in (None, "")}


def read_code(path: str) -> GraphCode:
    """Read and parse ``path`` (opened without following a symlink; see :func:`parse_code` for errors)."""
    try:
        text = read_graph_file(path).decode("utf-8")
    except UnicodeDecodeError:
        raise NotOurFileError(f"{path}: not a graph's code (not UTF-8 text)", path=path) from None
    return parse_code(text, path, _entry(path))
