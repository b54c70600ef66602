"""Metrics from the profiler's ring: each step's values, the gauges, and the OpenTelemetry side (a Prometheus
endpoint scraped over HTTP, OTLP/HTTP to a receiver), with OpenTelemetry's names and Prometheus's."""

from __future__ import annotations

import http.server
import os
import re
import socket
import threading
import urllib.request
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from exporters import metrics as metrics_module
from exporters.follow import RingFollower, StepAssembler
from exporters.metrics import Metrics, job_id, metrics_url
from exporters.otlp import resource
from exporters.sidecar import ExportConfig
from exporters.step_metrics import MetricState
from obs.features.profiling.scalars import ScalarWriter
from obs.runtime.steps import tracker
from recorder.layout import PHASE_CODES, Kind
from recorder.ring import RingWriter
from tests.recorder._jobs import free_port

CAP = {"step": 256, "module": 16, "op": 16, "memory": 16, "collective": 16, "blob": 16}
MS = 1_000_000


@pytest.fixture(name="ring")
def _ring(tmp_path):
    writer = RingWriter(os.path.join(tmp_path, "p.obsring"), dict(CAP), pid=os.getpid(), rank=3, world_size=4,
                        meta={"run_id": "run-7", "host": "node-1"})
    follower = RingFollower(writer.path)
    yield writer, follower
    follower.close()
    writer.close(remove=True)


def write_steps(writer, n, *, step_ms=10, scalar=None):
    """``n`` steps of ``step_ms`` each (forward 3 ms in two parts, backward 4 ms), a 2 ms collective and a
    memory reading in each, and ``scalar(step)`` as obs.scalar("loss", ...) where given."""
    step, memory, collective = (writer.appender(r) for r in ("step", "memory", "collective"))
    scalars, cpu = ScalarWriter(writer), writer.intern("cpu")
    for number in range(1, n + 1):
        t0 = number * 100 * MS
        tracker.step = number
        step(Kind.STEP_BEGIN, 0, 0, number, 0, 0)
        step(Kind.PHASE, 0, PHASE_CODES["forward"], number, t0, t0 + 1 * MS)
        step(Kind.PHASE, 0, PHASE_CODES["forward"], number, t0 + 1 * MS, t0 + 3 * MS)
        step(Kind.PHASE, 0, PHASE_CODES["backward"], number, t0 + 3 * MS, t0 + 7 * MS)
        collective(Kind.COLLECTIVE, 0, writer.intern("all_reduce"), number, 2 * MS, 2)
        if scalar is not None:
            scalars("loss", scalar(number))
        step(Kind.STEP_END, 0, 0, number, step_ms * MS, 0)
        memory(Kind.MEMORY, 0, cpu, number, 1000 + number, 5000 - number)


def finished(writer, follower, state):
    assembler = StepAssembler(follower)
    slots = follower.poll(final=True)
    state.feed(slots)
    return state.finish(assembler.feed(slots) + assembler.drain())


def test_each_step_gives_its_time_phases_and_collectives_and_the_gauges_their_latest_values(ring):
    writer, follower = ring
    write_steps(writer, 3, scalar=lambda n: [0.5, torch.tensor(0.25), np.float32(0.125)][n - 1])
    ScalarWriter(writer)("lr", 3)  # an int, after the last step
    state = MetricState(follower.string, batch_size=32, tokens_per_step=4096)
    values = finished(writer, follower, state)
    assert [v.step for v in values] == [1, 2, 3]
    for v in values:
        assert v.phases == {"forward": pytest.approx(0.003), "backward": pytest.approx(0.004)}
        assert v.collectives_s == pytest.approx(0.002)
        assert v.duration_s is not None and v.duration_s >= 0
    assert state.scalars() == {"loss": 0.125, "lr": 3.0}
    assert state.scalar_count == 4
    assert state.memory() == {"cpu": (1003, 4999)}  # in use at the last reading; the highest peak seen
    rate = state.steps_per_s()
    assert rate is not None and rate > 0
    assert state.samples_per_s() == pytest.approx(rate * 32) and state.tokens_per_s() == pytest.approx(rate * 4096)


