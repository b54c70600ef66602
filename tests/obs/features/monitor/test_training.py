"""The monitor on real training: a tiny GPT-2-style model trained 300 steps with AdamW, block 1's MLP given 50 times
its learning rate for 3 steps at step 200, explained after the fact; a bad batch in a small MLP; the loss as it was.

One module-scoped run of each (in-process, one thread: about 2-3 s of CPU for the GPT with and without the monitor).
"""

from __future__ import annotations

import io
import json
import math
import re
import sys

import pytest
import torch

import obs
from obs._core.internal import internal_error_counts, set_raise_internal_errors
from obs.cli import main
from obs.features.monitor.explain import explain, movers
from obs.features.monitor.feature import feature
from obs.features.monitor.plot import build_plot
from obs.features.monitor.reader import find_run, read_run
from obs.runtime.steps import tracker
from tests.obs.features.monitor.gpt import GPT, batches

pytestmark = pytest.mark.slow

STEPS, SPIKE = 300, 200


def _gpt_run(data, *, spike_at: int | None, config: str | None) -> list[float]:
    torch.manual_seed(0)
    model = GPT()
    mlp = [p for n, p in model.named_parameters() if n.startswith("h.1.mlp.")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("h.1.mlp.")]
    opt = torch.optim.AdamW([{"params": rest}, {"params": mlp}], lr=1e-3)
    if config is not None:
        obs.set_context(env_config_path=config)
    losses = []
    for step, (x, y) in enumerate(data):
        if spike_at is not None:
            opt.param_groups[1]["lr"] = 5e-2 if spike_at <= step < spike_at + 3 else 1e-3
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def spike(tmp_path_factory):
    """The monitored run with the spike, the same run without obs, its run folder and what it wrote on stderr."""
    root = tmp_path_factory.mktemp("monitor")
    config = root / "obs.json"
    config.write_text(json.dumps({"monitor": {"enable": True, "path": str(root / "out")}}))
    threads, raising = torch.get_num_threads(), set_raise_internal_errors(True)
    errors_before = dict(internal_error_counts())  # process-wide: other files' tests may have counted some
    torch.set_num_threads(1)  # a shared 2-core machine: one thread is faster and the same every time
    data = batches(STEPS)
    stderr, sys.stderr = sys.stderr, io.StringIO()
    try:
        watched = _gpt_run(data, spike_at=SPIKE, config=str(config))
        assert feature.monitor is not None and feature.monitor.flush()
        folder = feature.monitor.folder
        lines = sys.stderr.getvalue()
    finally:
        sys.stderr = stderr
        obs.reset_context()
        tracker.reset()
    try:
        plain = _gpt_run(data, spike_at=SPIKE, config=None)
    finally:
        torch.set_num_threads(threads)
        set_raise_internal_errors(raising)
    errors = {k: n for k, n in internal_error_counts().items() if n != errors_before.get(k, 0)}
    return {"watched": watched, "plain": plain, "folder": folder, "root": root / "out", "stderr": lines,
            "errors": errors}


def test_the_model_runs_as_before(spike):
    """With the monitor on, every step's loss is the same, bit for bit, and obs had no internal error."""
    assert spike["watched"] == spike["plain"]
    assert not spike["errors"]


def test_explain_names_block_1s_mlp_update_ratio_at_the_spike(spike):
    """The first anomaly is block 1's MLP update ratio at step 200, before any loss anomaly; nothing before it."""
    found = explain(read_run(find_run(str(spike["root"]))[0]))
    first = found.first
    assert first is not None
    assert (first.step, first.kind, first.stat, first.stage) == (SPIKE, "ur", "ratio", "optimizer")
    assert first.name.startswith("h.1.mlp.") and first.value > 10 * first.baseline
    assert all(a.step >= SPIKE for a in found.anomalies)
    losses = [a for a in found.anomalies if a.kind == "loss"]
    assert not losses or losses[0].step > SPIKE
    at_spike = {a.name for a in found.anomalies if a.step == SPIKE}
    assert at_spike and all(name.startswith("h.1.mlp.") for name in at_spike)


