"""`obs monitor plot --html`: the page is self-contained, states the first anomaly, marks the anomalies on the
heatmaps and the curves, and bins a long run without losing a spike.  A made-up run folder, in-process; the page in a
headless browser, on real training: tests/obs/features/monitor/test_training.py."""

from __future__ import annotations

import json
import math
import re

from obs.features.monitor.explain import explain
from obs.features.monitor.plot import ZERO, build_plot
from obs.features.monitor.plot_html import render_html
from obs.features.monitor.reader import read_run
from tests.obs.cli.test_cli import obs_cli

NAMES = ("fc1.weight", "fc1.bias", "fc2.weight")


def _run(tmp_path, steps=80):
    """Three parameters: fc1.weight's update ratio jumps at step 45 (the first anomaly), fc2.weight's gradient at 50,
    fc1.bias's gradient is 0 at 60, fc2.weight's ratio is NaN at 70; the loss jumps at 52."""
    folder = tmp_path / "out" / "Nov29_10-00-00-rank0-0a1b2c3d"
    folder.mkdir(parents=True)
    grads, ratios, scalars = ["vpp_stage,name,step,norm,shape,dtype"], ["vpp_stage,name,step,ratio"], [
        "vpp_stage,name,step,value"]
    for s in range(steps):
        for i, n in enumerate(NAMES):
            wiggle = 1 + 0.01 * ((s * 7 + i * 3) % 5)
            g = 40.0 if (s, n) == (50, "fc2.weight") else 0.0 if (s, n) == (60, "fc1.bias") else wiggle
            r = 0.5 if (s, n) == (45, "fc1.weight") else math.nan if (s, n) == (70, "fc2.weight") else 0.01 * wiggle
            grads.append(f'0,{n},{s},{g},"[2, 2]",torch.float32')
            ratios.append(f"0,{n},{s},{r}")
        scalars += [f"0,loss,{s},{2.0 - 0.01 * s + (3.0 if s == 52 else 0.0)}", f"0,grad_norm,{s},{1 + 0.01 * (s % 3)}"]
    for name, lines in (("grad_reduced", grads), ("update_ratio", ratios), ("scalars", scalars)):
        (folder / f"{name}_0-99.csv").write_text("\n".join(lines) + "\n")
    return folder


def _data(text):
    return json.loads(re.search(r'<script type="application/json" id="plot-data">(.*?)</script>', text).group(1)
                      .replace("<\\/", "</"))


def test_the_page_is_self_contained_and_states_and_marks_the_first_anomaly(tmp_path):
    folder = _run(tmp_path)
    page = tmp_path / "page.html"
    result = obs_cli("monitor", "plot", str(tmp_path / "out"), "--html", str(page))
    assert result.returncode == 0 and "wrote monitor plot" in result.stderr and str(page) in result.stderr
    text = page.read_text()
    run = read_run(str(folder))
    assert text == render_html(build_plot(run, explain(run)))
    # nothing fetched: no stylesheet, script or image from elsewhere (the one URL is the SVG namespace)
    assert not re.search(r"<link|<img|src=|@import|url\(", text)
    assert set(re.findall(r"https?://[^\s\"'<>]+", text)) == {"http://www.w3.org/2000/svg"}
    card = re.search(r'<div class="card" id="first" data-step="45" data-name="fc1.weight">(.*?)</div>', text)
    assert card and "ur fc1.weight update_ratio/ratio = 0.5" in card.group(1)
    assert "the loss left its history at step 52, 7 step(s) later" in card.group(1)
    data = _data(text)
    heatmaps = {h["prefix"]: h for h in data["heatmaps"]}
    assert list(heatmaps) == ["grad_reduced", "update_ratio"]  # backward, then the optimizer
    ratio = heatmaps["update_ratio"]
    assert ratio["rows"] == list(NAMES) and len(ratio["columns"]) == 80 and ratio["columns"][45] == [45, 45]
    assert [0, 45, 0] in ratio["marks"]  # row fc1.weight, column of step 45, the first anomaly
    assert ratio["cells"][0][45] == round(math.log10(0.5), 3) and ratio["cells"][2][70] == "nan"
    grads = heatmaps["grad_reduced"]
    assert grads["cells"][1][60] == "zero" and grads["high"] == math.log10(40.0)
    marked = {(data["anomalies"][m[2]]["step"], grads["rows"][m[0]]) for m in grads["marks"]}
    assert {(50, "fc2.weight"), (60, "fc1.bias")} <= marked
    # the curves: the loss's own anomaly circled, every anomaly's step a line, the first one's in bold
    loss = re.search(r'<svg[^>]*id="curve-loss">.*?</svg>', text).group(0)
    assert re.search(r'<circle class="curve-anomaly" data-step="52"', loss)
    assert re.search(r'<line class="anomaly-step first" data-step="45"', loss)
    assert 'id="curve-grad_norm"' in text and '<table id="anomalies">' in text


def test_a_long_run_is_binned_and_keeps_its_spike_and_its_nan(tmp_path):
    run = read_run(str(_run(tmp_path)))
    plot = build_plot(run, explain(run), max_columns=10)
    ratio = next(h for h in plot.heatmaps if h.prefix == "update_ratio")
    assert ratio.columns == [(s, s + 7) for s in range(0, 80, 8)]
    assert ratio.cells[0][5] == math.log10(0.5)  # step 45 in column 5: the bin's largest value
    assert math.isnan(ratio.cells[2][8])  # step 70's NaN wins its bin
    first = next(m for m in ratio.marks if m.anomaly == 0)
    assert (first.row, first.column) == (0, 5)
    loss = next(c for c in plot.curves if c.name == "loss")
    assert len(loss.steps) == 10 and 52 in loss.steps and max(loss.values) > 4
    assert ZERO not in [v for line in ratio.cells for v in line]


def test_bad_input_is_a_clear_error(tmp_path):
    _run(tmp_path)
    page = tmp_path / "page.html"
    result = obs_cli("monitor", "plot", str(tmp_path / "out"), "--html", str(page), "--columns", "0")
    assert result.returncode == 2 and "--columns must be at least 1 (got 0)" in result.stderr
    (tmp_path / "empty").mkdir()
    result = obs_cli("monitor", "plot", str(tmp_path / "empty"), "--html", str(page))
    assert result.returncode == 2 and "no monitor run under" in result.stderr and not page.exists()


def test_a_quiet_run_says_no_anomaly_and_escapes_what_it_shows(tmp_path):
    """No anomaly: the card says so and nothing is marked; a name that looks like markup stays text."""
    folder = tmp_path / "Nov29_10-00-00-rank0-0a1b2c3d"
    folder.mkdir()
    name = "</script><b>x"
    (folder / "grad_reduced_0-99.csv").write_text("vpp_stage,name,step,norm,shape,dtype\n" + "".join(
        f'0,"{name}",{s},{1 + 0.01 * (s % 3)},"[2]",torch.float32\n' for s in range(30)))
    run = read_run(str(folder))
    text = render_html(build_plot(run, explain(run)))
    assert '<div class="card ok" id="first">no anomaly' in text
    assert text.count("</script>") == 2 and "<\\/script><b>x" in text  # the name cannot end the page's data
    data = _data(text)
    assert data["heatmaps"][0]["rows"] == [name] and data["heatmaps"][0]["marks"] == [] and data["anomalies"] == []
