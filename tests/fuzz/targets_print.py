"""Fuzz targets: print files through ``parse_print`` / ``iter_print`` (strict and not) and through ``obs print``.

Seeds: every dtype, scalars, empty and multi-dim tensors, a large tensor (read straight into its array),
strings with control characters, obs records with and without a worker's parent pid, MindSpore-style
records without metadata (one per value and one per call), packed dims (proto3 writers) and a file
with a damaged record in the middle.
"""

from __future__ import annotations

import itertools
import warnings

import numpy as np

from obs._core.errors import DamagedFileError, NotOurFileError
from printsink.dtypes import NUMPY_OF
from printsink.encoder import CallMeta, encode_bytes, varint
from printsink.reader import NotAPrintFile, PrintFileWarning, iter_print, parse_print
from printsink.values import TensorItem, normalize
from tests.fuzz import Rejected, Target, cli_exit


def _record(seq: int, values: tuple, *, parent_pid: int = 0, meta: bool = True) -> bytes:
    items = normalize(values)
    info = CallMeta(seq, 1_795_000_000_000_000_000 + seq, seq // 2, 0, 1000 + seq % 3, f"train.py:{seq}", len(items),
                    parent_pid) if meta else None
    return encode_bytes(items, info)


def _packed_tensor(dims: list[int], dtype: str, content: bytes) -> bytes:
    body = b"".join(varint(d) for d in dims)
    name = dtype.encode()
    tensor = b"\x0a" + varint(len(body)) + body + b"\x12" + varint(len(name)) + name + b"\x1a" + varint(
        len(content)) + content
    value = b"\x12" + varint(len(tensor)) + tensor
    return b"\x0a" + varint(len(value)) + value


def _seeds(scratch: str) -> list[bytes]:
    rng = np.random.default_rng(0)
    dtypes = [NUMPY_OF[n] for n in NUMPY_OF if n != "BFloat16"]
    calls = []
    for i, dt in enumerate(dtypes):
        shape = [(), (3,), (2, 3), (2, 0), (1, 2, 2)][i % 5]
        array = rng.integers(0, 100, size=shape).astype(dt) if shape else dt.type(7)
        calls.append((f"value {i}:", array))
    bf16 = TensorItem("BFloat16", (2,), np.array([0x3FC0, 0x7FC0], "<u2"))
    seeds = [
        b"".join(_record(i + 1, call) for i, call in enumerate(calls)),
        _record(1, ("loss", 0.25, 3, True, [1.5, (2, "nested")])) + _record(2, ("esc \x1b[2J\x07 é 中",)),
        encode_bytes([bf16, "bf16"], CallMeta(1, 0, 0, 0, 1, "", 2)),
        _record(1, ("big", np.arange(6000, dtype="<f4"))) + _record(2, ("after",)),
        _record(1, ("worker",), parent_pid=999) + _record(2, ("main",), parent_pid=1002),
        b"".join(_record(0, (f"ms {i}", np.full(3, i, "<i4")), meta=False) for i in range(3)),
        _record(0, ("one call, no metadata", np.ones((2, 2), "<f8")), meta=False),
        _packed_tensor([2, 3], "Float32", np.arange(6, dtype="<f4").tobytes())
        + _packed_tensor([], "Int64", np.int64(5).tobytes()),
        _record(1, ("x", np.zeros((4, 0, 3), "<f2"))),
    ]
    good = [_record(i, (f"call {i}", np.full(4, i, "<i8"))) for i in range(4)]
    bad = bytearray(good[1])
    bad[bad.index(b"Int64")] = ord("Q")
    seeds.append(good[0] + bytes(bad) + good[2] + good[3][:-3])
    return seeds


def _api(path: str) -> None:
    """strict: the values or a clear error; strict=False: the values, or 'not a print file' in the same cases."""
    strict_error: ValueError | None = None
    try:
        parse_print(path)
    except (DamagedFileError, NotOurFileError) as exc:
        strict_error = exc
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrintFileWarning)
        try:
            calls = list(iter_print(path, strict=False))
        except NotAPrintFile:
            assert isinstance(strict_error, NotAPrintFile), f"strict gave {strict_error!r}, strict=False 'not ours'"
            raise
    assert not isinstance(strict_error, NotAPrintFile), "strict=False read a file strict called 'not ours'"
    assert all(a.end <= b.offset for a, b in itertools.pairwise(calls)), "records overlap"
    if strict_error is not None:
        raise strict_error


def _cli(path: str) -> None:
    """Exit codes agree across flags: 2 (not ours) for all or none; --partial exits 0 on any print file."""
    with open(path, "rb") as fh:
        odd = len(fh.read()) % 2
    variants = (((), ("--partial", "--json")), (("--json",), ("--partial",)))[odd]
    codes = []
    for extra in variants:
        try:
            codes.append(cli_exit("print", path, *extra))
        except Rejected as exc:
            codes.append(exc.args[0])
    assert codes[1] in (0, 2) and (2 not in codes or codes == [2, 2]), f"exit codes {codes} for {variants}"
    if max(codes):
        raise Rejected(max(codes))


TARGETS = [
    Target("print_api", _seeds, _api),
    Target("print_cli", _seeds, _cli),
]
