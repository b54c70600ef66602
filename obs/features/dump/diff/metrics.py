"""How far apart two tensors are: max absolute and relative error, cosine similarity, mean and L2-norm relative error.

Pure numpy.  Two arrays (:func:`tensor_metrics`) are read a chunk at a time in float64, so a tensor of 1 GiB costs
its own two arrays and a few MiB more; two ``statistic.csv`` rows (:func:`statistic_metrics`) give the errors of
the statistics themselves, which bound the elementwise errors from below (``|max a - max b| <= max |a - b|``) and
give no cosine.  B is the reference: a value of A agrees with B's when ``|a - b| <= atol + rtol * |b|`` (NaN agrees
with NaN, an infinity with the same infinity), and relative errors divide by ``|b|``.

Tolerances: a fixed ``rtol``/``atol`` for every tensor, or a preset per dtype (:data:`PRESETS`): one preset for
every tensor (``"bf16"``: a bf16 run against an fp32 one), or ``"auto"``, the preset of the coarser dtype of each
pair.  An ``rtol`` or ``atol`` given with a preset replaces the preset's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

__all__ = ["DEFAULT_ATOL", "DEFAULT_RTOL", "EXACT", "METRIC_LABELS", "PRESETS", "DiffMetrics", "Tolerance", "close",
           "number",
           "statistic_metrics", "statistic_metrics_many", "tensor_metrics"]

DEFAULT_RTOL, DEFAULT_ATOL = 1e-5, 1e-8  # obs dump diff without --tolerance: one tolerance for every dtype

#: (rtol, atol) per dtype: loose enough for another kernel's, device's or compiler's reordered sums across a
#: network's depth, tight enough that a changed activation, learning rate or cast is caught.
PRESETS: dict[str, tuple[float, float]] = {
    "fp64": (1e-9, 1e-12),
    "fp32": (1e-4, 1e-6),
    "tf32": (5e-3, 1e-4),
    "fp16": (5e-3, 1e-4),
    "bf16": (3e-2, 1e-3),
    "int": (0.0, 0.0),
}
_COARSENESS = ("int", "fp64", "fp32", "tf32", "fp16", "bf16")
_DTYPE_PRESET = {"float64": "fp64", "double": "fp64", "float32": "fp32", "float": "fp32", "float16": "fp16",
                 "half": "fp16", "bfloat16": "bf16", "complex128": "fp64", "complex64": "fp32"}
_CHUNK = 1 << 18  # elements per float64 pass (2 MiB per array)


def _preset_of(dtype: str) -> str:
    """``"fp32"`` for ``Float32`` / ``float32``; ``"int"`` for integers and bool; fp32 for a dtype not known."""
    name = dtype.lower().removeprefix("torch.")
    if name in _DTYPE_PRESET:
        return _DTYPE_PRESET[name]
    if name.startswith(("int", "uint", "bool")):
        return "int"
    return "fp32"


@dataclass(frozen=True)
class Tolerance:
    """What "agrees" means: ``preset`` None (``rtol``/``atol``, else 1e-5/1e-8, for every dtype), a key of
    :data:`PRESETS`, or ``"auto"`` (each pair by its coarser dtype); an explicit ``rtol``/``atol`` wins."""

    preset: str | None = None
    rtol: float | None = None
    atol: float | None = None

    def __post_init__(self) -> None:
        if self.preset is not None and self.preset != "auto" and self.preset not in PRESETS:
            raise ValueError(f"tolerance preset must be 'auto' or one of {sorted(PRESETS)} (got {self.preset!r})")

    def of(self, dtype_a: str, dtype_b: str) -> tuple[float, float]:
        """``(rtol, atol)`` for a pair of tensors of these dtypes."""
        if self.preset is None:
            rtol, atol = DEFAULT_RTOL, DEFAULT_ATOL
        elif self.preset == "auto":
            coarser = max(_preset_of(dtype_a), _preset_of(dtype_b), key=_COARSENESS.index)
            rtol, atol = PRESETS[coarser]
        else:
            rtol, atol = PRESETS[self.preset]
        return (rtol if self.rtol is None else self.rtol), (atol if self.atol is None else self.atol)

    def describe(self) -> str:
        parts = [f"preset {self.preset}"] if self.preset else []
        if self.preset is None or self.rtol is not None:
            parts.append(f"rtol={DEFAULT_RTOL if self.rtol is None else self.rtol:g}")
        if self.preset is None or self.atol is not None:
            parts.append(f"atol={DEFAULT_ATOL if self.atol is None else self.atol:g}")
        return ", ".join(parts)


#: the metrics of a tensor pair and of an op (fields of :class:`DiffMetrics` and ``OpDiff``), as every report names them
METRIC_LABELS = {"max_abs": "max abs", "max_rel": "max rel", "cosine": "cosine", "mean_rel": "mean rel",
                 "l2_rel": "l2 rel"}


class DiffMetrics(NamedTuple):
    """The distance of A from B; None where it cannot be had (a cosine from statistics, an empty tensor)."""

    within: bool
    max_abs: float | None = None
    max_rel: float | None = None
    cosine: float | None = None
    mean_rel: float | None = None
    l2_rel: float | None = None
    what: str = ""  #: what first fell outside the tolerance: "values", a statistic ("max"), "" when within
    a: Any = None  #: A's value of ``what`` (a statistic's, or a summary of the values)
    b: Any = None


EXACT = DiffMetrics(True, 0.0, 0.0, None, 0.0, 0.0)


def number(value: Any) -> float | str | None:
    """A statistic as a float (``"0.5"``, ``"nan"``, ``3``), None for ``null``/empty, the text itself otherwise
    (an MD5)."""
    if value is None or isinstance(value, float):
        return value
    if isinstance(value, (int, np.integer, np.floating)):
        return float(value)
    text = str(value)
    if text in ("", "null"):
        return None
    try:
        return float(text)
    except ValueError:
        return text


def close(a: float | str | None, b: float | str | None, rtol: float, atol: float) -> bool:
    """``|a - b| <= atol + rtol * |b|``; NaN agrees with NaN, an infinity with itself, None with None, text with
    the same text."""
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= atol + rtol * abs(b)


def _gap(a: float, b: float) -> float:
    """``|a - b|``: 0 for NaN and NaN or the same infinity, infinite for NaN or an infinity on one side."""
    if a == b or (math.isnan(a) and math.isnan(b)):
        return 0.0
    gap = abs(a - b)
    return math.inf if math.isnan(gap) or math.isinf(a) or math.isinf(b) else gap


def _rel(a: float, b: float) -> float:
    gap = _gap(a, b)
    if gap == 0:
        return 0.0
    return gap / abs(b) if b != 0 and not math.isinf(gap) else math.inf


def statistic_metrics(keys: list[str], values_a: list[Any], values_b: list[Any], rtol: float,
                      atol: float) -> DiffMetrics:
    """Two rows' statistics (``keys[i]`` names ``values_a[i]`` and ``values_b[i]``, raw text or numbers)."""
    what, va, vb = "", None, None
    max_abs = max_rel = 0.0
    mean_rel = l2_rel = None
    for key, raw_a, raw_b in zip(keys, values_a, values_b):
        a, b = number(raw_a), number(raw_b)
        if not what and not close(a, b, rtol, atol):
            what, va, vb = key, a, b
        if not isinstance(a, float) or not isinstance(b, float):
            continue
        rel = _rel(a, b)
        if key in _EXTREMES:
            max_abs, max_rel = max(max_abs, _gap(a, b)), max(max_rel, rel)
        if key == "avg":
            mean_rel = rel
        elif key == "l2norm":
            l2_rel = rel
    return DiffMetrics(not what, max_abs, max_rel, None, mean_rel, l2_rel, what, va, vb)


