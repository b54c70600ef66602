"""Screen output of Print calls without ``print_file_path``, in MindSpore's style.

Strings print on their own line; scalars print their value; tensors print as
``Tensor(shape=[2, 3], dtype=Float32, value=`` followed by the numpy-formatted values and ``)``.
"""

from __future__ import annotations

import numpy as np

from printsink.values import Item, TensorItem

__all__ = ["format_items", "format_array"]


def format_items(items: list[Item]) -> str:
    """The text a Print call shows, one line per string or scalar, several per tensor; ends with a newline."""
    return "".join(f"{item if isinstance(item, str) else format_tensor(item)}\n" for item in items)


def format_tensor(item: TensorItem) -> str:
    data = item.data
    if item.dtype == "BFloat16":
        data = (data.astype("<u4") << 16).view("<f4")
    return format_array(data, item.dtype)


def format_array(data: np.ndarray, dtype: str) -> str:
    """``value`` for 0-d arrays, else the ``Tensor(shape=..., dtype=..., value=...)`` block."""
    if data.ndim == 0:
        return np.array2string(data)
    body = np.array2string(data, separator=", ", threshold=1000, edgeitems=3)
    return f"Tensor(shape={list(data.shape)}, dtype={dtype}, value=\n{body})"
