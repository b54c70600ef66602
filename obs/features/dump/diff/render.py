"""A :class:`~obs.features.dump.diff.DiffReport` as data (``obs dump diff --json``) and as one self-contained HTML page
(``--html``): inline CSS, an inline SVG plot of the error against the op index, a few lines of inline script; nothing
fetched, so the page opens offline.  Pure: a report in, a dict or a string out.
"""

from __future__ import annotations

import html
import math
from typing import Any

from obs.features.dump.diff.metrics import METRIC_LABELS, DiffMetrics
from obs.features.dump.diff.report import DiffReport, OpDiff

__all__ = ["cosine_text", "metric_text", "metrics_text", "number_text", "op_dict", "render_html", "report_dict"]


def _num(value: float | None) -> float | str | None:
    """A float JSON can hold: infinities and NaN as the strings ``"inf"``, ``"-inf"``, ``"nan"``."""
    if value is None or math.isfinite(value):
        return value
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def _plain(value: Any) -> Any:
    if isinstance(value, float):
        return _num(value)
    if isinstance(value, tuple):
        return list(value)
    return value


def _metrics_dict(m: DiffMetrics) -> dict[str, Any]:
    return {"within": m.within, **{k: _num(getattr(m, k)) for k in METRIC_LABELS},
            **({"differs_in": m.what, "a": _plain(m.a), "b": _plain(m.b)} if m.what else {})}


def op_dict(op: OpDiff, *, tensors: bool = True) -> dict[str, Any]:
    """One op as JSON: status, names, metrics, and (``tensors``) each compared input and output."""
    out: dict[str, Any] = {"index": op.index, "rank": op.rank, "iteration": op.iteration, "status": op.status,
                           "op_type": op.op_type, "name_a": op.name_a, "name_b": op.name_b, "phase": op.phase,
                           "parameter": op.parameter, "inputs_agree": op.inputs_agree,
                           "outputs_agree": op.outputs_agree, "source": op.source,
                           **{k: _num(getattr(op, k)) for k in METRIC_LABELS}}
    if tensors:
        out["tensors"] = [{"io": t.io, "slot": t.slot, "source": t.source, "dtype_a": t.dtype_a, "dtype_b": t.dtype_b,
                           **_metrics_dict(t.metrics)} for t in op.tensors]
    return out


def report_dict(report: DiffReport, *, a: str, b: str, top: int) -> dict[str, Any]:
    """The report as one JSON document: the producer, the first ``top`` divergent ops, the inserted and removed ops,
    and the first divergent tensor (``first``, as earlier versions gave it)."""
    tol = report.tolerance
    divergent = report.divergent
    first = report.first
    return {
        "a": a, "b": b,
        "tolerance": {"preset": tol.preset, "rtol": tol.rtol, "atol": tol.atol, "described": tol.describe()},
        "mode": report.mode, "compared": report.compared, "steps": report.steps, "only_in_a": report.only_in_a,
        "only_in_b": report.only_in_b, "ops": len(report.ops), "diverged": report.diverged,
        "producer": op_dict(report.producer) if report.producer else None,
        "divergent_count": len(divergent), "divergent": [op_dict(op) for op in divergent[:top]],
        "inserted": [op_dict(op, tensors=False) for op in report.inserted],
        "removed": [op_dict(op, tensors=False) for op in report.removed],
        "first": None if first is None else {
            "rank": first.rank, "iteration": first.iteration, "index": first.index, "op_type": first.op_type,
            "op_name": first.op_name, "io": first.io, "slot": first.slot, "what": first.what,
            "a": _plain(first.a), "b": _plain(first.b)},
    }