_EXTREMES = ("max", "min", "avg")  # the statistics in the tensor's own units: their gaps bound max |a - b| from below


def statistic_metrics_many(keys: list[str], va: np.ndarray, vb: np.ndarray, ca: np.ndarray, cb: np.ndarray,
                           text_same: np.ndarray, rtol: np.ndarray, atol: np.ndarray) -> list[DiffMetrics]:
    """:func:`statistic_metrics` of many pairs of rows at once: ``va``/``vb`` their statistics as floats (rows ×
    ``keys``), ``ca``/``cb`` what each cell holds (0 a number, 1 null, 2 text), ``text_same`` whether two text
    cells are the same text, ``rtol``/``atol`` each pair's tolerance.  A and B of a differing cell are floats, or
    None for null and NaN for text."""
    if not len(va):
        return []
    number_both = (ca == 0) & (cb == 0)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        both_nan = np.isnan(va) & np.isnan(vb)
        same = (va == vb) | both_nan
        finite = np.isfinite(va) & np.isfinite(vb)
        gap = np.where(same, 0.0, np.where(finite, np.abs(va - vb), np.inf))
        ok_number = same | (finite & (gap <= atol[:, None] + rtol[:, None] * np.abs(vb)))
        rel = np.where(gap == 0, 0.0, np.where((vb != 0) & np.isfinite(gap), gap / np.abs(vb), np.inf))
    ok = np.where(number_both, ok_number, ((ca == 1) & (cb == 1)) | ((ca == 2) & (cb == 2) & text_same))
    within = ok.all(axis=1)
    bad = np.argmax(~ok, axis=1)
    gap = np.where(number_both, gap, 0.0)
    rel = np.where(number_both, rel, 0.0)
    extremes = [k for k, key in enumerate(keys) if key in _EXTREMES]
    max_abs = gap[:, extremes].max(axis=1) if extremes else np.zeros(len(va))
    max_rel = rel[:, extremes].max(axis=1) if extremes else np.zeros(len(va))

    def column(key: str) -> list[float | None]:
        if key not in keys:
            return [None] * len(va)
        k = keys.index(key)
        return [float(r) if n else None for r, n in zip(rel[:, k], number_both[:, k])]

    means, norms = column("avg"), column("l2norm")
    out = []
    for r, (inside, k) in enumerate(zip(within.tolist(), bad.tolist())):
        if inside:
            out.append(DiffMetrics(True, float(max_abs[r]), float(max_rel[r]), None, means[r], norms[r]))
        else:
            a = None if ca[r, k] == 1 else float(va[r, k])
            b = None if cb[r, k] == 1 else float(vb[r, k])
            out.append(DiffMetrics(False, float(max_abs[r]), float(max_rel[r]), None, means[r], norms[r], keys[k], a,
                                   b))
    return out


