"""Turn the arguments of a Print call into items the encoder and the screen printer share.

An item is either a ``str`` or a :class:`TensorItem`: a MindSpore dtype name, the dims and a
C-contiguous little-endian numpy array whose buffer is exactly the ``tensor_content`` bytes.
Tuples and lists are flattened (as MindSpore's Print does).  Python ``bool``/``int``/``float``
become 0-d ``Bool``/``Int64``/``Float64`` tensors so they round-trip without loss.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from printsink.dtypes import NAME_OF_NUMPY, NAME_OF_TORCH

__all__ = ["Item", "TensorItem", "normalize"]

_ACCEPTED = "str, torch.Tensor, numpy array or scalar, int, float, bool, or a tuple/list of them"


@dataclass(frozen=True, slots=True)
class TensorItem:
    """One tensor value: ``dtype`` is the MindSpore name, ``data`` holds the raw bytes in C order."""

    dtype: str
    dims: tuple[int, ...]
    data: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def content(self) -> memoryview:
        """The tensor_content bytes, without copying."""
        # numpy's stubs declare ndarray.__buffer__ on Python 3.12+ only; every ndarray has the buffer protocol
        return memoryview(self.data.reshape(-1).view(np.uint8))  # type: ignore[arg-type]


Item = str | TensorItem


def normalize(values: tuple[Any, ...]) -> list[Item]:
    """Flatten and convert; raises TypeError naming the first value of an unsupported type."""
    out: list[Item] = []
    _append(values, out)
    return out


def _append(values: Any, out: list[Item]) -> None:
    for value in values:
        if isinstance(value, str):
            out.append(value)
        elif isinstance(value, (tuple, list)):
            _append(value, out)
        elif isinstance(value, bool):
            out.append(TensorItem("Bool", (), np.array(value, dtype="?")))
        elif isinstance(value, int):
            if not -(1 << 63) <= value < (1 << 63):
                raise ValueError(f"obs.Print: int values must fit in Int64 (got {value!r})")
            out.append(TensorItem("Int64", (), np.array(value, dtype="<i8")))
        elif isinstance(value, float):
            out.append(TensorItem("Float64", (), np.array(value, dtype="<f8")))
        elif isinstance(value, (np.ndarray, np.generic)):
            out.append(_from_numpy(np.asarray(value)))
        elif _is_torch_tensor(value):
            out.append(_from_torch(value))
        else:
            raise TypeError(f"obs.Print: each value must be {_ACCEPTED} (got {type(value).__name__}: {value!r:.80})")


def _from_numpy(array: np.ndarray) -> TensorItem:
    native = array.dtype.newbyteorder("=") if array.dtype.byteorder in "<>" else array.dtype
    name = NAME_OF_NUMPY.get(native)
    if name is None:
        raise TypeError(f"obs.Print: numpy dtype {array.dtype} is not printable; supported: "
                        f"{', '.join(sorted({str(d) for d in NAME_OF_NUMPY}))}")
    if array.dtype.byteorder == ">" or (array.dtype.byteorder == "=" and sys.byteorder == "big"):
        array = array.astype(array.dtype.newbyteorder("<"))
    return TensorItem(name, tuple(int(d) for d in array.shape), np.ascontiguousarray(array))


def _is_torch_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _from_torch(tensor: Any) -> TensorItem:
    import torch

    from obs._core.internal import suppressed  # here, not at the top: `import printsink` must not import obs

    name = NAME_OF_TORCH.get(str(tensor.dtype))
    if name is None:
        raise TypeError(f"obs.Print: torch dtype {tensor.dtype} is not printable; supported: "
                        f"{', '.join(sorted(NAME_OF_TORCH))}")
    if tensor.layout is not torch.strided:
        raise TypeError(f"obs.Print: only dense (strided) tensors are printable (got layout {tensor.layout})")
    with suppressed():
        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if t.is_conj() or t.is_neg():
            t = t.resolve_conj().resolve_neg()
        if not t.is_contiguous():
            t = t.contiguous()
        if name == "BFloat16":
            t = t.view(torch.int16)
        data = t.numpy()
    if name == "BFloat16":
        data = data.view("<u2")
    return TensorItem(name, tuple(int(d) for d in tensor.shape), data)