def test_throughput_is_steps_over_the_time_from_the_first_begin_to_the_last_end():
    from exporters.spans import StepRecord

    state = MetricState(str, window=2)
    assert state.steps_per_s() is None and state.samples_per_s() is None
    state.finish([StepRecord(1, 0, 400 * MS), StepRecord(2, 500 * MS, 900 * MS), StepRecord(3, 1000 * MS, 1500 * MS)])
    assert state.steps_per_s() == pytest.approx(2 / 1.0)  # steps 2 and 3: 0.5 s to 1.5 s
    assert state.samples_per_s() is None  # no batch size given


def test_a_step_the_trainer_died_in_has_no_duration_and_late_collectives_are_not_kept(ring):
    writer, follower = ring
    step, collective = writer.appender("step"), writer.appender("collective")
    step(Kind.STEP_BEGIN, 0, 0, 1, 0, 0)
    collective(Kind.COLLECTIVE, 0, 0, 1, 5 * MS, 2)
    state = MetricState(follower.string)
    (value,) = finished(writer, follower, state)
    assert value.duration_s is None and value.collectives_s == pytest.approx(0.005)
    assert state._collectives == {}


def test_scalar_writer_refuses_bad_names_and_values(ring):
    writer, _ = ring
    write = ScalarWriter(writer)
    with pytest.raises(TypeError, match="non-empty str"):
        write("", 1.0)
    with pytest.raises(TypeError, match="non-empty str"):
        write(3, 1.0)
    with pytest.raises(TypeError, match="number or a one-element tensor"):
        write("loss", "high")
    with pytest.raises(ValueError, match=r"one element \(got shape \(2,\)\)"):
        write("loss", torch.ones(2))
    write("loss", torch.tensor(1.5))  # a tensor seen: plain tensors now take the fast path, with the same checks
    with pytest.raises(ValueError, match=r"one element \(got shape \(1, 2\)\)"):
        write("loss", torch.ones(1, 2))


def test_a_cuda_scalar_is_written_off_the_training_thread_once_its_copy_is_done(ring, monkeypatch):
    """No GPU here: the copy and its event are stand-ins; the writer's poller waits on the event, not the caller."""
    from obs.features.profiling import scalars as scalars_module

    writer, follower = ring
    done, threads = threading.Event(), []

    class Copied:
        def synchronize(self):
            done.wait(5)
            threads.append(threading.get_ident())

    cuda = SimpleNamespace(device=SimpleNamespace(type="cuda"), is_cuda=True, numel=lambda: 1,
                           detach=lambda: SimpleNamespace(reshape=lambda shape: torch.tensor(0.75)))
    monkeypatch.setattr(scalars_module, "pinned_copy", lambda value: value)
    monkeypatch.setattr(scalars_module, "marker", lambda device: Copied())
    write = ScalarWriter(writer)
    tracker.step = 2
    try:
        write("loss", cuda)
        tracker.step = 3  # the training thread goes on; the value stays step 2's
        assert write.pending == 1
        done.set()
        assert write.flush(timeout=5) and write.pending == 0
    finally:
        write.close()
    (slot,) = [s for s in follower.poll(final=True) if s["kind"] == Kind.SCALAR]
    assert slot["b"] == 2 and np.int64(slot["d"]).view(np.float64) == 0.75
    assert threads and threads[0] != threading.get_ident()


def test_metrics_url_and_job_id():
    assert metrics_url("http://c:4318", "http/protobuf") == "http://c:4318/v1/metrics"
    assert metrics_url("http://c:4318/v1/traces", "http/protobuf") == "http://c:4318/v1/metrics"
    assert metrics_url("http://c:4318/custom", "http/protobuf") == "http://c:4318/custom"
    assert metrics_url("http://c:4317", "grpc") == "http://c:4317"
    assert job_id({"SLURM_JOB_ID": "991", "TORCHELASTIC_RUN_ID": "abc"}) == "991"
    assert job_id({"TORCHELASTIC_RUN_ID": "abc"}) == "abc"
    assert job_id({"TORCHELASTIC_RUN_ID": "none"}) == ""


