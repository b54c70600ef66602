"""What obs wrote in this process: every writer says so once per file, and ``obs run`` lists them at the end.

``wrote(kind, path)`` is called by writers when a file or bundle comes into being (an RDR bundle, a
print file, later traces and dumps); ``written()`` returns them in order.  Cheap and thread-safe;
never on a hot path (once per file).
"""

from __future__ import annotations

import os
import threading

__all__ = ["clear", "wrote", "written"]

_lock = threading.Lock()
_items: list[tuple[str, str]] = []


def wrote(kind: str, path: str) -> None:
    """Note that ``path`` (a file or folder of kind ``kind``, e.g. ``"RDR bundle"``) was written."""
    item = (kind, os.path.abspath(path))
    with _lock:
        if item not in _items:
            _items.append(item)


def written() -> list[tuple[str, str]]:
    """``(kind, absolute path)`` of everything written so far, oldest first."""
    with _lock:
        return list(_items)


def clear() -> None:
    with _lock:
        _items.clear()


os.register_at_fork(after_in_child=clear)  # a forked worker reports only its own files
