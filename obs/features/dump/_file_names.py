"""The names of the files and folders the dumps write: MindSpore's, escaped, and never outside the dump folder.

* :func:`escape_name` is MindSpore's op-name escape (``/ \\ .`` and space become ``_``), applied to
  every name that came from a model (op, module, net names), plus anything outside
  ``[A-Za-z0-9_+=()-]`` becoming ``_``, and long names cut with a hash suffix, so no name can
  climb out of its folder or exceed a file system's name limit.
* :func:`inside` joins escaped parts under a root and refuses a result that leaves it.
* :func:`op_type` is an aten op's MindSpore-style type (``Addmm``), the first part of its file and row names.
"""

from __future__ import annotations

import os

from obs._core import safe_files
from obs._core.errors import UnsafePathError

__all__ = ["escape_name", "inside", "op_type"]

_MINDSPORE = r"A-Za-z0-9_+=()\-"  # no comma: names are columns of statistic.csv
_NAME_MAX = 160  # bytes kept of one name; the rest of a dump file name (type, slots, stamp) fits in 255


def op_type(name: str) -> str:
    """``addmm.default`` → ``Addmm``; ``native_batch_norm_backward.default`` → ``NativeBatchNormBackward``."""
    base = name.split(".", 1)[0]
    return "".join(part[:1].upper() + part[1:] for part in base.split("_") if part) or "Op"


def escape_name(name: str, *, limit: int = _NAME_MAX) -> str:
    """``Default/net-Net/fc1-Linear/Addmm-op3`` → ``Default_net-Net_fc1-Linear_Addmm-op3``; never empty.

    MindSpore's escape (``/ \\ .`` and space become ``_``), and every other character that is not safe in a file
    name or a CSV column, one for one: :func:`obs._core.safe_files.safe_name` with MindSpore's character set."""
    return safe_files.safe_name(str(name), limit=limit, keep=_MINDSPORE, runs=False)


def inside(root: str, *parts: str, escape: bool = True) -> str:
    """``root/part/...`` with each part escaped (``escape=False``: fixed names of ours, like ``.dump_metadata``);
    raises :class:`UnsafePathError` if the result leaves ``root``."""
    base = os.path.abspath(root)
    path = os.path.join(base, *(escape_name(p, limit=200) if escape else p for p in parts))
    if os.path.commonpath([base, os.path.abspath(path)]) != base:
        raise UnsafePathError(f"refusing to write {path!r}: it is outside the dump folder {base!r}", path=path)
    return path