def test_the_export_config_carries_the_metrics_settings_through_json():
    config = ExportConfig(ring="r", folder="f", metrics=("otlp", "prometheus"), prometheus_host="0.0.0.0",
                          prometheus_port=9470, batch_size=8, tokens_per_step=2048)
    assert ExportConfig.from_json(config.to_json()) == config


def config(**kw):
    base = {"metrics": ("prometheus",), "prometheus_host": "127.0.0.1", "prometheus_port": free_port(),
            "batch_size": 16, "tokens_per_step": 0, "endpoint": "", "protocol": ""}
    return SimpleNamespace(**{**base, **kw})


def scrape(port):
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


def series(text, name):
    """{labels text: value} of the samples of ``name``."""
    return {m.group(1): float(m.group(2)) for m in re.finditer(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.M)}


def feed_and_scrape(m, follower, cfg):
    """Feed the metrics everything the ring holds, scrape the endpoint, close the metrics."""
    try:
        assembler = StepAssembler(follower)
        slots = follower.poll(final=True)
        m.feed(slots, assembler.feed(slots) + assembler.drain())
        return scrape(cfg.prometheus_port)
    finally:
        m.close(2.0)


def test_prometheus_endpoint_shows_opentelemetry_names_in_prometheus_form_each_with_the_rank(ring):
    writer, follower = ring
    write_steps(writer, 4, scalar=lambda n: 1.0 / n)
    cfg = config()
    res = resource(follower.header.meta, rank=3, world_size=4, pid=os.getpid())
    m = Metrics(cfg, res, rank=3, name=follower.string, environ={"SLURM_JOB_ID": "4242"})
    assert m.serving == f"127.0.0.1:{cfg.prometheus_port}"
    text = feed_and_scrape(m, follower, cfg)
    assert set(series(text, "obs_step_duration_seconds_count").values()) == {4.0}
    assert all('ml_rank="3"' in labels for labels in series(text, "obs_step_duration_seconds_count"))
    phases = series(text, "obs_step_phase_duration_seconds_sum")
    assert {re.search(r'phase="(\w+)"', k).group(1): round(v, 6) for k, v in phases.items()} == {
        "forward": 0.012, "backward": 0.016}
    assert list(series(text, "obs_step_collectives_duration_seconds_sum").values()) == [pytest.approx(0.008)]
    assert 'obs_step_duration_seconds_bucket{le="0.001"' in text  # the seconds buckets, not the SDK's ms ones
    (loss,) = [(k, v) for k, v in series(text, "obs_scalar").items()]
    assert 'name="loss"' in loss[0] and 'ml_rank="3"' in loss[0] and loss[1] == 0.25
    assert list(series(text, "obs_memory_peak_bytes").values()) == [4999.0]
    assert 'device="cpu"' in next(iter(series(text, "obs_memory_used_bytes")))
    steps_s, samples_s = series(text, "obs_steps_per_second"), series(text, "obs_samples_per_second")
    assert list(samples_s.values()) == [pytest.approx(16 * next(iter(steps_s.values())))]
    assert "obs_tokens_per_second" not in text  # no tokens per step given
    (info,) = series(text, "target_info")
    for label in ('ml_rank="3"', 'ml_world_size="4"', 'ml_run_id="run-7"', 'ml_job_id="4242"', 'host_name="node-1"',
                  'service_name="obs"'):
        assert label in info
    assert "process_cpu_seconds_total" not in text  # the exporter process's own series are not ours to show
    with socket.socket() as s:  # closed: the port can be listened on again (as a server does, past TIME_WAIT)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", cfg.prometheus_port))
        s.listen()


def test_a_new_identity_rebuilds_the_resource_and_labels_with_the_agreed_rank(ring):
    writer, follower = ring
    cfg = config()
    m = Metrics(cfg, resource({"run_id": "proposal"}, rank=0, world_size=1, pid=1), rank=0, name=follower.string,
                environ={})
    try:
        m.identity(resource({"run_id": "agreed"}, rank=1, world_size=2, pid=1), 1)
        write_steps(writer, 2)
    except BaseException:
        m.close(2.0)
        raise
    text = feed_and_scrape(m, follower, cfg)
    assert 'ml_run_id="agreed"' in next(iter(series(text, "target_info")))
    assert list(series(text, "obs_step_duration_seconds_count")) and \
        all('ml_rank="1"' in k for k in series(text, "obs_step_duration_seconds_count"))


