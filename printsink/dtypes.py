"""MindSpore's ``tensor_type`` names and how they map to numpy and torch dtypes.

The names are MindSpore's ``Type::ToString`` spellings (capital ``U`` in ``UInt8``, ``BFloat16``).
numpy has no bfloat16: such tensors are written from torch and read back as float32 numpy arrays
(exact widening) or as bfloat16 torch tensors with ``as_torch=True``.
"""

from __future__ import annotations

import numpy as np

__all__ = ["NUMPY_OF", "NAME_OF_NUMPY", "NAME_OF_TORCH", "SUPPORTED"]

#: tensor_type → numpy dtype of the raw little-endian bytes in tensor_content
NUMPY_OF: dict[str, np.dtype] = {
    "Bool": np.dtype("?"),
    "Int8": np.dtype("<i1"), "Int16": np.dtype("<i2"), "Int32": np.dtype("<i4"), "Int64": np.dtype("<i8"),
    "UInt8": np.dtype("<u1"), "UInt16": np.dtype("<u2"), "UInt32": np.dtype("<u4"), "UInt64": np.dtype("<u8"),
    "Float16": np.dtype("<f2"), "Float32": np.dtype("<f4"), "Float64": np.dtype("<f8"),
    "BFloat16": np.dtype("<u2"),  # raw bits; widened to float32 by the reader
    "Complex64": np.dtype("<c8"), "Complex128": np.dtype("<c16"),
}

#: numpy dtype (native byte order) → tensor_type
NAME_OF_NUMPY: dict[np.dtype, str] = {
    np.dtype(t).newbyteorder("="): name for name, t in NUMPY_OF.items() if name != "BFloat16"
}

#: ``str(torch_dtype)`` → tensor_type (strings, so this module never imports torch)
NAME_OF_TORCH: dict[str, str] = {
    "torch.bool": "Bool",
    "torch.int8": "Int8", "torch.int16": "Int16", "torch.int32": "Int32", "torch.int64": "Int64",
    "torch.uint8": "UInt8", "torch.uint16": "UInt16", "torch.uint32": "UInt32", "torch.uint64": "UInt64",
    "torch.float16": "Float16", "torch.bfloat16": "BFloat16", "torch.float32": "Float32", "torch.float64": "Float64",
    "torch.complex64": "Complex64", "torch.complex128": "Complex128",
}

SUPPORTED = tuple(NUMPY_OF)