def test_explain_json_and_exit_code(spike, capsys):
    """`obs monitor explain --json`: first holds step, rank, name, kind, stat, stage, value and baseline; exit 1."""
    assert main(["monitor", "explain", spike["folder"], "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    first = doc["first"]
    assert {"step", "rank", "name", "kind", "stat", "stage", "value", "baseline"} <= set(first)
    assert (first["step"], first["rank"], first["kind"], first["stage"]) == (SPIKE, 0, "ur", "optimizer")
    assert doc["anomalies"][0] == first and len(doc["anomalies"]) > 1
    assert main(["monitor", "explain", spike["folder"], "--step", "100", "--span", "50", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["first"] is None


def test_explain_and_show_render(spike, capsys):
    """The human views name the first anomaly and lay out the series that moved most around it."""
    main(["monitor", "explain", str(spike["root"])])
    out = capsys.readouterr().out
    assert re.search(r"first anomaly: step 200 \(rank 0, optimizer\): ur h\.1\.mlp\.\S+ update_ratio/ratio", out)
    assert main(["monitor", "show", str(spike["root"]), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["series"][0]["name"].startswith("h.1.mlp.") and SPIKE <= doc["series"][0]["peak_step"] < SPIKE + 3
    assert SPIKE in doc["steps"] and len(doc["values"]) == len(doc["steps"])
    top = movers(read_run(spike["folder"]), top=3)
    assert all(m.name.startswith("h.1.mlp.") for m in top.movers)


def test_an_anomaly_writes_one_line_on_stderr(spike):
    """Detection ran during training: the spike's first line names the step, the kind, the parameter and the ratio."""
    lines = spike["stderr"].splitlines()
    assert lines and all(line.startswith("obs: monitor: step ") for line in lines)
    first = lines[0]
    assert first.startswith(f"obs: monitor: step {SPIKE}: ur h.1.mlp.") and "baseline" in first


def test_csv_files_in_msprobes_layout(spike):
    """msprobe's run folder and file names, its leading columns, shape and dtype; one row per parameter per step."""
    folder = spike["folder"]
    assert re.fullmatch(r"[A-Z][a-z]{2}\d{2}_\d{2}-\d{2}-\d{2}-rank0-[0-9a-f]{8}", folder.rsplit("/", 1)[1])
    names = sorted(p.name for p in spike["root"].glob("*/*-*.csv"))  # step_times.csv: clock.py
    assert names == sorted(f"{prefix}_{a}-{a + 99}.csv" for prefix in ("grad_reduced", "param_update",
                                                                         "update_ratio", "scalars")
                           for a in (0, 100, 200))
    head = (spike["root"] / folder / "grad_reduced_0-99.csv").read_text().splitlines()
    assert head[0] == "vpp_stage,name,step,norm,shape,dtype"
    assert head[1] == f"0,wte.weight,0,{head[1].split(',')[3]},\"[256, 32]\",torch.float32"
    run = read_run(folder)
    grads = [s for s in run.series if s.prefix == "grad_reduced"]
    assert len(grads) == sum(1 for _ in GPT().parameters()) and all(len(s.steps) == STEPS for s in grads)
    loss = next(s for s in run.series if s.name == "loss")
    assert loss.values == pytest.approx(spike["watched"], rel=1e-5)  # 6 significant digits
    norm = next(s for s in run.series if s.name == "grad_norm")
    assert all(math.isfinite(v) and v > 0 for v in norm.values)
    assert json.loads((spike["root"] / folder / "monitor.json").read_text())["params"][0] == "wte.weight"


def test_a_bad_batch_is_first_seen_in_the_first_layers_activations(tmp_path):
    """Inputs scaled x1000 at step 150: the first anomaly is a forward activation of the first layer at step 150."""
    config = tmp_path / "obs.json"
    config.write_text(json.dumps({"monitor": {"enable": True, "path": str(tmp_path / "out"), "xy_distribution": True,
                                              "targets": {"0": {}, "2": {}}, "step_count_per_record": 1000}}))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    w = torch.randn(16, 1)
    stderr, sys.stderr = sys.stderr, io.StringIO()
    try:
        obs.set_context(env_config_path=str(config))
        for step in range(200):
            x = torch.randn(32, 16) * (1e3 if step == 150 else 1.0)
            loss = torch.nn.functional.mse_loss(model(x), x @ w)
            loss.backward()
            opt.step()
            opt.zero_grad()
        assert feature.monitor is not None and feature.monitor.flush()
        folder = feature.monitor.folder
    finally:
        sys.stderr = stderr
        torch.set_num_threads(threads)
    header = (tmp_path / "out" / folder / "actv_0-999.csv").read_text().splitlines()[0]
    assert header == "vpp_stage,name,step,micro_step,norm,shape,dtype"
    run = read_run(folder)
    found = explain(run)
    first = found.first
    assert first is not None
    assert (first.step, first.kind, first.stage, first.name) == (150, "xy", "forward", "0.input")
    actv = build_plot(run, found).heatmaps[0]  # the page's first heatmap: activations, in module order
    assert actv.prefix == "actv" and actv.rows == ["0.input", "0.output", "2.input", "2.output"]
    mark = next(m for m in actv.marks if m.anomaly == 0)
    assert (actv.rows[mark.row], actv.columns[mark.column]) == ("0.input", (150, 150))


def test_a_compiled_model_runs_and_compiles_as_before(tmp_path, recwarn):
    """torch.compile (aot_eager): the same losses and Dynamo frame counts with the monitor on, no graph break, no
    warning (the model is found from the caller's frames, without a global module hook), and its parameters named."""
    from tests.training import mlp, train_compiled

    config = tmp_path / "obs.json"
    config.write_text(json.dumps({"monitor": {"enable": True, "path": str(tmp_path / "out")}}))
    runs = []
    for on in (False, True):
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(1)
        if on:
            obs.set_context(env_config_path=str(config))
        runs.append(train_compiled(mlp(8, 16, 2), 5, lambda g=g: (torch.randn(4, 8, generator=g),),
                                   backend="aot_eager"))
        if on:
            assert feature.monitor.flush()
            names = {s.name for s in read_run(feature.monitor.folder).series if s.prefix == "grad_reduced"}
            obs.reset_context()
    plain, watched = runs
    assert watched.losses == plain.losses and watched.frames == plain.frames and not watched.breaks
    assert names == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert not [w for w in recwarn if "global hooks" in str(w.message)]


def test_the_html_page_shows_the_spike_on_the_update_ratio_heatmap(spike, tmp_path):
    """`obs monitor plot --html`: block 1's MLP update ratio at step 200 is the first anomaly, stated at the top and
    marked on the update-ratio heatmap; in a headless browser the page logs nothing, raises no script error and draws
    every heatmap."""
    from tests.obs.features.dump.diff.test_render import BROWSERS, browser, headless

    page = tmp_path / "health.html"
    assert main(["monitor", "plot", str(spike["root"]), "--html", str(page)]) == 0
    text = page.read_text()
    assert re.search(r'<div class="card" id="first" data-step="200" data-name="h\.1\.mlp\.', text)
    run = read_run(spike["folder"])
    plot = build_plot(run, explain(run))
    assert [h.prefix for h in plot.heatmaps] == ["grad_reduced", "param_update", "update_ratio"]
    ratio = plot.heatmaps[2]
    first = next(m for m in ratio.marks if m.anomaly == 0)
    assert ratio.rows[first.row].startswith("h.1.mlp.") and ratio.columns[first.column] == (SPIKE, SPIKE)
    assert len(ratio.rows) == sum(1 for _ in GPT().parameters()) and len(ratio.columns) == STEPS
    binary = browser()
    if binary is None:
        pytest.skip(f"no headless browser here (none of {', '.join(BROWSERS)} on PATH; .ci/run installs chromium)")
    done = headless(binary, tmp_path, "--enable-logging=stderr", "--v=0", "--dump-dom", page.as_uri())
    assert done.returncode == 0, done.stderr[-2000:]
    dom = done.stdout
    assert re.search(r"<body[^>]*>", dom).group(0) == '<body data-rendered="1">'  # drawn, no data-errors
    assert "CONSOLE" not in done.stderr, done.stderr[-2000:]  # console messages and uncaught errors are logged so
    cells = [int(n) for n in re.findall(r'<canvas [^>]*data-cells="(\d+)"', dom)]
    assert cells == [len(h.rows) * len(h.columns) for h in plot.heatmaps]
    heatmap = re.search(r'<div class="heatmap" id="heatmap-2" data-prefix="update_ratio">(.*?)</div>', dom, re.S)
    assert heatmap and re.search(r'<rect [^>]*class="mark first"[^>]*data-step="200" data-name="h\.1\.mlp\.',
                                 heatmap.group(1))
