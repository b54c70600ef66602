"""Real trainers (subprocesses, real PyTorch) with the profiler on, their real exporter process, and a real OTLP
receiver started by the tests (HTTP/protobuf and gRPC, decoding with the opentelemetry-proto classes)."""

from __future__ import annotations

import base64
import json
import os
import pathlib
import socket
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import pytest
from google.protobuf.json_format import ParseDict
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tests.exporters.receiver import Receiver

pytestmark = pytest.mark.slow

SCRIPT = os.path.join(os.path.dirname(__file__), "phases_script.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PHASES = ["data", "forward", "backward", "optimizer"]


@dataclass
class Run:
    """One test's run of ``train_script.py``: its folder (its current one), its receiver (and endpoint), what it
    wrote, and the trainer process it ran in (with every run's stderr)."""

    folder: pathlib.Path
    receiver: Receiver = field(default_factory=Receiver)
    stdout: str = ""
    stderr: str = ""
    endpoint: str = ""
    returncode: int | None = None
    process_stderr: str = ""

    @property
    def done(self) -> bool:
        """It trained every step and ended its session (train_script.py prints ``done`` last)."""
        return "done" in self.stdout.splitlines()


def _split(text, names):
    """The part of ``text`` each run wrote: from its line ``phase NAME`` to the next run's."""
    parts, name = {}, None
    for line in text.splitlines(keepends=True):
        if line.startswith("phase ") and line[6:].strip() in names:
            name = line[6:].strip()
            parts[name] = ""
        elif name is not None:
            parts[name] += line
    return parts


def _trainer(root, runs, specs):
    """``phases_script.py`` running ``specs`` ({name: (args, env)}) in order, without the caller's OTEL_*."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    clean["PYTHONPATH"] = ROOT
    phases = [{"name": name, "cwd": str(runs[name].folder), "env": env, "args": args}
              for name, (args, env) in specs.items()]
    return subprocess.Popen([sys.executable, SCRIPT, json.dumps(phases)], cwd=root, env=clean, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every trainer of this module but torchrun's, the profiler on: two processes that each run one test's
    ``train_script.py`` after another (``phases_script.py``: a trainer's start-up is most of a short run's cost),
    the last the one that SIGKILLs itself.  The receivers stay up until the module's tests are done (the killed
    trainer's exporter sends after it died)."""
    root = tmp_path_factory.mktemp("e2e")
    first = ("http", "grpc_config", "dead", "sdk_disabled", "killed_http")
    # The slow collector's run first, as in a trainer of its own: a later run trains at once (torch and the
    # optimizer imported), its 40 steps can be over before its exporter has started, which then sends them as one
    # batch that the slow collector answers within the deadline (nothing dropped: seen).
    second = ("slow", "files", "grpc_protocol", "killed_files")
    out = {name: Run(root / name) for name in first + second}
    for run in out.values():
        run.folder.mkdir()
    out["slow"].receiver = Receiver(delay_s=3.0)  # longer than the exporter's flush deadline at the end (2 s)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    dead = f"http://127.0.0.1:{port}"
    config = out["grpc_config"].folder / "obs.json"
    config.write_text(json.dumps({"profiler": {"enable": True, "endpoint": out["grpc_config"].receiver.start_grpc(),
                                               "protocol": "grpc", "options": "training_trace:op_trace",
                                               "span_budget": 8, "steps": "3-6|9"}}))
    on = {"enable_profiling": True}
    specs = {
        "http": ({"steps": 20, "context": {**on, "profiling_options": "training_trace:task_trace"}},
                 {"OTEL_EXPORTER_OTLP_ENDPOINT": out["http"].receiver.start_http(),
                  "OTEL_EXPORTER_OTLP_HEADERS": "x-team=ml,authorization=Bearer t0k", "OTEL_SERVICE_NAME": "trainer-7",
                  "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=test,team=ml"}),
        "grpc_config": ({"steps": 12, "config": str(config)}, {"OTEL_EXPORTER_OTLP_HEADERS": "x-grpc=yes"}),
        # What a dead collector costs in time is measured in tests/perf/bench_profiler.py (1,000 steps).
        "dead": ({"steps": 30, "context": on}, {"OTEL_EXPORTER_OTLP_ENDPOINT": dead}),
        "sdk_disabled": ({"steps": 5, "context": on}, {"OTEL_EXPORTER_OTLP_ENDPOINT": out["sdk_disabled"].receiver
                                                       .start_http(), "OTEL_SDK_DISABLED": "true"}),
        "killed_http": ({"steps": 30, "kill_at": 12, "context": on},
                        {"OTEL_EXPORTER_OTLP_ENDPOINT": out["killed_http"].receiver.start_http()}),
        "files": ({"steps": 15, "context": {**on, "profiling_options": '{"task_trace": "on", "op_trace": "on"}'}},
                  {}),
        "slow": ({"steps": 40, "sleep_ms": 25, "context": on},
                 {"OTEL_EXPORTER_OTLP_ENDPOINT": out["slow"].receiver.start_http(), "OTEL_BSP_MAX_QUEUE_SIZE": "10"}),
        "grpc_protocol": ({"steps": 4, "context": on},
                          {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": out["grpc_protocol"].receiver.start_grpc(),
                           "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"}),
        "killed_files": ({"steps": 30, "kill_at": 12, "context": on}, {}),
    }
    procs = []
    try:
        procs += [(_trainer(root, out, {n: specs[n] for n in names}), names) for names in (first, second)]
        for proc, names in procs:
            stdout, stderr = proc.communicate(timeout=300)
            said, warned = _split(stdout, names), _split(stderr, names)
            for name in names:
                run = out[name]
                run.stdout, run.stderr = said.get(name, ""), warned.get(name, "")
                run.returncode, run.process_stderr = proc.returncode, stderr
                run.endpoint = next((v for k, v in specs[name][1].items() if k.endswith("ENDPOINT")), "")
        yield out
    finally:
        for proc, _ in procs:
            proc.kill()  # a trainer left running by a failure above
            proc.wait()
        for run in out.values():
            run.receiver.stop()


def traces(spans):
    out = defaultdict(list)
    for s in spans:
        out[s["trace_id"]].append(s)
    return out


def check_step_trees(spans, steps, *, modules=False):
    by_trace = traces(spans)
    roots = sorted((s for s in spans if s["name"] == "step"), key=lambda s: s["attributes"]["ml.step"])
    assert [s["attributes"]["ml.step"] for s in roots] == steps
    for root in roots:
        members = by_trace[root["trace_id"]]
        ids = {s["span_id"]: s for s in members}
        assert root["parent_id"] == ""
        children = [s for s in members if s["parent_id"] == root["span_id"]]
        # The phases, in order; an op that ran between two phases (the optimizer's record_function, entered just
        # before its step hooks run) is the step's own child, and with op_trace on a slow one becomes a span.
        phases = [c for c in children if "ml.phase" in c["attributes"]]
        assert [c["name"] for c in sorted(phases, key=lambda c: c["start"])] == PHASES
        assert all(c["attributes"].get("ml.op.name") for c in children if c not in phases)
        for s in members:
            assert root["start"] <= s["start"] <= s["end"] <= root["end"]
            if s is not root:
                assert s["parent_id"] in ids
        if modules:
            forward = next(c for c in children if c["name"] == "forward")
            net = [s for s in members if s["name"] == "net-Sequential"]
            assert len(net) == 1 and net[0]["parent_id"] == forward["span_id"]
            assert {s["name"] for s in members if s["parent_id"] == net[0]["span_id"]} == \
                {"0-Linear", "1-ReLU", "2-Sequential", "3-Linear"}
            assert {s["attributes"]["ml.module.scope"] for s in members if "ml.module.scope" in s["attributes"]} >= \
                {"Default/net-Sequential/2-Sequential/0-Linear", "Default/net-MSELoss"}
        assert root["attributes"]["ml.rank"] == 0 and root["attributes"]["ml.world_size"] == 1


def test_http_receiver_gets_one_trace_per_step_with_phases_modules_resource_and_headers(runs):
    run = runs["http"]
    assert run.done, run.process_stderr
    spans = run.receiver.spans()
    check_step_trees(spans, list(range(1, 21)), modules=True)
    assert set(run.receiver.paths) == {"/v1/traces"}
    assert all(h.get("x-team") == "ml" and h.get("authorization") == "Bearer t0k" for h in run.receiver.headers)
    resource = spans[0]["resource"]
    assert resource["service.name"] == "trainer-7" and resource["deployment.environment"] == "test"
    assert resource["ml.rank"] == 0 and resource["ml.framework"] == "pytorch" and resource["process.pid"] > 0
    assert resource["ml.framework.version"].startswith("2.")
    assert {s["scope"] for s in spans} == {"obs"}
    per_step = Counter(s["trace_id"] for s in spans)
    assert max(per_step.values()) <= 50
    assert not (run.folder / "obs_profile" / "rank_0" / "trace.json").exists()  # an endpoint: no local trace


def test_grpc_receiver_through_the_env_config_profiler_section(runs):
    run = runs["grpc_config"]
    assert run.done, run.process_stderr
    spans = run.receiver.spans()
    check_step_trees(spans, [3, 4, 5, 6, 9])
    assert all(h.get("x-grpc") == "yes" for h in run.receiver.headers)
    per_step = Counter(s["trace_id"] for s in spans)
    assert set(per_step.values()) == {8}  # the budget, filled with the longest ops
    roots = [s for s in spans if s["name"] == "step"]
    assert all(r["attributes"]["obs.spans.aggregated"] > 0 for r in roots)
    aggregated = [s for s in spans if "ml.ops.names" in s["attributes"]]
    assert aggregated and all(len(s["attributes"]["ml.ops.names"]) == len(s["attributes"]["ml.ops.counts"])
                              for s in aggregated)


def test_local_files_parse_as_otlp_json_and_chrome_trace(runs):
    run = runs["files"]
    assert run.done, run.process_stderr
    folder = run.folder / "obs_profile" / "rank_0"
    assert sorted(p.name for p in folder.iterdir()) == ["status_" + json.loads(
        next(folder.glob("status_*.json")).read_text())["trainer_pid"].__str__() + ".json", "trace.json",
        "traces.otlp.jsonl"]  # the ring is gone once exported
    steps = set()
    for line in (folder / "traces.otlp.jsonl").read_text().splitlines():
        doc = json.loads(line)
        for rs in doc["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                for s in ss["spans"]:
                    assert len(s["traceId"]) == 32 and len(s["spanId"]) == 16  # OTLP JSON: hex ids
                    for key in ("traceId", "spanId", "parentSpanId"):
                        if key in s:
                            s[key] = base64.b64encode(bytes.fromhex(s[key])).decode()
                    steps.update(a["value"]["intValue"] for a in s["attributes"] if a["key"] == "ml.step")
        request = ParseDict(doc, ExportTraceServiceRequest())  # the protobuf JSON mapping, every field known
        assert request.resource_spans[0].scope_spans[0].spans
    assert steps == {str(i) for i in range(1, 16)}  # int64 is a string in the JSON mapping
    events = json.loads((folder / "trace.json").read_text())
    assert isinstance(events, list)
    for e in events:
        assert e["ph"] in ("X", "M", "C") and isinstance(e["pid"], int) and isinstance(e["tid"], int)
        if e["ph"] == "X":
            assert isinstance(e["name"], str) and e["cat"] in ("step", "phase", "module", "op")
            assert isinstance(e["ts"], float | int) and e["dur"] >= 0 and "span_id" in e["args"]
    assert sum(e.get("cat") == "step" for e in events) == 15
    assert "obs: profile" not in run.process_stderr  # a plain python run prints no summary (obs run does)


@pytest.mark.parametrize("mode", ["http", "files"])
def test_a_sigkilled_trainer_still_gets_its_recorded_steps_exported(runs, mode):
    run = runs[f"killed_{mode}"]
    assert run.returncode == -9 and "killing" in run.stdout
    folder = run.folder / "obs_profile" / "rank_0"
    deadline = time.monotonic() + 60
    while not list(folder.glob("status_*.json")) or not json.loads(next(folder.glob("status_*.json")).read_text())[
            "done"]:
        assert time.monotonic() < deadline, "the exporter did not finish after the trainer died"
        time.sleep(0.2)
    if mode == "http":
        spans = run.receiver.spans()
    else:
        from exporters.trace_reader import read_otlp_jsonl

        spans = [{"name": s.name, "attributes": s.attributes} for s in
                 read_otlp_jsonl(str(folder / "traces.otlp.jsonl")).spans]
    steps = {s["attributes"]["ml.step"]: s for s in spans if s["name"] == "step"}
    assert sorted(steps) == list(range(1, 13))
    assert steps[12]["attributes"].get("ml.step.incomplete") is True  # killed in its backward
    assert not any(s["attributes"].get("ml.step.incomplete") for n, s in steps.items() if n < 12)
    assert not list(folder.glob("*.obsring"))


def test_a_dead_collector_costs_spans_not_training_time(runs):
    run = runs["dead"]
    assert run.done, run.process_stderr
    status = json.loads(next((run.folder / "obs_profile" / "rank_0").glob("status_*.json")).read_text())
    assert "obs profiler dropped" in run.stderr and run.endpoint in run.stderr
    assert status["endpoint"] == run.endpoint and sum(status["dropped"].values()) == status["spans"] == 150
    assert status["exported"] == 0


def test_a_slow_collector_delays_the_export_and_what_misses_the_flush_deadline_is_counted(runs):
    run = runs["slow"]
    assert run.done, run.process_stderr
    status = json.loads(next((run.folder / "obs_profile" / "rank_0").glob("status_*.json")).read_text())
    # While the collector lags, the slots wait in the ring; what is still queued at the flush deadline is dropped.
    assert status["dropped"].get("shutdown", 0) > 0
    # A batch the collector had not answered when the exporter ended counts as dropped (unconfirmed), even if
    # the receiver finishes reading it later.
    assert status["exported"] <= len(run.receiver.spans())
    assert status["exported"] + sum(status["dropped"].values()) == status["spans"] == 200
    assert "obs profiler dropped" in run.stderr and "shutdown" in run.stderr


def test_otel_sdk_disabled_sends_nothing(runs):
    run = runs["sdk_disabled"]
    assert run.done, run.process_stderr
    assert run.receiver.requests == []
    assert "OTEL_SDK_DISABLED" in run.stderr
    assert (run.folder / "obs_profile" / "rank_0" / "trace.json").exists()


@pytest.mark.parametrize("rdzv", ["c10d", "standalone"], ids=["run id agreed through the store", "launcher's id"])
def test_every_rank_of_a_step_shares_its_trace(tmp_path, rdzv):
    from exporters.trace_reader import read_folder

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launch = ["--standalone"] if rdzv == "standalone" else ["--rdzv-backend", "c10d", "--rdzv-endpoint",
                                                             f"127.0.0.1:{port}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TORCHELASTIC"))}
    env["PYTHONPATH"] = ROOT
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                          *launch, os.path.join(os.path.dirname(__file__), "dist_script.py")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    folder = read_folder(str(tmp_path / "obs_profile"))
    assert sorted(os.path.basename(os.path.dirname(f.path)) for f in folder.files) == ["rank_0", "rank_1"]
    steps: dict[int, dict[int, object]] = defaultdict(dict)
    for f in folder.files:
        for s in f.spans:
            if s.kind == "step":
                steps[s.attributes["ml.step"]][s.attributes["ml.rank"]] = s
    assert sorted(steps) == [1, 2, 3, 4, 5, 6]
    run_ids = {s.attributes["ml.run_id"] for by_rank in steps.values() for s in by_rank.values()}
    assert len(run_ids) == 1 and "none" not in run_ids
    for by_rank in steps.values():
        assert sorted(by_rank) == [0, 1] and by_rank[0].trace_id == by_rank[1].trace_id
        assert all(s.attributes["ml.world_size"] == 2 for s in by_rank.values())


def test_grpc_chosen_by_the_standard_protocol_variable(runs):
    run = runs["grpc_protocol"]
    assert run.done, run.process_stderr
    check_step_trees(run.receiver.spans(), [1, 2, 3, 4])
    assert set(run.receiver.paths) == {"grpc"}
