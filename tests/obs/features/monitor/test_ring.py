"""The monitor in the RDR ring and the anomaly's actions.

One subprocess (``ring_script.py``: the tiny GPT of test_training.py, its lr spike at step 200, the monitor and the
RDR on, ``on_anomaly: [bundle, capture]``) killed with SIGKILL after 250 steps, shared by the tests of the module:
``obs rdr recover`` makes a bundle holding the monitor's last 64 steps, ``obs monitor explain`` names the spike on it,
the anomaly's own bundle names it in ``obs rdr show``, and the capture dumped its steps' statistics.  The rest runs
in-process: the ring region's layout (a wrapped ring, NaN, the float16 score) and ``raise`` on a small MLP.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from obs.cli import main
from recorder.layout import DEFAULT_CAPACITY
from recorder.monitor_part import decode, encode, from_contents
from recorder.ring import RingWriter
from recorder.ring_reader import read_ring

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
SPIKE, KILL_AT, KEEP = 200, 250, 64


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """The SIGKILLed run: its config, RDR root and monitor run folder."""
    root = tmp_path_factory.mktemp("ring")
    config = root / "obs.json"
    config.write_text(json.dumps({
        "rdr": {"enable": True, "path": str(root / "rdr"), "granularity": "step"},
        "monitor": {"enable": True, "path": str(root / "mon"), "ring_steps": KEEP,
                    "on_anomaly": ["bundle", "capture"], "capture_steps": 3}}))
    proc = subprocess.run([sys.executable, "-m", "tests.obs.features.monitor.ring_script", str(config), str(KILL_AT)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-3000:]
    folder = next(line.split(" ", 1)[1] for line in proc.stdout.splitlines() if line.startswith("monitor-folder "))
    return SimpleNamespace(root=root, rdr=root / "rdr", folder=folder, stderr=proc.stderr)


def _bundles(rdr, reason):
    return sorted(p for p in (rdr / "rank_0" / "rdr").iterdir() if p.name.endswith("_" + reason))


def test_sigkill_then_recover_holds_the_last_steps_and_explain_works(killed, capsys):
    """SIGKILL after step 249, then `obs rdr recover`: the bundle holds steps 186..249 of every series (the CSV's
    values), and `obs monitor explain BUNDLE` names block 1's MLP update ratio at step 200, as on the run folder."""
    assert main(["rdr", "recover", str(killed.rdr), "--json"]) == 0
    made = json.loads(capsys.readouterr().out)["recovered"]
    assert len(made) == 1 and made[0].endswith("_recovered")
    from recorder.bundle_reader import load_bundle

    bundle = load_bundle(made[0])
    part = bundle.monitor
    assert part is not None and part.steps == tuple(range(KILL_AT - KEEP, KILL_AT)) and part.steps_kept == KEEP
    from obs.features.monitor.reader import read_run

    run = read_run(killed.folder)
    csv = {(s.prefix, s.name, s.stat): dict(zip(s.steps, s.values)) for s in run.series}
    assert {(s.prefix, s.name, s.stat) for s in part.series} == set(csv)
    for s in part.series:
        want = [csv[(s.prefix, s.name, s.stat)][st] for st in part.steps]
        assert s.values == pytest.approx(want, rel=1e-5, nan_ok=True)  # the CSV rounds to 6 significant digits
    assert bundle.manifest["monitor"]["steps"] == [KILL_AT - KEEP, KILL_AT - 1]

    assert main(["monitor", "explain", made[0], "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    first = doc["first"]
    assert (first["step"], first["kind"], first["stat"], first["stage"], first["rank"]) == \
        (SPIKE, "ur", "ratio", "optimizer", 0)
    assert first["name"].startswith("h.1.mlp.") and first["value"] > 10 * first["baseline"]
    from obs.features.monitor.explain import explain

    on_csv = explain(run)
    assert on_csv.first is not None and (on_csv.first.name, on_csv.first.series) == (first["name"], first["series"])
    assert main(["monitor", "show", os.path.join(made[0], "monitor.json"), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["steps"] and set(shown["steps"]) <= set(part.steps)


def test_an_anomaly_bundle_names_the_first_anomaly_in_rdr_show(killed, capsys):
    """`bundle`: one non-fatal bundle (reason anomaly) for the excursion, whose `obs rdr show` gives the explanation."""
    bundles = _bundles(killed.rdr, "anomaly")
    assert len(bundles) == 1  # one per ring_steps steps: the excursion's later anomalies wrote none
    assert main(["rdr", "show", str(bundles[0])]) == 0
    out = capsys.readouterr().out
    assert "reason         anomaly" in out and "training health" in out
    assert "first anomaly: step 200 (rank 0, optimizer): ur h.1.mlp." in out
    assert main(["rdr", "show", str(bundles[0]), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    fault, first = doc["manifest"]["fault"], doc["monitor"]["first"]
    assert fault["kind"] == "anomaly" and fault["monitor_step"] == SPIKE
    assert first["step"] == SPIKE and first["kind"] == "ur"
    assert (fault["anomaly"]["name"], fault["anomaly"]["series"]) == (first["name"], first["series"])


def test_capture_dumps_the_statistics_of_the_next_steps(killed):
    """`capture`: the data dump's statistic.csv for capture_steps consecutive steps after the anomaly, once."""
    captures = sorted(p for p in os.listdir(killed.folder) if p.startswith("capture_step"))
    assert captures == [f"capture_step{SPIKE}"]
    net = os.path.join(killed.folder, captures[0], "rank_0", "Net", "0")
    steps = sorted(int(s) for s in os.listdir(net))
    assert len(steps) == 3 and steps == list(range(steps[0], steps[0] + 3)) and steps[0] > SPIKE
    for step in steps:
        with open(os.path.join(net, str(step), "statistic.csv")) as fh:
            head = fh.readline()
            assert head.startswith("Op Type,Op Name,Task ID") and len(fh.readlines()) > 10


class _Live:
    def __init__(self, ring):
        self.ring = ring


def test_ring_region_layout_wraps_and_keeps_nan_and_scores(tmp_path):
    """The region in a small ring: a wrapped ring keeps only its whole newest steps (at most ring_steps), NaN and
    infinities survive the bundle's JSON, an anomaly keeps its baseline, rule and score (float16); a monitor restarted
    on the same ring starts it afresh."""
    from obs.features.monitor.ring_region import RingRegion
    from obs.features.monitor.writer import Anomaly, StepValues

    ring = RingWriter(str(tmp_path / "ring_1.obsring"), {**DEFAULT_CAPACITY, "monitor": 40, "monitor_anomaly": 4},
                      pid=1, rank=0, world_size=1, meta={})
    try:
        sink = RingRegion(3, recorder=lambda: _Live(ring))
        for step in range(10):  # 6 values a step: 40 slots hold 6 steps and a part of another
            values = [("grad_reduced", f"p{i}", None, "norm", float(step * 10 + i)) for i in range(5)]
            values.append(("actv", "m.output", 1, "norm", math.nan if step == 8 else math.inf))
            found = [Anomaly(step, "update_ratio", "p1", None, "ratio", 2.5, 0.01, "robust", 958.0)] \
                if step in (2, 9) else []
            sink(StepValues(step, values, found))
        contents = read_ring(ring.buffer())
        again = RingRegion(3, recorder=lambda: _Live(ring))  # a hot reload restarted the monitor, not the recorder
        again(StepValues(0, [("scalars", "loss", None, "value", 1.5)], []))
        restarted = read_ring(ring.buffer())
    finally:
        ring.close(remove=True)
    fresh = from_contents(restarted.strings, restarted.side, restarted.dropped)
    assert fresh is not None and fresh.steps == (0,) and not fresh.anomalies and len(fresh.series) == 1
    part = from_contents(contents.strings, contents.side, contents.dropped)
    assert part is not None and part.steps == (7, 8, 9) and part.steps_kept == 3
    assert not any(e for e in contents.event_lines() if '"monitor' in e)  # not events
    back = decode(json.loads(encode(part)), "monitor.json")
    p3 = next(s for s in back.series if s.name == "p3")
    assert p3.values == (73.0, 83.0, 93.0)
    actv = next(s for s in back.series if s.prefix == "actv")
    assert actv.micro == 1 and math.isnan(actv.values[1]) and actv.values[0] == math.inf
    assert [a.step for a in back.anomalies] == [2, 9]
    a = back.anomalies[1]
    assert (a.prefix, a.name, a.stat, a.value, a.baseline, a.rule) == ("update_ratio", "p1", "ratio", 2.5, 0.01,
                                                                      "robust")
    assert a.score == pytest.approx(958.0, rel=1e-3)


def test_a_damaged_monitor_part_names_the_file_and_field(tmp_path):
    """A bundle's monitor.json with a bad field is a DamagedFileError naming the file and the field."""
    from obs._core.errors import DamagedFileError

    doc = {"format": "obs-monitor-ring", "steps": [1, 2], "series": [
        {"series": "scalars", "name": "loss", "micro": None, "stat": "value", "values": [1.0, "x"]}]}
    with pytest.raises(DamagedFileError, match=r"monitor.json: series\[0\].values\[1\] must be a number"):
        decode(doc, "monitor.json")


def test_raise_stops_the_training_loop_at_the_next_step(tmp_path):
    """`raise`: MonitorAnomalyError comes out of optimizer.step() in the training thread at the step after the flagged
    one (once the worker judged it), once per flagged step; training may go on after catching it."""
    import torch

    import obs
    from obs.features.monitor import MonitorAnomalyError
    from obs.features.monitor.feature import feature
    from obs.runtime.steps import tracker

    config = tmp_path / "obs.json"
    config.write_text(json.dumps({"monitor": {"enable": True, "format": "api", "warmup": 5, "window": 10,
                                              "on_anomaly": ["raise"]}}))
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    raised = []
    obs.set_context(env_config_path=str(config))
    try:
        for step in range(30):
            x = torch.randn(16, 8) * (1e4 if step == 20 else 1.0)
            model(x).pow(2).mean().backward()
            try:
                opt.step()
            except MonitorAnomalyError as exc:
                raised.append((step, exc))
            opt.zero_grad()
            if step == 20:
                assert feature.monitor is not None and feature.monitor.flush()
    finally:
        obs.reset_context()
        tracker.reset()
    assert raised and len({e.step for _, e in raised}) == len(raised)  # once per flagged step
    step, exc = raised[0]
    assert step == 21 and exc.step == 20 and "step 20" in str(exc)
    assert exc.anomaly["step"] == 20 and exc.anomaly["rule"] == "robust"


def test_alert_dump_writes_msprobes_anomaly_json(tmp_path):
    """msprobe's alert.dump: anomaly_detected/rank{r}/anomaly.json, keyed and shaped as msprobe's AnomalyDataWriter."""
    from obs.features.monitor.alert_dump import AlertDump
    from obs.features.monitor.writer import Anomaly, StepValues

    sink = AlertDump(str(tmp_path), rank=1, world_size=2)
    sink(StepValues(4, [], []))
    assert not (tmp_path / "anomaly_detected").exists()
    sink(StepValues(5, [], [Anomaly(5, "grad_reduced", "fc1.weight", None, "norm", 9.0, 1.0, "AnomalyTurbulence", 8.0),
                            Anomaly(5, "grad_reduced", "fc1.weight", None, "max", 9.0, 1.0, "robust", 8.0),
                            Anomaly(5, "actv", "fc2.input", 0, "norm", 3.0, 1.0, "robust", 12.0)]))
    doc = json.loads((tmp_path / "anomaly_detected" / "rank1" / "anomaly.json").read_text())
    assert list(doc) == ["0:fc1.weight/rank1/post_grad_step_5_call_-1", "0:fc2.input:0/rank1/actv_step_5_call_-1"]
    entry = doc["0:fc1.weight/rank1/post_grad_step_5_call_-1"]
    assert set(entry) == {"rank", "step", "micro_step", "pp_stage", "vpp_stage", "call_id", "tag_name", "message",
                          "group_mates"}
    assert (entry["rank"], entry["step"], entry["group_mates"]) == (1, 5, [0, 1])
    assert entry["message"].startswith("Rule AnomalyTurbulence reports anomaly signal in "
                                       "('0:fc1.weight/rank1/post_grad', 'norm') at step 5")


def test_capture_asks_the_profiler_for_a_window(tmp_path):
    """capture, with a profiling session in force: a task_trace window of capture_steps steps is asked of it, the
    window `obs trace capture` asks for; the data dump waits for the next step boundary."""
    from obs.features.monitor import capture
    from obs.features.profiling.feature import feature as profiler
    from obs.features.profiling.window import Windows

    windows = Windows()
    assert profiler.session is None
    profiler.session = SimpleNamespace(windows=windows)  # a session's windows, without its exporter process
    try:
        window = capture.start(7, 4, str(tmp_path))
    finally:
        profiler.session = None
    try:
        assert windows.pending and window.dump is None and window.folder.endswith("capture_step7")
        windows.place(12)
        assert windows.captures[0].start == 12 and windows.captures[0].steps == 4
        assert windows.level(13) == "task_trace"
    finally:
        window.close()
    assert window.done


def test_the_ring_gets_the_monitor_region_when_the_section_turns_on(tmp_path):
    """The RDR's ring has the monitor's rings only while the section is on, sized by ring_steps x ring_series: turning
    the monitor on restarts the recorder on the new layout."""
    import obs
    from obs.features.rdr.feature import recorder

    rdr = {"enable": True, "path": str(tmp_path / "rdr"), "granularity": "off"}
    plain, watched = tmp_path / "plain.json", tmp_path / "watched.json"
    plain.write_text(json.dumps({"rdr": rdr}))
    watched.write_text(json.dumps({"rdr": rdr, "monitor": {"enable": True, "format": "api", "ring_steps": 8,
                                                           "ring_series": 32}}))
    try:
        obs.set_context(env_config_path=str(plain))
        first = recorder()
        assert first is not None and "monitor" not in first.ring.rings
        obs.set_context(env_config_path=str(watched))
        second = recorder()
        assert second is not None and second is not first
        assert second.ring.rings["monitor"].capacity == 8 * 32 and "monitor_anomaly" in second.ring.rings
    finally:
        obs.reset_context()
