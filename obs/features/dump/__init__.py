"""Dumps: exception_dump (the failing op or module), the first NaN/Inf, and the data dump in MindSpore's layout.

``obs.features.dump.DumpReader(path)`` reads a data dump (steps × ops × tensors and statistics).  Importing
this package is light: the writers load torch only when a feature is turned on.

Here: :mod:`.feature` (the applier), :mod:`.data_dump` (the data dump; its tensor files of CUDA tensors through
:mod:`.pinned_files`), :mod:`.exception` (exception_dump), :mod:`.reader` (the pure reader), and what they share
(:mod:`.fault_folder`, :mod:`._file_names`, :mod:`._npy`, :mod:`._tensors`, :mod:`._autograd_scopes`).  Rooms:
:mod:`.stats` (the statistic dump, statistic.csv), :mod:`.nan` (the NaN/Inf check), :mod:`.diff` (``obs dump diff``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["DumpReader"]


def __getattr__(name: str) -> Any:
    if name == "DumpReader":
        from obs.features.dump.reader import DumpReader

        return DumpReader
    raise AttributeError(f"module 'obs.features.dump' has no attribute {name!r}")