def test_a_port_in_use_is_tried_again_and_said_when_it_stays_taken(ring, monkeypatch):
    _, follower = ring
    cfg = config()
    res = resource({}, rank=0, world_size=1, pid=1)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", cfg.prometheus_port))
        taken.listen()
        m = Metrics(cfg, res, rank=0, name=follower.string, environ={})
        assert m.serving == "" and m.notes == []
        monkeypatch.setattr(metrics_module, "_BIND_RETRY_S", 0.0)
        m._bind_next = 0.0
        m.feed(np.empty(0, follower.poll().dtype), [])
        assert m.serving == "" and "cannot serve Prometheus on 127.0.0.1" in m.notes[0]
        m.close(1.0)
    again = Metrics(cfg, res, rank=0, name=follower.string, environ={})
    try:
        assert again.serving  # free now
    finally:
        again.close(1.0)


class _MetricsReceiver:
    """An OTLP/HTTP endpoint that keeps the ExportMetricsServiceRequest bodies posted to /v1/metrics."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

        owner, self.requests, self.paths = self, [], []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                request = ExportMetricsServiceRequest()
                request.ParseFromString(body)
                owner.requests.append(request)
                owner.paths.append(self.path)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, name="test-otlp-metrics", daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


def test_otlp_sends_the_metrics_with_the_resource_to_the_profilers_endpoint_at_the_end(ring):
    writer, follower = ring
    receiver = _MetricsReceiver()
    try:
        write_steps(writer, 3, scalar=lambda n: float(n))
        cfg = config(metrics=("otlp",), endpoint=receiver.url, protocol="http/protobuf")
        m = Metrics(cfg, resource(follower.header.meta, rank=3, world_size=4, pid=1), rank=3, name=follower.string,
                    environ={"TORCHELASTIC_RUN_ID": "job-5"})
        assert m.serving == ""
        assembler = StepAssembler(follower)
        slots = follower.poll(final=True)
        m.feed(slots, assembler.feed(slots) + assembler.drain())
        assert receiver.requests == []  # nothing sent before the end: the periodic reader's interval is long
        m.close(5.0)  # the periodic reader's last export
        # in order: the export reached the receiver and was answered before close returned, within its deadline
        assert receiver.requests and m.notes == []
    finally:
        receiver.stop()
    assert receiver.paths and set(receiver.paths) == {"/v1/metrics"}
    found = {}
    for request in receiver.requests:
        for rm in request.resource_metrics:
            res = {a.key: a.value for a in rm.resource.attributes}
            assert res["ml.job_id"].string_value == "job-5" and res["ml.rank"].int_value == 3
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    found[metric.name] = metric
    assert {"obs.step.duration", "obs.step.phase.duration", "obs.step.collectives.duration", "obs.steps",
            "obs.memory.peak", "obs.memory.used", "obs.scalar"} <= set(found)
    assert found["obs.step.duration"].unit == "s" and found["obs.step.duration"].histogram.data_points[0].count == 3
    (point,) = found["obs.scalar"].gauge.data_points
    assert point.as_double == 3.0
    assert {a.key: a.value.string_value or a.value.int_value for a in point.attributes} == {"name": "loss",
                                                                                           "ml.rank": 3}


def monitor_step(writer):
    """One step of the training-health monitor's sink, written through obs.scalar's path into ``writer``'s ring."""
    from obs.features.monitor.metrics import MetricsSink
    from obs.features.monitor.writer import StepValues
    from obs.features.profiling import scalars

    scalars.attach(ScalarWriter(writer))
    try:
        MetricsSink()(StepValues(0, [("update_ratio", "fc.weight", None, "ratio", 0.01),
                                     ("scalars", "grad_norm", None, "value", 1.5)], []))
    finally:
        scalars.detach(scalars._writer)


