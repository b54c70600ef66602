"""Print arguments become items: dtype names, dims, little-endian C-order bytes; bad ones are refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from printsink.values import TensorItem, normalize


def test_python_scalars_become_0d_tensors_that_lose_nothing():
    items = normalize((True, 3, 0.1, "s"))
    assert [(i.dtype, i.dims) for i in items[:3]] == [("Bool", ()), ("Int64", ()), ("Float64", ())]
    assert items[2].data.item() == 0.1 and items[3] == "s"


def test_tuples_and_lists_are_flattened():
    items = normalize(("a", ("b", [1, ("c",)]), []))
    assert [i if isinstance(i, str) else i.data.item() for i in items] == ["a", "b", 1, "c"]


@pytest.mark.parametrize("dtype,name", [
    (torch.bool, "Bool"), (torch.int8, "Int8"), (torch.int16, "Int16"), (torch.int32, "Int32"),
    (torch.int64, "Int64"), (torch.uint8, "UInt8"), (torch.uint16, "UInt16"), (torch.uint32, "UInt32"),
    (torch.uint64, "UInt64"), (torch.float16, "Float16"), (torch.bfloat16, "BFloat16"),
    (torch.float32, "Float32"), (torch.float64, "Float64"), (torch.complex64, "Complex64"),
    (torch.complex128, "Complex128"),
])
def test_every_torch_dtype_keeps_its_bytes(dtype, name):
    t = (torch.arange(6) % 2).to(dtype).reshape(2, 3)
    (item,) = normalize((t,))
    assert item.dtype == name and item.dims == (2, 3)
    expected = t.contiguous().view(torch.uint8).numpy().tobytes() if dtype != torch.bool else t.numpy().tobytes()
    assert bytes(item.content()) == expected


def test_non_contiguous_conjugated_and_grad_tensors():
    base = torch.arange(12, dtype=torch.float32, requires_grad=True).reshape(3, 4)
    (item,) = normalize((base.t(),))
    assert item.dims == (4, 3) and np.array_equal(item.data, base.detach().numpy().T)
    z = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64).conj()
    (item,) = normalize((z,))
    assert np.array_equal(item.data, np.array([1 - 2j, 3 + 1j], dtype=np.complex64))


def test_big_endian_numpy_is_written_little_endian():
    a = np.arange(3, dtype=">i4")
    (item,) = normalize((a,))
    assert item.dtype == "Int32" and bytes(item.content()) == np.arange(3, dtype="<i4").tobytes()


def test_numpy_scalars_and_strided_arrays():
    items = normalize((np.float32(1.5), np.arange(10, dtype=np.int16)[::3]))
    assert (items[0].dtype, items[0].dims, items[0].data.item()) == ("Float32", (), 1.5)
    assert items[1].dims == (4,) and items[1].data.tolist() == [0, 3, 6, 9]


@pytest.mark.parametrize("value,message", [
    ({"a": 1}, "got dict"), (None, "got NoneType"), (object(), "got object"),
    (np.array(["a"], dtype=object), "numpy dtype object"), (np.array([1], dtype="datetime64[s]"), "datetime64"),
    (torch.zeros(2).to_sparse(), "dense"), (torch.zeros(2, dtype=torch.float8_e4m3fn), "float8_e4m3fn"),
])
def test_unsupported_values_raise_type_error_naming_them(value, message):
    with pytest.raises(TypeError, match=message):
        normalize(("ok", value))


def test_int_beyond_int64_is_a_value_error():
    with pytest.raises(ValueError, match=r"Int64 \(got 9223372036854775808\)"):
        normalize((1 << 63,))


def test_tensor_item_content_is_a_view():
    data = np.ones(4, "<f4")
    item = TensorItem("Float32", (4,), data)
    assert np.shares_memory(np.asarray(item.content()), data)
