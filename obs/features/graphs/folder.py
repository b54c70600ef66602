"""Where graph files go and how they are named: one process-wide 4-digit counter, ``index.json``.

``{save_graphs_path}[/rank_{r}]/{SSSS}_{stage}_{name}.ir`` (+ ``verbose_ir_files/`` at level 2, a
``.dot`` taking the next number and an ``.svg`` beside it at level 3).  Every file is written through
:mod:`obs._core.safe_files` (0600 files, 0700 folders, temp name + rename); names built from graph
and module names keep to ``[A-Za-z0-9_.-]``, so nothing escapes the folder.  ``index.json`` lists
every graph of this process: its files, stage, step and the compile that produced it; and every compile
(``compiles``), graph break (``breaks``, reason and the user's line) and recompile (``recompiles``, the guards
that failed) that PyTorch reported.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from obs._core import outputs, safe_files
from obs._core.rank_folders import rank_folder
from obs._core.safe_files import safe_name
from obs.features.graphs import graphviz

__all__ = ["INDEX", "INDEX_LIMIT", "VERBOSE_DIR", "GraphFiles", "Written", "graph_folder", "next_number"]

INDEX = "index.json"
INDEX_LIMIT = 64 << 20  #: the largest index.json read back
VERBOSE_DIR = "verbose_ir_files"

_counter = itertools.count()
_counter_lock = threading.Lock()


def next_number() -> int:
    """The next value of the process-wide counter shared by every ``.ir`` and ``.dot`` (as in MindSpore)."""
    with _counter_lock:
        return next(_counter)


def graph_folder(base: str) -> str:
    """``base``, or ``base/rank_{r}`` under distributed training (torch.distributed up, or more than one rank)."""
    from obs.runtime.job import distributed_ready
    from obs.settings.parallel import rank, world_size

    if distributed_ready() or world_size() > 1:
        return os.path.join(base, rank_folder(rank()))
    return base


@dataclass
class Written:
    """The files of one graph, relative to the folder: ``ir``, ``verbose``, ``dot``, ``svg`` when written."""

    graph: str
    stage: str
    files: dict[str, str] = field(default_factory=dict)
    folder: str = ""

    def paths(self) -> list[str]:
        return [os.path.join(self.folder, f) for f in self.files.values()]


class GraphFiles:
    """Writes graphs into one folder and keeps its ``index.json`` current."""

    def __init__(self, folder: str) -> None:
        self.folder = os.path.abspath(folder)
        self._lock = threading.Lock()
        self._entries: list[dict[str, Any]] = []
        self._sections: dict[str, list[dict[str, Any]]] = {"graphs": self._entries}
        self._noted = False

    def write(self, *, graph: str, stage: str, name: str, level: int, text: str, verbose: str | None = None,
              dot: str | None = None, meta: dict[str, Any] | None = None) -> Written:
        """Write one graph's files for ``level`` (``verbose`` from 2, ``dot`` from 3) and index them."""
        safe_files.ensure_dir(self.folder)
        base = f"{safe_name(stage, limit=32)}_{safe_name(name)}"
        number = next_number()
        result = Written(graph, stage, folder=self.folder)
        ir_name = f"{number:04d}_{base}.ir"
        self._put(ir_name, text)
        result.files["ir"] = ir_name
        if level >= 2 and verbose is not None:
            self._put(os.path.join(VERBOSE_DIR, ir_name), verbose)
            result.files["verbose"] = os.path.join(VERBOSE_DIR, ir_name)
        if level >= 3 and dot is not None:
            dot_name = f"{next_number():04d}_{base}.dot"
            self._put(dot_name, dot)
            result.files["dot"] = dot_name
            try:
                svg = graphviz.render(dot)
            except graphviz.GraphvizError:  # no Graphviz here, or it failed: the .dot alone
                svg = None
            if svg is not None:
                svg_name = dot_name[:-4] + ".svg"
                self._put(svg_name, svg)
                result.files["svg"] = svg_name
        self._index("graphs", {"number": number, "graph": graph, "stage": stage, "files": dict(result.files),
                                "time_ns": time.time_ns(), **(meta or {})})
        return result

    def write_code(self, *, graph: str, stage: str, name: str, text: str, meta: dict[str, Any]) -> Written:
        """Write one graph given as Python code (PyTorch's own rendering of an FX graph, or Inductor's output
        code) as ``{NNNN}_{stage}_{name}.py`` and index it."""
        safe_files.ensure_dir(self.folder)
        number = next_number()
        file = f"{number:04d}_{safe_name(stage, limit=32)}_{safe_name(name)}.py"
        self._put(file, text)
        result = Written(graph, stage, {"code": file}, self.folder)
        self._index("graphs", {"number": number, "graph": graph, "stage": stage, "files": {"code": file},
                                "time_ns": time.time_ns(), **meta})
        return result

    def note(self, section: str, entry: dict[str, Any]) -> None:
        """Add ``entry`` to the index's ``section`` (``compiles``, ``breaks``, ``recompiles``)."""
        safe_files.ensure_dir(self.folder)
        self._index(section, {**entry, "time_ns": time.time_ns()})

    def _index(self, section: str, entry: dict[str, Any]) -> None:
        with self._lock:
            self._sections.setdefault(section, []).append(entry)
            index = {"schema_version": 1, "pid": os.getpid(), "graphs": list(self._entries), **{
                k: list(v) for k, v in self._sections.items() if k != "graphs"}}
            safe_files.write_atomic(os.path.join(self.folder, INDEX), json.dumps(index, indent=1, default=str),
                                    fsync=False)
        if not self._noted:
            self._noted = True
            outputs.wrote("graph dumps", self.folder)

    @property
    def entries(self) -> list[dict[str, Any]]:
        """What ``index.json`` lists so far (copies)."""
        with self._lock:
            return [dict(e) for e in self._entries]

    def _put(self, relative: str, data: str | bytes) -> None:
        path = os.path.join(self.folder, relative)
        safe_files.ensure_dir(os.path.dirname(path))
        safe_files.write_atomic(path, data, fsync=False)