def test_the_grafana_dashboard_plots_only_series_the_endpoint_serves_and_each_per_rank(ring):
    import json

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "docs", "grafana-dashboard.json")) as fh:
        dashboard = json.load(fh)
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert exprs and all('ml_rank=~"$rank"' in e for e in exprs)
    assert all("ml_rank" in t["legendFormat"] for p in dashboard["panels"] for t in p["targets"])
    writer, follower = ring
    write_steps(writer, 2, scalar=float)
    monitor_step(writer)
    cfg = config(tokens_per_step=128)
    m = Metrics(cfg, resource({}, rank=0, world_size=1, pid=1), rank=0, name=follower.string, environ={})
    try:
        assembler = StepAssembler(follower)
        slots = follower.poll(final=True)
        m.feed(slots, assembler.feed(slots) + assembler.drain())
        served = set(re.findall(r"^(obs_\w+)\{", scrape(cfg.prometheus_port), re.M))
    finally:
        m.close(2.0)
    plotted = set(re.findall(r"\b(obs_\w+)\{", " ".join(exprs)))
    assert plotted and plotted <= served, plotted - served
    families = {re.sub(r"_(bucket|sum|count)$", "", name) for name in served}
    assert families <= {re.sub(r"_(bucket|sum|count)$", "", name) for name in plotted}, "a metric no panel plots"


def test_the_training_health_monitors_values_are_metrics_of_their_own(ring):
    """The monitor's sink (on its worker thread) writes through obs.scalar's path into the ring; the exporter serves
    the last global gradient norm, the last largest update ratio labelled with its layer, and the anomaly counts per
    kind (every kind from 0), none of them as an obs_scalar."""
    from obs.features.monitor.metrics import MetricsSink
    from obs.features.monitor.writer import Anomaly, StepValues
    from obs.features.profiling import scalars

    writer, follower = ring
    write_steps(writer, 2, scalar=lambda n: 1.0 / n)
    sink = MetricsSink()
    scalars.attach(ScalarWriter(writer))
    try:
        ratio = [("update_ratio", "fc1.weight", None, "ratio", 0.01),
                 ("update_ratio", "fc2.weight", None, "ratio", 0.02),
                 ("update_ratio", "fc2.bias", None, "ratio", float("nan")),
                 ("scalars", "grad_norm", None, "value", 1.5)]
        sink(StepValues(0, ratio, []))
        spike = Anomaly(1, "update_ratio", "fc1.weight", None, "ratio", 0.7, 0.01, "robust", 60.0)
        grad = Anomaly(1, "grad_reduced", "fc1.weight", None, "norm", 9.0, 1.0, "robust", 30.0)
        loss = Anomaly(1, "scalars", "loss", None, "value", 9.0, 1.0, "robust", 20.0)
        sink(StepValues(1, [(*row[:4], 0.7 if row[1] == "fc1.weight" else row[4]) for row in ratio],
                        [spike, grad, Anomaly(1, "param_update", "fc1.weight", None, "norm", 5.0, 0.1, "robust", 40.0),
                         loss]))
    finally:
        scalars.detach(scalars._writer)
    cfg = config()
    m = Metrics(cfg, resource(follower.header.meta, rank=3, world_size=4, pid=os.getpid()), rank=3,
                name=follower.string, environ={})
    text = feed_and_scrape(m, follower, cfg)

    def ours(name):  # the samples' labels, less the OpenTelemetry scope's
        return {re.sub(r',?otel_scope_\w+="[^"]*"', "", k): v for k, v in series(text, name).items()}

    assert ours("obs_monitor_grad_norm") == {'ml_rank="3"': 1.5}
    assert ours("obs_monitor_update_ratio_max") == {'layer="fc1.weight",ml_rank="3"': 0.7}
    counts = {re.search(r'kind="(\w+)"', k).group(1): v for k, v in ours("obs_monitor_anomalies_total").items()}
    assert counts == {"ur": 2.0, "wg": 1.0, "loss": 1.0, "mv": 0.0, "xy": 0.0}
    assert list(ours("obs_scalar")) == ['ml_rank="3",name="loss"']  # the monitor's values are not obs_scalar's
