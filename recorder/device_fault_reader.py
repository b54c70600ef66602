"""Read a bundle's CUDA fault back (``device_fault.json``, ``memory_summary.txt``, ``memory_snapshot.json``).

Pure: files in, a :class:`DeviceFault` out (None when the bundle's fault was no CUDA fault).  Files are opened with
:func:`obs._core.safe_files.read_private`; a record of the wrong shape is a :class:`DamagedFileError` naming the file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from obs._core import safe_files
from obs._core.errors import DamagedFileError
from obs._core.json_files import read_json

__all__ = ["DeviceFault", "read_device_fault"]


@dataclass(frozen=True)
class DeviceFault:
    """What :func:`recorder.device_faults.describe` wrote: the kind (``device_assert``, ``illegal_memory_access``,
    ``cuda_oom``, ``cuda_error``), where it surfaced, the module that raised, the ops (or modules) before it, the
    advice; and an OOM's memory files (``memory_snapshot`` is a path: the file may be large)."""

    kind: str
    title: str
    message: str
    asynchronous: bool
    module: str | None
    surfaced_at: dict[str, Any] | None
    launch_blocking: bool | None
    ops: list[dict[str, Any]] = field(default_factory=list)
    ops_since_wait: int | None = None
    suspects: list[dict[str, Any]] = field(default_factory=list)  #: the ops since the last wait, by module
    modules: list[str] = field(default_factory=list)
    advice: list[str] = field(default_factory=list)
    memory_summary: str = ""  #: ``memory_summary.txt`` (a CUDA out of memory), else ""
    memory_snapshot: str | None = None  #: the path of ``memory_snapshot.json``, when the bundle has one


#: key → (accepted types, default)
_KEYS: dict[str, tuple[tuple[type, ...], Any]] = {
    "kind": ((str,), None), "title": ((str,), ""), "message": ((str,), ""), "asynchronous": ((bool,), False),
    "module": ((str, type(None)), None), "surfaced_at": ((dict, type(None)), None),
    "launch_blocking": ((bool, type(None)), None), "ops": ((list,), []), "ops_since_wait": ((int, type(None)), None),
    "suspects": ((list,), []), "modules": ((list,), []), "advice": ((list,), []),
}


def read_device_fault(bundle: str) -> DeviceFault | None:
    """The CUDA fault of the bundle folder ``bundle``, or None when it has no ``device_fault.json``."""
    file = os.path.join(bundle, "device_fault.json")
    if not os.path.lexists(file):
        return None
    data = read_json(file, what="a device fault record")
    values: dict[str, Any] = {}
    for key, (types, default) in _KEYS.items():
        value = data.get(key, default)
        if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
            raise DamagedFileError(f"{file}: key {key!r} has the wrong type ({type(value).__name__})", path=file,
                                   offset=0)
        values[key] = value
    if not all(isinstance(op, dict) for op in values["ops"] + values["suspects"]) or not all(
            isinstance(x, str) for x in values["modules"] + values["advice"]):
        raise DamagedFileError(f"{file}: ops and suspects must be objects, modules and advice strings", path=file,
                               offset=0)
    summary = os.path.join(bundle, "memory_summary.txt")
    snapshot = os.path.join(bundle, "memory_snapshot.json")
    return DeviceFault(**values,
                       memory_summary=safe_files.read_private(summary).decode("utf-8", "replace")
                       if os.path.lexists(summary) else "",
                       memory_snapshot=snapshot if os.path.lexists(snapshot) else None)