def _flat_real(x: np.ndarray) -> np.ndarray:
    flat = x.reshape(-1)
    if flat.dtype.kind == "c":
        return flat.view(flat.real.dtype)  # real and imaginary parts side by side
    return flat


def tensor_metrics(xa: np.ndarray, xb: np.ndarray, rtol: float, atol: float) -> DiffMetrics:
    """Two arrays of one shape, elementwise, a chunk at a time."""
    if xa.dtype == xb.dtype and xa.dtype.kind not in "fc" and np.array_equal(xa, xb):
        return DiffMetrics(True, 0.0, 0.0, 1.0 if xa.size else None, 0.0, 0.0)
    fa, fb = _flat_real(xa), _flat_real(xb)
    within = True
    max_abs = max_rel = 0.0
    dot = sa2 = sb2 = sum_a = sum_b = 0.0
    for start in range(0, fa.size, _CHUNK):
        with np.errstate(invalid="ignore"):  # a signalling NaN stays a NaN in float64, and numpy warns of it
            a = fa[start:start + _CHUNK].astype(np.float64)
            b = fb[start:start + _CHUNK].astype(np.float64)
        if within and not np.isclose(a, b, rtol=rtol, atol=atol, equal_nan=True).all():
            within = False
        finite = np.isfinite(a) & np.isfinite(b)
        same_special = ~finite & ((a == b) | (np.isnan(a) & np.isnan(b)))
        if not (finite | same_special).all():
            max_abs = max_rel = math.inf  # a NaN or an infinity on one side only
        if not finite.all():
            a, b = a[finite], b[finite]
        if a.size:
            gap = np.abs(a - b)
            max_abs = max(max_abs, float(gap.max()))
            size_b = np.abs(b)
            nonzero = size_b > 0
            if (gap[~nonzero] > 0).any():
                max_rel = math.inf
            if nonzero.any():
                max_rel = max(max_rel, float((gap[nonzero] / size_b[nonzero]).max()))
            dot += float(a @ b)
            sa2 += float(a @ a)
            sb2 += float(b @ b)
            sum_a += float(a.sum())
            sum_b += float(b.sum())
    count = fa.size
    if sa2 == 0 and sb2 == 0:
        cosine = 1.0 if count else None
    elif sa2 == 0 or sb2 == 0:
        cosine = 0.0
    else:
        cosine = max(-1.0, min(1.0, dot / math.sqrt(sa2 * sb2)))
    mean_rel = _rel(sum_a / count, sum_b / count) if count else 0.0
    l2_rel = _rel(math.sqrt(sa2), math.sqrt(sb2))
    if within:
        return DiffMetrics(True, max_abs, max_rel, cosine, mean_rel, l2_rel)
    return DiffMetrics(False, max_abs, max_rel, cosine, mean_rel, l2_rel, "values", f"max |a-b| = {max_abs:.6g}",
                   f"rtol={rtol:g}, atol={atol:g}")
