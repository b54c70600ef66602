"""Spans → OpenTelemetry: the resource, SDK ``ReadableSpan`` objects, OTLP JSON, and a bounded OTLP sender.

The sender hands batches to the SDK's own OTLP exporters (gRPC or HTTP/protobuf), which honour the
``OTEL_EXPORTER_OTLP_*`` variables (headers, certificate, timeout, compression).  Its queue is
bounded (``OTEL_BSP_MAX_QUEUE_SIZE`` spans): while it is full the exporter leaves the spans' slots in
the ring, which is the real buffer (a slow collector then costs ring overruns, counted, never a
blocked trainer).  A batch that finds the queue full, a batch the collector refused or never
answered, and a batch still queued when the deadline of :meth:`OtlpSender.close` passes are counted
in :attr:`dropped` (the SDK's own processor drops without counting).
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from exporters.spans import Span
from obs._core import env
from obs._core.version import __version__

__all__ = ["OtlpSender", "endpoint_from_env", "protocol_from_env", "readable_spans", "request_json", "resource",
           "traces_url"]

_SCOPE = ("obs", __version__)


def endpoint_from_env(environ: Mapping[str, str] = os.environ) -> str:
    """The collector named by the standard variables ('' when none): the traces one wins, used as is."""
    return environ.get(env.OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, "") or environ.get(env.OTEL_EXPORTER_OTLP_ENDPOINT, "")


def protocol_from_env(environ: Mapping[str, str] = os.environ) -> str:
    value = environ.get(env.OTEL_EXPORTER_OTLP_TRACES_PROTOCOL) or environ.get(env.OTEL_EXPORTER_OTLP_PROTOCOL) or \
        "http/protobuf"
    return value.strip().lower()


def traces_url(endpoint: str, protocol: str) -> str:
    """HTTP: a URL without a path gets ``/v1/traces`` (as OTEL_EXPORTER_OTLP_ENDPOINT does); gRPC: as given."""
    if protocol == "http/protobuf" and urlsplit(endpoint).path in ("", "/"):
        return endpoint.rstrip("/") + "/v1/traces"
    return endpoint


def resource(meta: Mapping[str, Any], *, rank: int, world_size: int, pid: int) -> Any:
    """``service.name`` (OTEL_SERVICE_NAME, default ``obs``), host, pid, rank, run id, torch version, and
    OTEL_RESOURCE_ATTRIBUTES (which the SDK merges in)."""
    from opentelemetry.sdk.resources import Resource

    versions = meta.get("versions", {}) if isinstance(meta.get("versions"), dict) else {}
    attrs: dict[str, str | int] = {"service.name": env.text(env.OTEL_SERVICE_NAME, "obs"),
             "host.name": str(meta.get("host") or socket.gethostname()), "process.pid": pid,
             "process.runtime.name": "cpython", "ml.rank": rank, "ml.world_size": world_size,
             "ml.run_id": str(meta.get("run_id", "")), "ml.framework": "pytorch",
             "ml.framework.version": str(versions.get("torch", "unknown"))}
    return Resource.create(attrs)


def readable_spans(spans: Sequence[Span], res: Any) -> list[Any]:
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    from opentelemetry.trace import (
        SpanContext,
        SpanKind,
        Status,
        StatusCode,
        TraceFlags,
    )

    scope = InstrumentationScope(*_SCOPE)
    flags = TraceFlags(TraceFlags.SAMPLED)
    out = []
    for s in spans:
        ctx = SpanContext(s.trace_id, s.span_id, is_remote=False, trace_flags=flags)
        parent = SpanContext(s.trace_id, s.parent_id, is_remote=False, trace_flags=flags) if s.parent_id else None
        out.append(ReadableSpan(s.name, ctx, parent, res, s.attributes, kind=SpanKind.INTERNAL,
                                status=Status(StatusCode.ERROR) if s.error else Status(StatusCode.UNSET),
                                start_time=s.start_ns, end_time=s.end_ns, instrumentation_scope=scope))
    return out


def request_json(readable: Sequence[Any]) -> dict[str, Any]:
    """One ExportTraceServiceRequest in OTLP JSON: the protobuf JSON mapping with hex trace and span ids and
    integer enums, as the OTLP specification asks."""
    from google.protobuf.json_format import MessageToDict
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    data: dict[str, Any] = MessageToDict(encode_spans(readable), use_integers_for_enums=True)
    for rs in data.get("resourceSpans", ()):
        for ss in rs.get("scopeSpans", ()):
            for span in ss.get("spans", ()):
                for key in ("traceId", "spanId", "parentSpanId"):
                    if key in span:
                        span[key] = _b64_to_hex(span[key])
    return data


def _env_int(name: str, default: int) -> int:
    try:
        value = int(os.environ.get(name, ""))
    except ValueError:
        return default
    return value if value > 0 else default


def _b64_to_hex(text: str) -> str:
    import base64

    return base64.b64decode(text).hex()


class OtlpSender:
    """Sends batches of ReadableSpans from a thread; never blocks the caller; counts what it drops."""

    def __init__(self, endpoint: str, protocol: str, *, max_spans: int | None = None) -> None:
        """``endpoint`` "" lets the SDK read OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT itself; ``max_spans`` bounds the
        spans waiting to be sent (default OTEL_BSP_MAX_QUEUE_SIZE, else 2048, as the SDK's batch processor)."""
        logging.getLogger("opentelemetry.exporter").setLevel(logging.CRITICAL)  # we report drops ourselves
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                OTLPSpanExporter as Grpc,
            )

            insecure = True if urlsplit(endpoint).scheme == "http" else None
            self._exporter: Any = Grpc(endpoint=endpoint, insecure=insecure) if endpoint else Grpc()
        elif protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter as Http,
            )

            self._exporter = Http(endpoint=traces_url(endpoint, protocol)) if endpoint else Http()
        else:
            raise ValueError(f"OTLP protocol {protocol!r} is not supported (grpc or http/protobuf)")
        self.endpoint, self.protocol = endpoint, protocol
        self.max_spans = max_spans or _env_int("OTEL_BSP_MAX_QUEUE_SIZE", 2048)
        self._queue: queue.Queue[list[Any] | None] = queue.Queue()
        self._inflight = 0  # spans of the batch being exported now
        self._queued = 0  # spans waiting (a batch larger than the bound is taken alone when nothing waits)
        self._lock = threading.Lock()
        self.exported = 0
        self.dropped = {"queue_full": 0, "export_failed": 0, "shutdown": 0}
        self.last_error = ""
        self._thread = threading.Thread(target=self._run, name="obs-otlp-sender", daemon=True)
        self._thread.start()

    @property
    def backlog(self) -> int:
        """Spans waiting to be sent (the exporter stops reading the ring while this is at the bound)."""
        return self._queued

    def submit(self, batch: list[Any], *, force: bool = False) -> None:
        """Queue ``batch``; dropped (and counted) when the queue is full, unless ``force`` (a caller that bounds the
        queue itself, as the exporter does by not reading the ring while it is full)."""
        if not batch:
            return
        with self._lock:
            if not force and self._queued and self._queued + len(batch) > self.max_spans:
                self.dropped["queue_full"] += len(batch)
                return
            self._queued += len(batch)
        self._queue.put_nowait(batch)

    def _run(self) -> None:
        from opentelemetry.sdk.trace.export import SpanExportResult

        while True:
            batch = self._queue.get()
            if batch is None:
                return
            self._inflight = len(batch)
            try:
                result = self._exporter.export(batch)
            except Exception as exc:  # noqa: BLE001 - an exporter bug or an unexpected transport: counted, not fatal
                result, self.last_error = None, f"{type(exc).__name__}: {exc}"
            with self._lock:
                self._queued -= len(batch)
                self._inflight = 0
            if result == SpanExportResult.SUCCESS:
                self.exported += len(batch)
            else:
                self.dropped["export_failed"] += len(batch)
                self.last_error = self.last_error or "the collector refused the spans or could not be reached"

    def close(self, deadline_s: float) -> None:
        """Send what is queued until ``deadline_s`` passes; what is left then is counted as dropped."""
        end = time.monotonic() + deadline_s
        while not self._queue.empty() and time.monotonic() < end:
            time.sleep(0.02)
        while True:
            try:
                batch = self._queue.get_nowait()
            except queue.Empty:
                break
            if batch is not None:
                self.dropped["shutdown"] += len(batch)
                with self._lock:
                    self._queued -= len(batch)
        self._queue.put(None)
        self._thread.join(max(0.0, end - time.monotonic()))
        self._exporter.shutdown()  # interrupts a retry loop still running
        self._thread.join(2.0)
        with self._lock:
            if self._thread.is_alive() and self._inflight:  # still waiting for the collector's answer: not sent
                self.dropped["shutdown"] += self._inflight
                self._inflight = 0
