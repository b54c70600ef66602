"""Metrics through the OpenTelemetry SDK's own ``MeterProvider``: over OTLP, and a Prometheus pull endpoint.

Per rank, from the profiler's ring (the values are :mod:`exporters.step_metrics`'), with OpenTelemetry's
names and units (the Prometheus name after the arrow):

- histograms, seconds: ``obs.step.duration`` → ``obs_step_duration_seconds`` (a step's wall time),
  ``obs.step.phase.duration`` → ``obs_step_phase_duration_seconds`` (attribute ``phase``),
  ``obs.step.collectives.duration`` → ``obs_step_collectives_duration_seconds`` (time in collectives);
- gauges: ``obs.step`` → ``obs_step`` (the last finished step), ``obs.step.end_time`` →
  ``obs_step_end_time_seconds`` (when it ended, Unix time), ``obs.start_time`` → ``obs_start_time_seconds`` (when
  this rank's profiling session began, Unix time), ``obs.steps`` → ``obs_steps_per_second`` (over the last steps),
  ``obs.samples`` / ``obs.tokens`` → ``obs_samples_per_second`` / ``obs_tokens_per_second`` (where the batch size or the
  tokens per step is given), ``obs.memory.peak`` / ``obs.memory.used`` → ``obs_memory_peak_bytes`` /
  ``obs_memory_used_bytes`` (attribute ``device``), ``obs.scalar`` → ``obs_scalar`` (the last value of each
  ``obs.scalar(name, value)``, attribute ``name``);
- a counter: ``obs.nonfinite.findings`` → ``obs_nonfinite_findings_total`` (the NaN check's NaN/Inf findings);
- the training-health monitor's (:mod:`obs.features.monitor.metrics`): gauges ``obs.monitor.grad_norm`` →
  ``obs_monitor_grad_norm`` and ``obs.monitor.update_ratio.max`` → ``obs_monitor_update_ratio_max`` (attribute
  ``layer``), a counter ``obs.monitor.anomalies`` → ``obs_monitor_anomalies_total`` (attribute ``kind``).

Every data point carries ``ml.rank`` (Prometheus: ``ml_rank``).  The resource: ``service.name``,
``host.name``, ``ml.rank``, ``ml.world_size``, ``ml.run_id`` and ``ml.job_id`` (``SLURM_JOB_ID``, else
torchrun's ``TORCHELASTIC_RUN_ID``) where present; Prometheus shows it as ``target_info``.

OTLP: the SDK's exporter (the profiler's ``protocol``, else ``OTEL_EXPORTER_OTLP_[METRICS_]PROTOCOL``, else
HTTP/protobuf), to the profiler's endpoint with ``/v1/metrics``, else where
``OTEL_EXPORTER_OTLP_[METRICS_]ENDPOINT`` says; every ``OTEL_METRIC_EXPORT_INTERVAL`` (the SDK's default 60 s)
and at the end.  Prometheus: ``prometheus_client``'s HTTP server on this rank's host and port, with a
registry of its own; a port in use (the exporter of the session before, still draining) is tried again each
second for 30 s.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import numpy as np

from exporters.spans import StepRecord
from exporters.step_metrics import MetricState
from obs._core import env
from obs._core.version import __version__

__all__ = ["DURATION_BUCKETS_S", "Metrics", "job_id", "metrics_url"]

logger = logging.getLogger("obs")

#: Histogram bucket bounds of the durations (seconds): 1 ms to 10 min.
DURATION_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0,
                      150.0, 600.0)
_BIND_RETRY_S = 30.0


def job_id(environ: Mapping[str, str]) -> str:
    """The scheduler's job id: ``SLURM_JOB_ID``, else torchrun's ``TORCHELASTIC_RUN_ID`` (not its ``none``); ''."""
    slurm = env.text(env.SLURM_JOB_ID, environ=environ).strip()
    if slurm:
        return slurm
    run = env.text(env.TORCHELASTIC_RUN_ID, environ=environ).strip()
    return "" if run == "none" else run


def metrics_url(endpoint: str, protocol: str) -> str:
    """The profiler's OTLP endpoint for metrics: HTTP gets ``/v1/metrics`` where it has no path (a ``/v1/traces``
    path becomes ``/v1/metrics``); gRPC takes it as given."""
    if protocol != "http/protobuf":
        return endpoint
    parts = urlsplit(endpoint)
    if parts.path in ("", "/"):
        return endpoint.rstrip("/") + "/v1/metrics"
    if parts.path.endswith("/v1/traces"):
        return urlunsplit(parts._replace(path=parts.path[:-len("traces")] + "metrics"))
    return endpoint


class Metrics:
    """The meter provider, its readers and instruments for one exporter process; fed by :meth:`feed`.

    ``config`` is the exporter's :class:`exporters.sidecar.ExportConfig`; ``resource`` the OpenTelemetry
    resource of its spans (``ml.job_id`` is added); ``name`` turns a string id of the ring into its text;
    ``started`` when the rank's session began (Unix seconds; default: now).
    Nothing here raises into the exporter's loop for a collector or a port: what went wrong is in :attr:`notes`.
    """

    def __init__(self, config: Any, resource: Any, *, rank: int, name: Callable[[int], str],
                 environ: Mapping[str, str], started: float | None = None) -> None:
        self.config = config
        self.exporters = tuple(config.metrics)
        self.state = MetricState(name, batch_size=config.batch_size, tokens_per_step=config.tokens_per_step)
        self.notes: list[str] = []
        self.steps = 0  #: finished steps recorded
        self.nonfinite = 0  #: NaN/Inf findings of the NaN check (the ring's ``nan_inf`` markers)
        self.rank = rank
        self._job = job_id(environ)
        self._environ = environ
        self._provider: Any = None
        self._instruments: dict[str, Any] = {}
        self._registry: Any = None
        self._server: Any = None
        self._bind_started = time.monotonic()
        self._started = time.time() if started is None else started
        self._bind_next = 0.0
        self.serving = ""  #: ``host:port`` of the Prometheus endpoint once it listens
        if "prometheus" in self.exporters:
            self._registry = _registry()
            self._bind()
        self._build(resource)

    # -- set-up ---------------------------------------------------------------------------------
    def _build(self, resource: Any) -> None:
        from opentelemetry.sdk.metrics import Histogram, MeterProvider
        from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
        from opentelemetry.sdk.resources import Resource

        if self._job:
            resource = resource.merge(Resource({"ml.job_id": self._job}))
        readers = []
        if "prometheus" in self.exporters:
            from opentelemetry.exporter.prometheus import PrometheusMetricReader

            private = "registry" in inspect.signature(PrometheusMetricReader.__init__).parameters
            readers.append(PrometheusMetricReader(registry=self._registry) if private else PrometheusMetricReader())
        if "otlp" in self.exporters:
            reader = self._otlp_reader()
            if reader is not None:
                readers.append(reader)
        views = [View(instrument_type=Histogram, aggregation=ExplicitBucketHistogramAggregation(DURATION_BUCKETS_S))]
        self._provider = MeterProvider(metric_readers=readers, resource=resource, views=views,
                                       shutdown_on_exit=False)
        meter = self._provider.get_meter("obs", __version__)
        state = self.state
        self._instruments = {
            "step": meter.create_histogram("obs.step.duration", unit="s", description="Wall time of a training step"),
            "phase": meter.create_histogram("obs.step.phase.duration", unit="s",
                                            description="Time of a phase (data, forward, backward, optimizer) in a "
                                                        "step"),
            "collectives": meter.create_histogram("obs.step.collectives.duration", unit="s",
                                                  description="Time in collectives in a step"),
        }
        last = state.last_step
        gauges = [("obs.step", "{step}", "The last finished training step",
                   lambda: _one(None if (s := last()) is None else s[0])),
                  ("obs.step.end_time", "s", "When the last finished step ended (Unix time)",
                   lambda: _one(None if (s := last()) is None else s[1])),
                  ("obs.start_time", "s", "When this rank's profiling session began (Unix time)",
                   lambda: _one(self._started)),
                  ("obs.steps", "{step}/s", "Training steps per second over the last steps",
                   lambda: _one(state.steps_per_s()))]
        if self.config.batch_size:
            gauges.append(("obs.samples", "{sample}/s", "Samples per second (steps/s x batch size)",
                           lambda: _one(state.samples_per_s())))
        if self.config.tokens_per_step:
            gauges.append(("obs.tokens", "{token}/s", "Tokens per second (steps/s x tokens per step)",
                           lambda: _one(state.tokens_per_s())))
        gauges += [
            ("obs.memory.peak", "By", "Peak memory (CUDA: allocated peak; CPU: resident size)",
             lambda: [({"device": d}, peak) for d, (_, peak) in state.memory().items()]),
            ("obs.memory.used", "By", "Memory in use at the last step end",
             lambda: [({"device": d}, used) for d, (used, _) in state.memory().items()]),
            ("obs.scalar", "", "The last value of each obs.scalar(name, value)",
             lambda: [({"name": name}, value) for name, value in state.scalars().items()]),
        ]
        for name, unit, description, read in gauges:
            meter.create_observable_gauge(name, callbacks=[self._callback(read)], unit=unit, description=description)
        meter.create_observable_counter("obs.nonfinite.findings", unit="{finding}",
                                        description="NaN/Inf findings of the NaN check",
                                        callbacks=[self._callback(lambda: [({}, self.nonfinite)])])
        monitor = state.monitor
        meter.create_observable_gauge("obs.monitor.grad_norm", unit="", description="The training-health "
                                      "monitor's global gradient norm of the last step",
                                      callbacks=[self._callback(lambda: _one(monitor()[0]))])
        meter.create_observable_gauge("obs.monitor.update_ratio.max", unit="", description="The largest "
                                      "update/weight ratio of the last step (attribute layer: its parameter)",
                                      callbacks=[self._callback(lambda: [] if (m := monitor()[1]) is None else
                                                                [({"layer": m[0]}, m[1])])])
        meter.create_observable_counter("obs.monitor.anomalies", unit="{anomaly}", description="The training-health "
                                        "monitor's anomalies (attribute kind: wg, ur, mv, xy, loss)",
                                        callbacks=[self._callback(lambda: [({"kind": k}, n) for k, n in
                                                                           sorted(monitor()[2].items())])])

    def _callback(self, read: Any) -> Any:
        from opentelemetry.metrics import Observation

        def callback(options: Any) -> list[Any]:
            rank = {"ml.rank": self.rank}
            return [Observation(value, {**attrs, **rank}) for attrs, value in read()]

        return callback

    def _otlp_reader(self) -> Any:
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

        environ = self._environ
        protocol = (self.config.protocol or env.text(env.OTEL_EXPORTER_OTLP_METRICS_PROTOCOL, environ=environ)
                    or env.text(env.OTEL_EXPORTER_OTLP_PROTOCOL, environ=environ) or "http/protobuf").strip().lower()
        endpoint = metrics_url(self.config.endpoint, protocol) if self.config.endpoint else None
        try:
            if protocol == "grpc":
                from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as Grpc

                exporter: Any = Grpc(endpoint=endpoint)
            else:
                from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as Http

                exporter = Http(endpoint=endpoint)
        except Exception as exc:  # noqa: BLE001 - a bad endpoint or certificate: said, metrics go to Prometheus only
            self.notes.append(f"metrics: cannot export over OTLP ({type(exc).__name__}: {exc})")
            return None
        return PeriodicExportingMetricReader(exporter)

    def _bind(self) -> None:
        """Listen on this rank's Prometheus port (retried each second for a while when it is in use)."""
        from prometheus_client import start_http_server

        host, port = self.config.prometheus_host, self.config.prometheus_port
        self._bind_next = time.monotonic() + 1.0
        try:
            started = start_http_server(port, addr=host, registry=self._registry)
        except OSError as exc:
            if time.monotonic() - self._bind_started >= _BIND_RETRY_S:
                self._bind_next = float("inf")
                self.notes.append(f"metrics: cannot serve Prometheus on {host}:{port}: {exc}")
                logger.warning("obs profiler: %s", self.notes[-1])
            return
        self._server = started if isinstance(started, tuple) else None  # (server, thread) since 0.19
        self.serving = f"{host}:{port}"

    # -- the loop -------------------------------------------------------------------------------
    def feed(self, slots: np.ndarray, records: Iterable[StepRecord]) -> None:
        """The slots of one poll and the steps they finished."""
        self.state.feed(slots)
        step, phase, collectives = (self._instruments[k] for k in ("step", "phase", "collectives"))
        rank = {"ml.rank": self.rank}
        for values in self.state.finish(records):
            self.steps += 1
            if values.duration_s is not None:
                step.record(values.duration_s, rank)
            for name, seconds in values.phases.items():
                phase.record(seconds, {"phase": name, **rank})
            collectives.record(values.collectives_s, rank)
        if self._registry is not None and not self.serving and time.monotonic() >= self._bind_next:
            self._bind()

    def identity(self, resource: Any, rank: int) -> None:
        """The trainer learnt its rank and the job's run id: a new provider with the new resource (what the old
        one held is exported by its shutdown; the histograms start again)."""
        self.rank = rank
        self._shutdown_provider(2.0)
        self._build(resource)

    def _shutdown_provider(self, timeout_s: float) -> None:
        if self._provider is not None:
            try:
                self._provider.shutdown(timeout_millis=timeout_s * 1000)
            except Exception as exc:  # noqa: BLE001 - a collector that fails at the end: said, never raised
                self.notes.append(f"metrics: shutting down: {type(exc).__name__}: {exc}")
            self._provider = None

    def close(self, timeout_s: float) -> None:
        """Export what is left (OTLP) and stop serving (Prometheus)."""
        self._shutdown_provider(timeout_s)
        if self._server is not None:
            server, thread = self._server
            server.shutdown()
            server.server_close()
            thread.join(timeout_s)
            self._server = None

    def status(self) -> dict[str, Any]:
        return {"exporters": list(self.exporters), "prometheus": self.serving, "steps": self.steps,
                "scalars": self.state.scalar_count}


def _one(value: float | None) -> list[tuple[dict[str, str], float]]:
    return [] if value is None else [({}, value)]


def _registry() -> Any:
    """A registry of our own where the reader takes one; else prometheus_client's default (which also shows
    this exporter process's own process_* and python_* series)."""
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from prometheus_client import REGISTRY, CollectorRegistry

    if "registry" in inspect.signature(PrometheusMetricReader.__init__).parameters:
        return CollectorRegistry()
    return REGISTRY
