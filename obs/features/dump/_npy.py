"""MindSpore's ``.npy`` bytes, which every dump writer's tensor files have.

:func:`npy_bytes` writes MindSpore's npy header: version 1.0, every dim followed by a comma (``(2,3,)``, ``()``),
padded with spaces and a newline to a multiple of 64 bytes (a full 64 when already aligned).  ``numpy.load`` reads
the files.
"""

from __future__ import annotations

import numpy as np

__all__ = ["npy_bytes", "npy_header"]


def npy_header(descr: str, shape: tuple[int, ...]) -> bytes:
    """The ``.npy`` preamble MindSpore writes for an array of ``descr`` (``<f4``) and ``shape``."""
    dims = "".join(f"{int(d)}," for d in shape)
    text = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': ({dims}), }}"
    pad = 64 - (10 + len(text) + 1) % 64
    text += " " * pad + "\n"
    if len(text) <= 0xFFFF:
        return b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text.encode("latin1")
    pad = 64 - (12 + len(text.rstrip()) + 1) % 64
    text = text.rstrip() + " " * pad + "\n"
    return b"\x93NUMPY\x02\x00" + len(text).to_bytes(4, "little") + text.encode("latin1")


def npy_bytes(array: np.ndarray) -> tuple[bytes, memoryview]:
    """(preamble, data) of ``array`` as a little-endian C-order ``.npy`` in MindSpore's header style."""
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    array = np.ascontiguousarray(array)
    return npy_header(array.dtype.str, array.shape), memoryview(array).cast("B")
