"""OpenTelemetry exporters: spans built from the profiler's ring, outside the training process.

- :mod:`exporters.follow`: read a ring as its writer fills it; gather slots into steps.
- :mod:`exporters.spans`: one step's spans (step → phases → modules → ops) within a budget.
- :mod:`exporters.otlp`: the resource, SDK spans, OTLP JSON, a bounded OTLP sender (gRPC, HTTP/protobuf).
- :mod:`exporters.local_files`: ``traces.otlp.jsonl`` and ``trace.json`` (Chrome trace), rotated by size.
- :mod:`exporters.sidecar`: the exporter process (``python -m exporters``).
- :mod:`exporters.trace_reader`, :mod:`exporters.trace_summary`: readers of the files and their summary (pure).

From :mod:`recorder` only the ring's layout and reader are used.
"""

__all__: list[str] = []
