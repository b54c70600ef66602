"""The folder a rank's files go under, in every output of obs: ``rank_{r}``, or ``rank_unresolved-{pid}`` while the
process does not know its rank yet.

MindSpore's layout (``{path}/rank_{r}/...``), which the dumps, the graphs, the RDR and the profiler all keep.  A
process whose rank is a guess (a launcher gave no ``RANK``; before ``init_process_group``) never shares a rank's
folder: it writes under ``rank_unresolved-{pid}``, one folder per process, until it knows.  Writers name the folder
with :func:`rank_folder`; readers find them with :data:`GLOB` and read them back with :func:`folder_rank` and
:func:`unresolved`.
"""

from __future__ import annotations

import re

__all__ = ["GLOB", "folder_rank", "rank_folder", "unresolved"]

GLOB = "rank_*"  #: every rank folder, the unresolved ones too (a glob pattern)

_RANK = re.compile(r"rank_(\d+)")
_UNRESOLVED = re.compile(r"rank_unresolved-\d+")


def rank_folder(rank: int, *, unresolved_pid: int | None = None) -> str:
    """``rank_{rank}``; ``rank_unresolved-{pid}`` for the process ``unresolved_pid``, which does not know its rank."""
    return f"rank_unresolved-{unresolved_pid}" if unresolved_pid is not None else f"rank_{rank}"


def folder_rank(name: str) -> int | None:
    """The rank of the folder named ``name`` (``rank_3``: 3); None for an unresolved rank's folder or another name."""
    found = _RANK.fullmatch(name)
    return int(found.group(1)) if found else None


def unresolved(name: str) -> bool:
    """``name`` is the folder of a process that did not know its rank (``rank_unresolved-{pid}``)."""
    return _UNRESOLVED.fullmatch(name) is not None
