"""Tensor statistics for ``statistic.csv`` and the NaN/Inf check, on the tensor's own device.

Dense CPU tensors of the common dtypes (float32/64, float16, bfloat16, int8-64, uint8, bool) go
through the C extension ``obs.features.dump.stats._stats``: one pass over the memory for min, max, sum and sum of
squares, an exact NaN/Inf count only when that sum is not finite, zero counts only when asked.
Everything else (CUDA, complex, other dtypes, tensor subclasses, or a build without the extension)
takes the torch path: fast path first, one sum decides whether a tensor is all finite (a finite sum
means no NaN and no Inf); exact NaN/Inf counts and finite-only min/max are computed only when that
gate fails; all requested numbers are stacked and read back in one transfer.  Both give the same
values within the dtype's rounding (the C sums are in double, so they are the closer ones).  Our own
tensor work runs under :func:`obs._core.internal.suppressed`, invisible to obs's hooks.
"""

from __future__ import annotations

import cmath
import functools
import hashlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from obs._core.internal import suppressed
from obs._core.native import Installed

#: The C statistics pass, built by setup.py; without it (no C compiler, OBS_NATIVE_STATS=0) torch does it all.
#: Read once, when this module is first imported.
STATS = Installed("obs.features.dump.stats._stats", "STATS")
native = STATS.load()

__all__ = ["STATS", "compile_statistics", "nonfinite_counts", "statistics"]

def nonfinite_counts(tensor: torch.Tensor) -> tuple[int, int, int] | None:
    """None when every element is finite (the sum gate), else exact ``(nan, +inf, -inf)`` counts."""
    if not (tensor.is_floating_point() or tensor.is_complex()) or tensor.numel() == 0:
        return None
    if native is not None:
        found = _native_nonfinite(tensor)
        if found is not False:
            return found
    with suppressed():
        t, _ = _unexpanded(tensor.detach())
        total = t.sum().item()
        if (not isinstance(total, complex) and math.isfinite(total)) or (isinstance(total, complex)
                                                                          and cmath.isfinite(total)):
            return None
        t = tensor.detach()
        nan = torch.isnan(t).sum()
        pos = (t == float("inf")).sum()
        neg = (t == float("-inf")).sum()
        counts = torch.stack((nan, pos, neg)).tolist()
    if not any(counts):  # the sum overflowed on large finite values
        return None
    return int(counts[0]), int(counts[1]), int(counts[2])


