"""Graph texts kept beside the ring (``graphs_{pid}/NNN_{stage}_{name}.ir``), so a recovered bundle has them.

The ring's blob slots are too small for a graph; these files are written once per graph (not on a
hot path) through :mod:`obs._core.safe_files`, removed with the ring on a clean exit, and read back
by ``obs rdr recover`` (regular files of this user only, bounded in size and count).
"""

from __future__ import annotations

import glob
import os

from obs._core import safe_files
from obs._core.errors import UnsafePathError
from obs._core.safe_files import safe_name

__all__ = ["GRAPH_FILE_LIMIT", "read_graphs", "remove_graphs", "write_graph"]

#: a graph file larger than this is not one the recorder wrote
GRAPH_FILE_LIMIT = 64 << 20
_KEPT = 64


def write_graph(folder: str, seq: int, name: str, text: str) -> str:
    """Write one graph's text as ``{folder}/{seq:03d}_{name}.ir``; returns the path."""
    path = os.path.join(folder, f"{seq:03d}_{safe_name(name)}.ir")
    safe_files.ensure_dir(folder)
    safe_files.write_atomic(path, text, fsync=False)
    return path


def read_graphs(folder: str) -> tuple[list[tuple[str, str]], list[Exception]]:
    """``(name, text)`` of the graph files in ``folder``, oldest first, and the files refused or unreadable."""
    out: list[tuple[str, str]] = []
    problems: list[Exception] = []
    if not os.path.isdir(folder) or os.path.islink(folder):
        return out, problems
    for path in sorted(glob.glob(os.path.join(glob.escape(folder), "*.ir")))[-_KEPT:]:
        try:
            data = safe_files.read_private(path, limit=GRAPH_FILE_LIMIT)
        except (UnsafePathError, OSError) as exc:
            problems.append(exc)
            continue
        name = os.path.basename(path)[:-3].split("_", 1)[-1]
        out.append((name, data.decode("utf-8", "replace")))
    return out, problems


def remove_graphs(folder: str) -> None:
    """Remove the graph files and their folder (what is not ours is left alone)."""
    if not os.path.isdir(folder) or os.path.islink(folder):
        return
    for path in glob.glob(os.path.join(glob.escape(folder), "*.ir")):
        try:
            os.unlink(path)
        except OSError:
            pass
    try:
        os.rmdir(folder)
    except OSError:
        pass
