"""The folders a rank makes under a root every rank of a job shares (``{rdr.path}/rank_{r}/rdr``), and taking them
away again when the rank leaves with nothing to report.

Each rank removes the folders it made below the root.  The root itself (and any folder above it obs made for it)
may have been made by another rank, one that left first while this one still had its folder there: whichever rank
made the root leaves a note in it (:data:`NOTE`, naming the folders above it that it made too), and whichever rank
finds the root holding only that note when it leaves takes the root away.  A root obs did not make is never
removed.
"""

from __future__ import annotations

import json
import os

from obs._core import safe_files
from obs._core.json_files import read_json

__all__ = ["NOTE", "leave", "make"]

#: in a root obs made: ``{"made": [the folders above the root obs made for it, deepest first]}``
NOTE = ".obs_made.json"


def _missing(path: str) -> list[str]:
    """The folders that creating ``path`` would create, deepest first."""
    out = []
    while not os.path.lexists(path):
        out.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return out


def make(folder: str, root: str) -> list[str]:
    """Create ``folder`` (at or below ``root``) and its missing parents; the folders made below ``root``, deepest
    first, for :func:`leave`.  A root made here gets its note."""
    folder, root = os.path.abspath(folder), os.path.abspath(root)
    missing = _missing(folder)
    try:
        safe_files.ensure_dir(folder)
    except FileNotFoundError:  # a rank leaving took the root away between the look and the making
        missing = _missing(folder)
        safe_files.ensure_dir(folder)
    if root in missing:
        above = missing[missing.index(root) + 1:]
        # Atomic: a rank leaving never reads half a note.  Two ranks that both saw the root missing write the same.
        safe_files.write_atomic(os.path.join(root, NOTE), json.dumps({"made": above}), fsync=False)
    return [f for f in missing if f.startswith(root + os.sep)]


def leave(made: list[str], root: str) -> None:
    """Remove ``made`` (from :func:`make`) while empty, then the root and what obs made above it when only the note
    is left in it."""
    for path in made:
        try:
            os.rmdir(path)
        except OSError:
            return
    root = os.path.abspath(root)
    note = os.path.join(root, NOTE)
    try:
        if os.listdir(root) != [NOTE]:
            return
        data = read_json(note, what="the root's note", limit=1 << 16)
        os.unlink(note)
        os.rmdir(root)
    except (OSError, ValueError):  # another rank took it away first, or came in
        return
    above = data.get("made", [])
    for path in above:  # only folders above the root: a note is never a way to remove anything else
        if not (isinstance(path, str) and root.startswith(path.rstrip(os.sep) + os.sep)):
            return
        try:
            os.rmdir(path)
        except OSError:
            return