def _unexpanded(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """An expanded tensor's distinct elements and how often each repeats (reductions over stride-0 views are
    very slow on CPU: 17-43 ms for a 500k-element expand, against 0.05 ms for the same data contiguous)."""
    repeat = 1
    for dim, (size, stride) in enumerate(zip(t.shape, t.stride())):
        if stride == 0 and size > 1:
            t = t.narrow(dim, 0, 1)
            repeat *= size
    return t, repeat


_COUNTS = ("nan count", "positive inf count", "negative inf count")
_ZEROS = ("zero count", "positive zero count", "negative zero count")
_HASHES = ("md5", "hash:md5", "hash", "hash:sha1")
_INTEGRAL = frozenset(_COUNTS + _ZEROS + ("count",))


def statistics(tensor: torch.Tensor, categories: Sequence[str]) -> list[Any]:
    """One value per category, in order; ``None`` for max/min/avg when no element is finite."""
    return compile_statistics(tuple(categories))(tensor)


@functools.lru_cache(maxsize=32)
def compile_statistics(categories: tuple[str, ...]) -> Callable[[torch.Tensor], list[Any]]:
    """``statistics`` with the categories decided once: the function a data dump calls per tensor."""
    need = frozenset(categories)
    zeros = bool(need.intersection(_ZEROS))
    hashes = bool(need.intersection(_HASHES))
    picks = [_NATIVE_ORDER.index(c) if c in _NATIVE_ORDER else -1 for c in categories]
    native_only = not hashes

    def run(tensor: torch.Tensor) -> list[Any]:
        got = _native_values(tensor, zeros) if native is not None else None
        if got is not None and native_only:
            return [got[i] for i in picks]
        if got is not None:
            values = dict(zip(_NATIVE_ORDER, got))
        else:
            values = _torch_values(tensor, need)
            values = {k: int(v) if k in _INTEGRAL and v is not None else v for k, v in values.items()}
        if hashes:
            _add_hashes(tensor, values)
        return [values.get(c) for c in categories]
    return run


_CODES: dict[torch.dtype, int] = {} if native is None else {
    torch.float32: native.F32, torch.float64: native.F64, torch.float16: native.F16, torch.bfloat16: native.BF16,
    torch.int64: native.I64, torch.int32: native.I32, torch.int16: native.I16, torch.int8: native.I8,
    torch.uint8: native.U8, torch.bool: native.U8}
NATIVE_DTYPES = tuple(_CODES)  #: the dtypes the C pass reads
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # subclasses (fake, functional, DTensor) may have no host memory
#: what _native_values returns, in its order
_NATIVE_ORDER = ("max", "min", "avg", "count", "l2norm", "nan count", "positive inf count", "negative inf count",
                 "zero count", "negative zero count", "positive zero count")
_ALL = tuple(range(len(_NATIVE_ORDER)))


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements exactly fill ``numel`` consecutive slots from ``data_ptr()`` in some order
    (permuted, channels-last): statistics do not depend on the order."""
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz > 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _native_values(tensor: torch.Tensor, zeros: bool) -> list[Any] | None:
    """The statistics of a dense CPU tensor (``_NATIVE_ORDER``) through the C pass; None when the torch path
    must do it."""
    t = _host_dense(tensor)
    if t is None:
        return None
    n, distinct = tensor.numel(), t.numel()
    return native.values(t.data_ptr(), n, _CODES[t.dtype], zeros, _ALL, n // distinct if distinct else 1)


def compile_contiguous(categories: tuple[str, ...]) -> Callable[[int, int, int], list[Any]] | None:
    """For callers that already hold a plain contiguous CPU tensor's ``(data_ptr, numel, dtype code)`` (the code
    from :func:`native_code`): the same list as :func:`compile_statistics` gives, without reading the tensor's
    attributes again.  None without the C extension (looked up now: compile once per dump), or when a category (a
    hash) needs the tensor itself."""
    found = native_picks(categories)
    if found is None:
        return None
    picks, zeros = found
    values = native.values

    def run(address: int, n: int, code: int) -> list[Any]:
        return values(address, n, code, zeros, picks, 1)
    return run


def native_picks(categories: tuple[str, ...]) -> tuple[tuple[int, ...], bool] | None:
    """For the C++ row recorder: the positions of ``categories`` in ``_NATIVE_ORDER`` and whether zero counts are
    needed; None without the C extension, or when a category (a hash) needs the tensor itself."""
    if native is None or set(categories).intersection(_HASHES):
        return None
    return tuple(_NATIVE_ORDER.index(c) for c in categories), bool(set(categories).intersection(_ZEROS))


def native_code(tensor: torch.Tensor, dtype: torch.dtype) -> int | None:
    """The C pass's dtype code when it can read ``tensor`` (of ``dtype``) as one contiguous run, else None."""
    code = _readable(tensor, dtype)
    return code if code is not None and tensor.is_contiguous() else None


def _readable(tensor: torch.Tensor, dtype: torch.dtype) -> int | None:
    """The C pass's dtype code when it can read ``tensor``'s host memory at all (a plain strided CPU tensor of a
    dtype it knows, not a negative view), else None."""
    code = _CODES.get(dtype)
    if code is None or not tensor.is_cpu or type(tensor) not in _PLAIN or tensor.layout is not torch.strided or \
            tensor.is_neg():
        return None
    return code


def _native_nonfinite(tensor: torch.Tensor) -> tuple[int, int, int] | bool | None:
    """The C gate on a dense CPU tensor: None when all finite, else the exact counts; False when the torch
    path must decide."""
    t = _host_dense(tensor)
    if t is None:
        return False
    code = _CODES[t.dtype]
    if native.finite(t.data_ptr(), t.numel(), code):
        return None
    repeat = tensor.numel() // t.numel()
    _, _, _, _, nan, pos, neg, _, _ = native.reduce(t.data_ptr(), t.numel(), code, False)
    return nan * repeat, pos * repeat, neg * repeat


def _host_dense(tensor: torch.Tensor) -> torch.Tensor | None:
    """``tensor``'s distinct elements as a tensor whose memory the C pass reads in one run (itself, its
    unexpanded view, or a contiguous copy); None for what the C pass does not take."""
    if _readable(tensor, tensor.dtype) is None:
        return None
    if tensor.is_contiguous():
        return tensor
    t, _ = _unexpanded(tensor)
    if not _dense(t):
        with suppressed():
            t = t.detach().contiguous()
    return t


