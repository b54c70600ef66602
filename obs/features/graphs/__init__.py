"""Graph/IR dumps (``save_graphs``): MindSpore ``.ir`` text, verbose copies, Graphviz ``.dot``, and a reader.

- :func:`dump_graph` writes a ``torch.export`` program or an FX GraphModule now.
- :func:`read_ir` / :func:`parse_ir` read ``.ir`` files back into :class:`IrFile` dataclasses.
- The settings side (levels, folders, what is captured when) is :mod:`obs.features.graphs.feature`.

Importing this package does not import torch.
"""

from __future__ import annotations

from typing import Any

from obs.features.graphs.feature import feature
from obs.features.graphs.model import Abstract, Graph, IrFile, Node, Param
from obs.features.graphs.reader import parse_ir, read_ir

__all__ = ["Abstract", "Graph", "IrFile", "Node", "Param", "dump_graph", "feature", "parse_ir", "read_ir"]


def dump_graph(graph: Any, name: str = "graph") -> list[str]:
    """Write ``graph`` (a ``torch.export.ExportedProgram`` or ``torch.fx.GraphModule``) under ``save_graphs_path``.

    Files follow the ``save_graphs`` level in force (level 1 when it is 0: the call itself asks for the
    graph): ``{SSSS}_export_{name}.ir`` (``fx`` for a GraphModule), its verbose copy at 2, ``.dot`` at 3.
    Returns the paths written.
    """
    from obs.features.graphs.describe import describe_export

    doc, stage = describe_export(graph, name)
    written = feature.publish(doc, stage, name, level=max(feature.level, 1))
    return written.paths() if written is not None else []
