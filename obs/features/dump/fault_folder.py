"""One fault folder: the tensors of the op or module that failed (exception_dump) or made the first NaN/Inf (the NaN
check), and its ``meta.json``; the fault itself is the RDR's (a FAULT event), whose bundle names the folder.

``{root}/rank_{r}/{kind}/{stamp}_{scope}/`` holds ``inputs.N.npy`` (``outputs.N.npy``,
``saved.N.npy``) and ``meta.json`` (op, scope, step, shapes, dtypes, devices, exception text,
Python stack).  Folders are 0700 and files 0600 through :mod:`obs._core.safe_files`; the scope is
escaped, so no module name leaves ``root``.  A tensor that cannot be copied to the host is listed
with the reason instead of a file.  The folder is written under a temporary name and renamed
(:func:`obs._core.safe_files.new_folder`), so it is complete or absent.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from collections.abc import Iterable, Iterator
from types import FrameType
from typing import Any

from obs._core import outputs, safe_files
from obs._core.rank_folders import rank_folder
from obs.features.dump._file_names import escape_name, inside
from obs.features.dump._npy import npy_bytes
from obs.features.dump._tensors import describe, host_array, tensors_in

__all__ = ["SCHEMA_VERSION", "outputs_in", "python_stack", "write_fault_folder"]

SCHEMA_VERSION = 1


def python_stack(error: BaseException | None, frame: FrameType | None) -> list[str]:
    """The stack of a failure: the callers of ``frame`` (outermost first), then the traceback of ``error``;
    as the user's code sees it (:func:`recorder.stacks.user_frames`: no frame of obs, nor of ``obs run``)."""
    from recorder.stacks import user_frames

    entries = traceback.StackSummary.from_list(user_frames(list(traceback.extract_stack(frame)))) \
        if frame is not None else traceback.StackSummary()
    lines = list(entries.format())
    if error is not None:
        tb = traceback.TracebackException.from_exception(error)
        tb.stack = traceback.StackSummary.from_list(user_frames(list(tb.stack)))
        lines += list(tb.format())
    return [line.rstrip("\n") for line in lines]


def outputs_in(output: Any) -> Iterator[tuple[str, Any]]:
    """``(where, tensor)`` for every tensor of an op's or module's output, labelled as one: ``output`` (a tensor),
    ``output[1]``, ``output['logits']``; inputs are ``args[i]`` (:func:`~obs.features.dump._tensors.tensors_in`)."""
    for where, tensor in tensors_in((output,)):
        yield "output" + where.removeprefix("args[0]"), tensor


def _stamp() -> str:
    now = time.time()
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime(now)) + f"-{int(now % 1 * 1e6):06d}"


def write_fault_folder(root: str, rank: int, kind: str, scope: str, meta: dict[str, Any],
                       groups: Iterable[tuple[str, Iterable[tuple[str, Any]]]], what: str) -> str:
    """Write one fault folder and return its path.

    ``groups``: ``(prefix, [(where, tensor), ...])`` such as ``("inputs", tensors_in(args, kwargs))``;
    the N-th tensor of a group becomes ``{prefix}.N.npy``.  ``what`` names the folder in ``obs run``'s
    list of written files.
    """

    def fill(tmp: str) -> None:
        listed: dict[str, list[dict[str, Any]]] = {}
        for prefix, items in groups:
            entries = listed.setdefault(prefix, [])
            for index, (where, tensor) in enumerate(items):
                entries.append(_save(tmp, f"{prefix}.{index}.npy", where, tensor))
        body = {"schema_version": SCHEMA_VERSION, **meta, **listed}
        safe_files.write_new(os.path.join(tmp, "meta.json"), json.dumps(body, indent=2, default=str).encode())

    name = f"{_stamp()}_{escape_name(scope or meta.get('op') or 'unknown', limit=120)}"
    final = safe_files.new_folder(inside(root, rank_folder(rank), kind), name, fill)
    outputs.wrote(what, final)
    return final


def _save(folder: str, file: str, where: str, tensor: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {"file": file, "arg": where}
    try:
        entry.update(describe(tensor))
    except Exception as exc:  # noqa: BLE001 - a tensor subclass without shape/dtype: say so, keep going
        entry.update(file=None, unavailable=f"{type(exc).__name__}: {exc}")
        return entry
    try:
        header, data = npy_bytes(host_array(tensor))
    except Exception as exc:  # noqa: BLE001 - a broken device, a fake or freed tensor: the meta still says what it was
        entry.update(file=None, unavailable=f"{type(exc).__name__}: {exc}")
        return entry
    safe_files.write_new(os.path.join(folder, file), header, data)
    return entry