def _add_hashes(tensor: torch.Tensor, values: dict[str, Any]) -> None:
    from obs.features.dump._tensors import host_array

    raw = host_array(tensor).tobytes()
    values["md5"] = values["hash:md5"] = hashlib.md5(raw).hexdigest()
    values["hash"] = values["hash:sha1"] = hashlib.sha1(raw).hexdigest()


def prepared(tensor: torch.Tensor) -> tuple[torch.Tensor, int, int, bool]:
    """``(t, numel, repeat, floating)``: the values statistics are taken of (a complex tensor's magnitudes, a bool
    tensor as bytes, an expanded tensor's distinct elements, each repeated ``repeat`` times), detached."""
    t = tensor.detach()
    if t.is_complex():
        t = t.abs()
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    n = t.numel()
    t, repeat = _unexpanded(t)
    return t, n, repeat, t.is_floating_point()


def _torch_values(tensor: torch.Tensor, need: frozenset[str]) -> dict[str, Any]:
    """The torch path: stage one reads back, in one transfer, what every tensor needs (min and max in one
    pass, the sum or the norm) plus a gate; only a tensor whose gate is not finite pays stage two: exact
    NaN/Inf counts and min/max/avg over its finite elements."""
    with suppressed():
        t, n, repeat, floating = prepared(tensor)
        values: dict[str, Any] = {"count": n}
        names: list[str] = []
        parts: list[torch.Tensor] = []

        def add(name: str, value: torch.Tensor) -> None:
            names.append(name)
            parts.append(value)

        if n:
            if need & {"max", "min"}:
                # aminmax is one pass over contiguous memory but slow on permuted views, where amax/amin are not
                lo, hi = torch.aminmax(t) if t.is_contiguous() else (t.amin(), t.amax())
                add("min", lo)
                add("max", hi)
            if "avg" in need or (not (need & {"max", "min", "l2norm"}) and floating):
                add("sum", t.sum(dtype=torch.float64) if not floating else t.sum())
            if "l2norm" in need:
                add("l2norm", torch.linalg.vector_norm(t if floating else t.to(torch.float64)))
            if need.intersection(_ZEROS):
                zero = t == 0
                add("zero count", zero.sum())
                if floating:
                    add("negative zero count", (zero & torch.signbit(t)).sum())
        if parts and any(p.dtype != parts[0].dtype for p in parts):  # one stack, one read-back: one dtype
            parts = [p.to(torch.float64) for p in parts]
        read = dict(zip(names, torch.stack(parts).tolist())) if parts else {}
        if repeat > 1:  # the values of an expanded tensor, repeated
            for key in ("sum", "zero count", "negative zero count"):
                if key in read:
                    read[key] *= repeat
            if "l2norm" in read:
                read["l2norm"] *= math.sqrt(repeat)
        finite = not floating or not n or all(math.isfinite(read[k]) for k in ("min", "max", "sum", "l2norm")
                                              if k in read)
        if finite:
            values.update({k: 0 for k in _COUNTS})
            if n:
                values.update(max=read.get("max"), min=read.get("min"),
                              avg=read["sum"] / n if "sum" in read else None)
            else:
                values.update(max=None, min=None, avg=None)
        else:  # stage two: exact counts, and min/max/avg over the finite elements
            mask = torch.isfinite(t)
            kept = t[mask]
            exact = [torch.isnan(t).sum(), (t == float("inf")).sum(), (t == float("-inf")).sum()]
            if kept.numel():
                lo, hi = torch.aminmax(kept)
                exact += [lo, hi, kept.sum()]
            got = torch.stack([v.to(torch.float64) for v in exact]).tolist()
            values.update(zip(_COUNTS, (c * repeat for c in got[:3])))
            values.update(min=got[3], max=got[4], avg=got[5] / len(kept)) if kept.numel() else \
                values.update(min=None, max=None, avg=None)
        values["l2norm"] = read.get("l2norm", 0.0)
        if "zero count" in read:
            values["zero count"] = read["zero count"]
            values["negative zero count"] = read.get("negative zero count", 0)
            values["positive zero count"] = read["zero count"] - values["negative zero count"]
        if not n:
            values.update({k: 0 for k in _ZEROS})
    return values
