"""OpenTelemetry exporters: spans built from recorded events, OTLP, local files (see the OTel issue)."""

__all__: list[str] = []
