"""A real OTLP receiver for the tests: an HTTP/protobuf server and a gRPC server, decoding what they receive
with the opentelemetry-proto classes (``ExportTraceServiceRequest``), as a collector does.

``delay_s`` makes it slow (each request waits before it is answered), ``status`` makes the HTTP side refuse
(e.g. 503).  ``spans()`` flattens what arrived: one dict per span with its resource and attributes decoded.
"""

from __future__ import annotations

import gzip
import http.server
import threading
import time
from concurrent import futures
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

__all__ = ["Receiver", "attr_value"]


def attr_value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [attr_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class Receiver:
    def __init__(self, *, delay_s: float = 0.0, status: int = 200) -> None:
        self.delay_s, self.status = delay_s, status
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.headers: list[dict[str, str]] = []
        self.paths: list[str] = []
        self._lock = threading.Lock()
        self._http: http.server.ThreadingHTTPServer | None = None
        self._http_thread: threading.Thread | None = None
        self._grpc: Any = None
        self._pool: futures.ThreadPoolExecutor | None = None

    def _record(self, request: Any, headers: dict[str, str], path: str) -> None:
        with self._lock:
            self.requests.append(request)
            self.headers.append(headers)
            self.paths.append(path)

    # -- HTTP/protobuf ------------------------------------------------------------------------
    def start_http(self, port: int = 0) -> str:
        """Serve OTLP/HTTP on ``port`` (0: a free one); its URL."""
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if owner.delay_s:
                    time.sleep(owner.delay_s)
                if owner.status != 200:
                    self.send_response(owner.status)
                    self.end_headers()
                    return
                request = trace_service_pb2.ExportTraceServiceRequest()
                request.ParseFromString(body)
                owner._record(request, {k.lower(): v for k, v in self.headers.items()}, self.path)
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        http.server.ThreadingHTTPServer.allow_reuse_address = True  # a receiver back on the port of one just stopped
        self._http = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._http.daemon_threads = True
        self._http_thread = threading.Thread(target=self._http.serve_forever, kwargs={"poll_interval": 0.05},
                                             name="test-otlp-http", daemon=True)
        self._http_thread.start()
        return f"http://127.0.0.1:{self._http.server_address[1]}"

    # -- gRPC ---------------------------------------------------------------------------------
    def start_grpc(self) -> str:
        owner = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 - the proto's name
                if owner.delay_s:
                    time.sleep(owner.delay_s)
                owner._record(request, {k: v for k, v in context.invocation_metadata()}, "grpc")
                return trace_service_pb2.ExportTraceServiceResponse()

        self._pool = futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="test-otlp-grpc")
        self._grpc = grpc.server(self._pool)
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self._grpc)
        port = self._grpc.add_insecure_port("127.0.0.1:0")
        self._grpc.start()
        return f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            assert self._http_thread is not None
            self._http_thread.join(5)
            self._http = None
        if self._grpc is not None:
            self._grpc.stop(grace=None).wait(5)
            self._grpc = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    # -- what arrived -------------------------------------------------------------------------
    def spans(self) -> list[dict[str, Any]]:
        out = []
        with self._lock:
            requests = list(self.requests)
        for request in requests:
            for rs in request.resource_spans:
                resource = {a.key: attr_value(a.value) for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        out.append({"name": s.name, "trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
                                    "parent_id": s.parent_span_id.hex(), "start": s.start_time_unix_nano,
                                    "end": s.end_time_unix_nano, "resource": resource, "scope": ss.scope.name,
                                    "attributes": {a.key: attr_value(a.value) for a in s.attributes},
                                    "status": s.status.code})
        return out
