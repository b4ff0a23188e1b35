"""Traces (OpenTelemetry → OTLP) and metrics (Prometheus) of every epdmesh process."""
