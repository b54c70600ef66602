"""A :class:`~obs.features.monitor.plot.Plot` as one self-contained HTML page (``obs monitor plot --html``): inline CSS,
the curves as inline SVG, the heatmaps drawn on canvases by a short inline script from the page's own JSON; nothing
fetched, so the page opens offline.  Pure: a plot in, a string out.

The script marks the page when it is done (``<body data-rendered="1">``, each heatmap's canvas ``data-cells``) and
writes any script error into ``<body data-errors>``, which a headless browser's DOM dump shows.
"""

from __future__ import annotations

import html
import json
import math
from typing import Any

from obs.features.monitor.explain import Finding
from obs.features.monitor.plot import Curve, Heatmap, Plot

__all__ = ["finding_text", "render_html"]

_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#1d1d1f;background:#fff}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:24px 0 6px}
.meta{color:#555;margin:0 0 12px}.meta code{background:#f3f3f3;padding:1px 4px;border-radius:3px}
.card{border:1px solid #ddd;border-left:6px solid #c62828;border-radius:6px;padding:10px 14px;max-width:1100px}
.card.ok{border-left-color:#2e7d32}.card b{font-family:ui-monospace,monospace;word-break:break-all}
.heatmap{position:relative;display:inline-block}.heatmap svg{position:absolute;left:0;top:0;pointer-events:none}
.heatmap canvas{display:block}.legend{color:#555;font-size:12px;margin:2px 0 4px}
.tip{position:fixed;background:#222;color:#fff;font:12px ui-monospace,monospace;padding:3px 6px;border-radius:3px;
display:none;pointer-events:none;z-index:9}
table{border-collapse:collapse;font-size:12px}th,td{border-bottom:1px solid #eee;padding:3px 8px;text-align:left}
td.num{text-align:right;font-family:ui-monospace,monospace}tr.first td{background:#fdecea;font-weight:600}
svg text{font:11px system-ui,sans-serif}
"""

# Draws each heatmap from the page's JSON: a cell's colour is its log10 |value| on the heatmap's range (viridis),
# grey for zeros, magenta for a non-finite value; each anomaly is a red box in an SVG laid over the canvas.
_SCRIPT = """
(function(){
  var body=document.body;
  window.addEventListener('error',function(e){body.setAttribute('data-errors',(body.getAttribute('data-errors')||'')
    +String(e.message)+';');});
  var data=JSON.parse(document.getElementById('plot-data').textContent);
  var stops=[[68,1,84],[59,82,139],[33,145,140],[94,201,98],[253,231,37]];
  function colour(t){t=Math.max(0,Math.min(1,t));var x=t*(stops.length-1),i=Math.min(Math.floor(x),stops.length-2),
    f=x-i,a=stops[i],b=stops[i+1];return 'rgb('+[0,1,2].map(function(k){return Math.round(a[k]+(b[k]-a[k])*f);})
    .join(',')+')';}
  var NS='http://www.w3.org/2000/svg',tip=document.getElementById('tip'),L=data.label_width;
  data.heatmaps.forEach(function(h,k){
    var box=document.getElementById('heatmap-'+k),canvas=box.querySelector('canvas'),ctx=canvas.getContext('2d');
    var nr=h.rows.length,nc=h.columns.length,cw=Math.max(2,Math.floor(data.width/Math.max(1,nc))),
      ch=Math.max(3,Math.min(14,Math.floor(560/Math.max(1,nr))));
    canvas.width=L+nc*cw+24;canvas.height=nr*ch+22;
    ctx.fillStyle='#fff';ctx.fillRect(0,0,canvas.width,canvas.height);
    var span=h.high-h.low||1,drawn=0;
    for(var r=0;r<nr;r++){var line=h.cells[r];for(var c=0;c<nc;c++){var v=line[c];if(v===null)continue;
      ctx.fillStyle=v==='nan'?'#e0f':(v==='zero'?'#bbb':colour((v-h.low)/span));
      ctx.fillRect(L+c*cw,r*ch,cw,ch);drawn++;}}
    ctx.fillStyle='#333';ctx.font=Math.min(11,ch+1)+'px system-ui,sans-serif';ctx.textAlign='right';
    ctx.textBaseline='middle';var every=Math.max(1,Math.ceil(11/ch));
    for(r=0;r<nr;r+=every){ctx.fillText(h.rows[r].slice(-34),L-4,r*ch+ch/2);}
    ctx.textAlign='center';ctx.textBaseline='top';var ticks=Math.max(1,Math.floor(nc*cw/90));
    for(var t=0;t<=ticks;t++){c=Math.min(nc-1,Math.round(t*(nc-1)/ticks));
      ctx.fillText(String(h.columns[c][0]),L+c*cw+cw/2,nr*ch+5);}
    var svg=document.createElementNS(NS,'svg');svg.setAttribute('width',canvas.width);
    svg.setAttribute('height',canvas.height);
    h.marks.forEach(function(m){var a=data.anomalies[m[2]],w=Math.max(cw+2,6),x=L+m[1]*cw+cw/2-w/2;
      var box2=document.createElementNS(NS,'rect');box2.setAttribute('x',x);box2.setAttribute('y',m[0]*ch-1);
      box2.setAttribute('width',w);box2.setAttribute('height',ch+2);
      box2.setAttribute('class',m[2]===0?'mark first':'mark');box2.setAttribute('fill','none');
      box2.setAttribute('stroke',m[2]===0?'#d00':'#f44');box2.setAttribute('stroke-width',m[2]===0?2:1);
      box2.setAttribute('data-step',a.step);box2.setAttribute('data-name',a.name);
      var title=document.createElementNS(NS,'title');title.textContent=a.text;box2.appendChild(title);
      svg.appendChild(box2);});
    box.appendChild(svg);canvas.setAttribute('data-cells',String(drawn));
    canvas.addEventListener('mousemove',function(e){var rect=canvas.getBoundingClientRect(),
      c=Math.floor((e.clientX-rect.left-L)/cw),r=Math.floor((e.clientY-rect.top)/ch);
      if(c<0||c>=nc||r<0||r>=nr){tip.style.display='none';return;}
      var v=h.cells[r][c],col=h.columns[c];
      tip.textContent=h.rows[r]+' steps '+col[0]+(col[1]!==col[0]?'-'+col[1]:'')+': '+(v===null?'-':v==='nan'?
        'not finite':v==='zero'?'0':Math.pow(10,v).toPrecision(4));
      tip.style.display='block';tip.style.left=(e.clientX+12)+'px';tip.style.top=(e.clientY+12)+'px';});
    canvas.addEventListener('mouseleave',function(){tip.style.display='none';});
  });
  body.setAttribute('data-rendered','1');
})();
"""


def _num(value: float | None) -> str:
    if value is None:
        return "-"
    return "nan" if math.isnan(value) else f"{value:.4g}"


def finding_text(f: Finding) -> str:
    """One anomaly in a line, as ``obs monitor explain`` says it."""
    where = f"rank {f.rank}, " if f.rank is not None else ""
    name = f.name if f.micro_step is None else f"{f.name} (call {f.micro_step})"
    return (f"step {f.step} ({where}{f.stage}): {f.kind} {name} {f.series}/{f.stat} = {_num(f.value)}, baseline "
            f"{_num(f.baseline)} ({f.rule})")


def _cell(value: float | None) -> Any:
    if value is None:
        return None
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "zero"
    return round(value, 3)


def _data(plot: Plot, width: int) -> dict[str, Any]:
    return {
        "width": width, "label_width": 230,
        "anomalies": [{"step": a.step, "name": a.name, "text": finding_text(a)} for a in plot.anomalies],
        "heatmaps": [{"prefix": h.prefix, "rows": h.rows, "columns": [list(c) for c in h.columns],
                      "cells": [[_cell(v) for v in line] for line in h.cells], "low": h.low, "high": h.high,
                      "marks": [[m.row, m.column, m.anomaly] for m in h.marks]} for h in plot.heatmaps],
    }


def _curve_svg(curve: Curve, plot: Plot, *, log: bool, width: int = 1100, height: int = 220) -> str:
    pad_l, pad_r, pad_t, pad_b = 60, 10, 10, 24
    points = [(s, v) for s, v in zip(curve.steps, curve.values) if math.isfinite(v) and (v > 0 or not log)]
    every = list(curve.steps) + plot.anomaly_steps
    lo_s, hi_s = (min(every), max(every)) if every else (0, 1)

    def y_of(v: float) -> float:
        return math.log10(v) if log else v

    ys = [y_of(v) for _, v in points]
    lo, hi = (min(ys), max(ys)) if ys else (0.0, 1.0)
    span_s, span_y = (hi_s - lo_s) or 1, (hi - lo) or 1.0

    def x(step: int) -> float:
        return pad_l + (step - lo_s) / span_s * (width - pad_l - pad_r)

    def y(v: float) -> float:
        return pad_t + (1 - (y_of(v) - lo) / span_y) * (height - pad_t - pad_b)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
             f'class="curve" id="curve-{html.escape(curve.name)}">',
             f'<rect x="{pad_l}" y="{pad_t}" width="{width - pad_l - pad_r}" height="{height - pad_t - pad_b}" '
             'fill="#fafafa" stroke="#ddd"/>']
    first = plot.first.step if plot.first is not None else None
    for step in plot.anomaly_steps:
        cls, colour = ("anomaly-step first", "#d00") if step == first else ("anomaly-step", "#f9a")
        parts.append(f'<line class="{cls}" data-step="{step}" x1="{x(step):.1f}" x2="{x(step):.1f}" y1="{pad_t}" '
                     f'y2="{height - pad_b}" stroke="{colour}" stroke-width="{2 if step == first else 1}"/>')
    if points:
        path = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in points)
        parts.append(f'<polyline points="{path}" fill="none" stroke="#1565c0" stroke-width="1.2"/>')
    values = dict(zip(curve.steps, curve.values))
    for a in plot.anomalies:
        if a.series == "scalars" and a.name == curve.name and a.step in values:
            v = values[a.step]
            if math.isfinite(v) and (v > 0 or not log):
                parts.append(f'<circle class="curve-anomaly" data-step="{a.step}" cx="{x(a.step):.1f}" '
                             f'cy="{y(v):.1f}" r="4" fill="none" stroke="#d00" stroke-width="1.5">'
                             f'<title>{html.escape(finding_text(a))}</title></circle>')
    label = (lambda v: f"{10 ** v:.3g}") if log else (lambda v: f"{v:.3g}")
    parts += [f'<text x="{pad_l - 4}" y="{pad_t + 10}" text-anchor="end">{label(hi)}</text>',
              f'<text x="{pad_l - 4}" y="{height - pad_b}" text-anchor="end">{label(lo)}</text>',
              f'<text x="{pad_l}" y="{height - 6}">step {lo_s}</text>',
              f'<text x="{width - pad_r}" y="{height - 6}" text-anchor="end">step {hi_s}</text></svg>']
    return "".join(parts)


def _heading(plot: Plot) -> str:
    if plot.first is None:
        return (f'<div class="card ok" id="first">no anomaly (rules: {html.escape(", ".join(plot.rules))})'
                "</div>")
    f = plot.first
    loss = (f"the loss left its history at step {plot.loss_step}, {plot.lead_steps} step(s) later"
            if plot.loss_step is not None else "the loss did not leave its history after it")
    return (f'<div class="card" id="first" data-step="{f.step}" data-name="{html.escape(f.name)}">first anomaly: '
            f"<b>{html.escape(finding_text(f))}</b><br>{html.escape(loss)}; {len(plot.anomalies)} anomalies in "
            "all</div>")


def _table(plot: Plot, limit: int) -> str:
    rows = []
    for i, a in enumerate(plot.anomalies[:limit]):
        name = a.name if a.micro_step is None else f"{a.name} (call {a.micro_step})"
        cls = ' class="first"' if i == 0 else ""
        rows.append(f'<tr{cls}><td class="num">{a.step}</td>'
                    f"<td>{a.stage}</td><td>{html.escape(a.kind)}</td><td>{html.escape(name)}</td>"
                    f"<td>{html.escape(a.series)}/{html.escape(a.stat)}</td><td class=\"num\">{_num(a.value)}</td>"
                    f'<td class="num">{_num(a.baseline)}</td><td>{html.escape(a.rule)}</td></tr>')
    more = (f"<p class=\"meta\">... {len(plot.anomalies) - limit} more (obs monitor explain --json)</p>"
            if len(plot.anomalies) > limit else "")
    return ("<table id=\"anomalies\"><tr><th>step</th><th>stage</th><th>kind</th><th>name</th><th>series/stat</th>"
            "<th>value</th><th>baseline</th><th>rule</th></tr>" + "".join(rows) + "</table>" + more)


def _heatmap_html(k: int, h: Heatmap) -> str:
    return (f'<h2>{html.escape(h.kind)}: {html.escape(h.title)} ({html.escape(h.prefix)}/{html.escape(h.stat)})</h2>'
            f'<div class="legend">log10 |value| from {h.low:.3g} (dark) to {h.high:.3g} (yellow); grey: 0; magenta: '
            f"not finite; red boxes: anomalies ({len(h.marks)}); {len(h.rows)} rows × {len(h.columns)} columns"
            f'</div><div class="heatmap" id="heatmap-{k}" data-prefix="{html.escape(h.prefix)}">'
            f'<canvas width="10" height="10"></canvas></div>')


def render_html(plot: Plot, *, width: int = 860, limit: int = 50) -> str:
    """The page: the first anomaly at the top, the loss and gradient-norm curves, a heatmap per series kind, the
    anomalies in causal order (the first ``limit``)."""
    data = json.dumps(_data(plot, width), separators=(",", ":"), allow_nan=False).replace("</", "<\\/")
    curves = "".join(f"<h2>{'loss' if c.name == 'loss' else 'global gradient norm (log scale)'}</h2>"
                     + _curve_svg(c, plot, log=c.name != "loss") for c in plot.curves)
    problems = "".join(f'<p class="meta">{html.escape(p)}</p>' for p in plot.problems)
    rank = f" (rank {plot.rank})" if plot.rank is not None else ""
    return ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>obs monitor: "
            f"{html.escape(plot.folder)}</title><style>{_CSS}</style></head><body>"
            f"<h1>Training health{rank}</h1><p class=\"meta\"><code>{html.escape(plot.folder)}</code></p>"
            f"{problems}{_heading(plot)}{curves}"
            + "".join(_heatmap_html(k, h) for k, h in enumerate(plot.heatmaps))
            + f"<h2>Anomalies in causal order</h2>{_table(plot, limit)}<div class=\"tip\" id=\"tip\"></div>"
            f'<script type="application/json" id="plot-data">{data}</script><script>{_SCRIPT}</script>'
            "</body></html>")