# -- HTML -----------------------------------------------------------------------------------------------------------
_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#1d1d1f;background:#fff}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:24px 0 8px}
.meta{color:#555;margin:0 0 12px}.meta code{background:#f3f3f3;padding:1px 4px;border-radius:3px}
.card{border:1px solid #ddd;border-left:6px solid #c62828;border-radius:6px;padding:10px 14px;max-width:1100px}
.card.ok{border-left-color:#2e7d32}.card b{font-family:ui-monospace,monospace;word-break:break-all}
table{border-collapse:collapse;font-size:12px;width:100%}
th,td{border-bottom:1px solid #eee;padding:3px 6px;text-align:right;white-space:nowrap}
th{position:sticky;top:0;background:#fafafa}td.name,th.name{text-align:left;white-space:normal;word-break:break-all}
td.param{text-align:left;font-family:ui-monospace,monospace}
tr.producer td{background:#ffe0e0;font-weight:600}tr.carried td{background:#fff4e5}
tr.absorbed td{background:#f3f7ff}tr.inserted td,tr.removed td{color:#777;font-style:italic}
.hide-same tr.same{display:none}.tag{border-radius:3px;padding:0 4px;font-size:11px}
ul.ops{font-family:ui-monospace,monospace;font-size:12px;max-height:240px;overflow:auto}
svg text{font:11px system-ui,sans-serif}
"""

_SCRIPT = """
document.getElementById('only').addEventListener('change', function (e) {
  document.getElementById('ops').classList.toggle('hide-same', e.target.checked);
});
"""

_COLORS = {"producer": "#c62828", "carried": "#ef6c00", "absorbed": "#1565c0", "same": "#9e9e9e"}


def cosine_text(value: float | None) -> str:
    """A cosine close to 1 as ``1-2.3e-08``, where its digits would all be nines."""
    if value is None:
        return ""
    return f"1-{1 - value:.2g}" if 0.999 < value < 1 else f"{value:.6g}"


def number_text(value: float | None) -> str:
    """A metric's value in 3 significant digits (``inf``, ``nan``), empty for None."""
    if value is None:
        return ""
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:.3g}"


def metrics_text(op: OpDiff) -> str:
    """``max abs 1e-06, max rel 1e-05, cosine 0.999998 (from tensors)``: the metrics the op has (``from statistics:
    no cosine``)."""
    parts = [f"{label} {metric_text(op, key)}" for key, label in METRIC_LABELS.items() if getattr(op, key) is not None]
    return ", ".join(parts) + f" (from {op.source}" + (": no cosine" if op.cosine is None else "") + ")"


def _error(op: OpDiff) -> float | None:
    return op.max_rel if op.max_rel is not None else op.max_abs


def _plot(report: DiffReport, width: int = 1100, height: int = 260) -> str:
    """An SVG of each aligned op's max relative error (log scale) against its index; the producer marked."""
    ops = report.ops
    left, right, top, bottom = 56, 12, 14, 30
    span = max(len(ops) - 1, 1)
    lo, hi = -12, 3  # log10 of the error, clamped

    def x(i: int) -> float:
        return left + (width - left - right) * i / span

    def y(err: float) -> float:
        v = hi if math.isinf(err) or math.isnan(err) else min(hi, max(lo, math.log10(err) if err > 0 else lo))
        return top + (height - top - bottom) * (hi - v) / (hi - lo)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
             f'aria-label="error against op index">',
             f'<rect x="{left}" y="{top}" width="{width - left - right}" height="{height - top - bottom}" '
             'fill="#fcfcfc" stroke="#ccc"/>']
    for v in range(lo, hi + 1, 3):
        yy = y(10.0 ** v)
        parts.append(f'<line x1="{left}" x2="{width - right}" y1="{yy:.1f}" y2="{yy:.1f}" stroke="#eee"/>'
                     f'<text x="{left - 6}" y="{yy + 4:.1f}" text-anchor="end">1e{v}</text>')
    rtol, _ = report.tolerance.of("float32", "float32")  # a preset's: its float32 tensors'
    if rtol > 0:
        yy = y(rtol)
        parts.append(f'<line x1="{left}" x2="{width - right}" y1="{yy:.1f}" y2="{yy:.1f}" stroke="#c62828" '
                     f'stroke-dasharray="4 3"/><text x="{width - right - 4}" y="{yy - 4:.1f}" text-anchor="end" '
                     f'fill="#c62828">rtol {rtol:g}</text>')
    points = [(op.index, _error(op)) for op in ops if _error(op) is not None]
    if points:
        path = " ".join(f"{x(i):.1f},{y(e):.1f}" for i, e in points)  # type: ignore[arg-type]
        parts.append(f'<polyline points="{path}" fill="none" stroke="#90a4ae" stroke-width="1"/>')
    for op in ops:
        err = _error(op)
        if op.status in ("inserted", "removed"):
            parts.append(f'<line x1="{x(op.index):.1f}" x2="{x(op.index):.1f}" y1="{height - bottom}" '
                         f'y2="{height - bottom + 6}" stroke="#777"><title>{op.status}: '
                         f'{html.escape(op.name)}</title></line>')
        elif err is not None and op.status in ("producer", "carried"):
            r = 5 if op is report.producer else 2.5
            title = f"#{op.index} {op.status}: {html.escape(op.name)} ({number_text(err)})"
            parts.append(f'<circle cx="{x(op.index):.1f}" cy="{y(err):.1f}" r="{r}" fill="{_COLORS[op.status]}">'
                         f'<title>{title}</title></circle>')
    if report.producer is not None and _error(report.producer) is not None:
        p = report.producer
        px, py = x(p.index), y(_error(p))  # type: ignore[arg-type]
        anchor = "end" if px > width / 2 else "start"
        dx = -8 if anchor == "end" else 8
        parts.append(f'<text x="{px + dx:.1f}" y="{py - 6:.1f}" text-anchor="{anchor}" fill="#c62828" '
                     f'font-weight="bold">producer: {html.escape(p.op_type)} #{p.index}</text>')
    parts.append(f'<text x="14" y="{(top + height - bottom) / 2:.0f}" text-anchor="middle" '
                 f'transform="rotate(-90 14 {(top + height - bottom) / 2:.0f})">max rel error</text>')
    parts.append(f'<text x="{(left + width - right) / 2:.0f}" y="{height - 4}" text-anchor="middle">op index '
                 f'(aligned, all steps); ticks below: inserted or removed ops</text></svg>')
    return "".join(parts)


def _row(op: OpDiff, producer: OpDiff | None = None) -> str:
    name = html.escape(op.name_a or "")
    if op.name_b and (op.renamed or not op.name_a):
        name = (name + "<br>" if name else "") + "B: " + html.escape(op.name_b)
    ident = ' id="producer"' if op is producer else ""
    parameter = op.parameter if op.parameter and op.op_type != "Parameter" else ""
    cells = [str(op.index), str(op.iteration), op.status, html.escape(op.op_type)]
    return (f'<tr class="{op.status}"{ident}>' + "".join(f"<td>{c}</td>" for c in cells) +
            f'<td class="name">{name}</td><td class="param">{html.escape(parameter)}</td>'
            f"<td>{op.source or ''}</td>" + "".join(f"<td>{metric_text(op, k)}</td>" for k in METRIC_LABELS) + "</tr>")


def metric_text(op: OpDiff, key: str) -> str:
    """One metric of ``op`` (a key of :data:`~obs.features.dump.diff.metrics.METRIC_LABELS`) as a table shows it."""
    return cosine_text(op.cosine) if key == "cosine" else number_text(getattr(op, key))


def render_html(report: DiffReport, *, a: str, b: str, top: int = 10) -> str:
    """One page: the producer, then the first ``top`` divergent ops; a plot of the error against the op index; the
    inserted and removed ops; a table with one row per aligned op (the producer's: ``id="producer"``)."""
    p = report.producer
    divergent = report.divergent
    inserted, removed = report.inserted, report.removed
    if p is not None:
        card = (f'<div class="card"><div>producer (the first op whose inputs agree and whose outputs do not): '
                f'<b>{html.escape(p.name)}</b></div><div>type {html.escape(p.op_type)}, iteration {p.iteration}, '
                f'rank {p.rank}, op #{p.index}' +
                (f", updates parameter <b>{html.escape(p.parameter)}</b>" if p.parameter and
                 p.op_type != "Parameter" else "") +
                f"; {metrics_text(p)}</div><div>{len(divergent)} divergent ops: "
                f'{sum(op.status == "producer" for op in divergent)} producing, '
                f'{sum(op.status == "carried" for op in divergent)} carrying a difference on. '
                '<a href="#producer">its row</a></div></div>')
    elif divergent:
        card = (f'<div class="card">no producer: the first divergent op, <b>{html.escape(divergent[0].name)}</b>, '
                'has inputs that already differ (made by an op not dumped, or not paired)</div>')
    else:
        card = '<div class="card ok">no divergence beyond the tolerance</div>'

    def listing(ops: list[OpDiff]) -> str:
        if not ops:
            return "<p>none</p>"
        return '<ul class="ops">' + "".join(f"<li>iteration {op.iteration}: {html.escape(op.name)}</li>"
                                           for op in ops) + "</ul>"

    head = "".join(f"<th>{c}</th>" for c in ("#", "iter", "status", "type")) + \
        '<th class="name">op (A; B where it differs)</th><th class="name">updates</th><th>from</th>' + \
        "".join(f"<th>{c}</th>" for c in METRIC_LABELS.values())
    body = "\n".join(_row(op, p) for op in report.ops)
    firsts = (f"<h2>first divergences ({min(top, len(divergent))} of {len(divergent)})</h2>"
              f'<table class="first"><thead><tr>{head}</tr></thead><tbody>' +
              "".join(_row(op) for op in divergent[:top]) + "</tbody></table>") if divergent else ""
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>obs dump diff</title>
<meta name="viewport" content="width=device-width, initial-scale=1"><style>{_CSS}</style></head>
<body>
<h1>obs dump diff</h1>
<p class="meta">A <code>{html.escape(a)}</code> against B <code>{html.escape(b)}</code> (the reference);
{report.compared} tensors of {len(report.steps)} step(s) compared by {report.mode};
tolerance {html.escape(report.tolerance.describe())}; {len(report.ops)} ops aligned,
{len(inserted)} inserted (only in B), {len(removed)} removed (only in A).</p>
{card}
{firsts}
<h2>error against op index</h2>
{_plot(report)}
<h2>inserted (only in B): {len(inserted)}</h2>
{listing(inserted)}
<h2>removed (only in A): {len(removed)}</h2>
{listing(removed)}
<h2>ops</h2>
<label><input type="checkbox" id="only"> only divergent, absorbed, inserted and removed ops</label>
<table id="ops"><thead><tr>{head}</tr></thead>
<tbody>
{body}
</tbody></table>
<script>{_SCRIPT}</script>
</body></html>
"""
