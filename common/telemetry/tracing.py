"""OpenTelemetry tracing: one trace per request across every process, off (and free) unless configured.

On when the standard environment asks for it — `OTEL_EXPORTER_OTLP_ENDPOINT` or
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` set, and `OTEL_SDK_DISABLED` not true; `OTEL_SERVICE_NAME`
names the process. `setup_tracing` must run before any gRPC server or channel is made: it
instruments grpc.aio on both sides, so the W3C `traceparent` rides in the metadata of every hop.
When off, nothing of OpenTelemetry is imported and `span()` is a null context.

Attributes follow the OpenTelemetry GenAI conventions where they fit (`gen_ai.*`), plus ours
(`epdmesh.*`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping

log = logging.getLogger(__name__)


class Tracing:
    """What a process uses to make spans; `enabled` False means every call is (almost) free."""

    def __init__(self, service_name: str | None = None):
        self.enabled = False
        self._tracer = None
        self._provider = None
        if not tracing_requested():
            return
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.instrumentation.grpc import GrpcAioInstrumentorClient, GrpcAioInstrumentorServer
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        name = os.environ.get("OTEL_SERVICE_NAME") or service_name or "epdmesh"
        self._provider = TracerProvider(resource=Resource.create({"service.name": name}))
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        trace.set_tracer_provider(self._provider)
        from opentelemetry.instrumentation.grpc import filters

        # a StageCalls stream outlives the requests it carries: each call on it has its own spans (services/stage_calls)
        per_call = filters.negate(filters.service_name("epdmesh.v1.StageCalls"))
        GrpcAioInstrumentorServer(filter_=per_call).instrument()
        GrpcAioInstrumentorClient(filter_=per_call).instrument()
        self._tracer = trace.get_tracer("epdmesh")
        self.enabled = True
        log.info(
            "tracing on: service %s → %s",
            name,
            os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"),
        )

    @contextlib.contextmanager
    def span(
        self, name: str, attributes: Mapping | None = None, kind: str = "internal", context=None
    ) -> Iterator[object | None]:
        """A child of the current span (or of `context`); yields the span, or None when tracing is off."""
        if not self.enabled:
            yield None
            return
        with self._tracer.start_as_current_span(
            name, context=context, kind=_span_kind(kind), attributes=dict(attributes or {})
        ) as span:
            yield span

    def start_span(self, name: str, attributes: Mapping | None = None, kind: str = "internal", context=None):
        """A span the caller ends (`span.end()`), not made current; None when tracing is off."""
        if not self.enabled:
            return None
        return self._tracer.start_span(name, context=context, kind=_span_kind(kind), attributes=dict(attributes or {}))

    @contextlib.contextmanager
    def activate(self, span) -> Iterator[None]:
        """Make `span` current for a block (no `yield` of a generator inside it: the context must not change)."""
        if not self.enabled or span is None:
            yield
            return
        from opentelemetry import context as otel_context
        from opentelemetry.trace import set_span_in_context

        token = otel_context.attach(set_span_in_context(span))
        try:
            yield
        finally:
            otel_context.detach(token)

    def record_span(self, name: str, start_ns: int, end_ns: int, attributes: Mapping | None = None) -> None:
        """A finished child of the current span with given times (e.g. a queue wait measured by the engine)."""
        if not self.enabled or not start_ns or end_ns < start_ns:
            return
        span = self._tracer.start_span(name, start_time=start_ns, attributes=dict(attributes or {}))
        span.end(end_time=end_ns)

    def annotate(self, attributes: Mapping) -> None:
        """Set attributes on the current span (e.g. the server span of a gRPC call)."""
        if not self.enabled:
            return
        from opentelemetry import trace

        set_attributes(trace.get_current_span(), attributes)

    def extract(self, headers: Mapping[str, str]):
        """The trace context a client sent in HTTP headers (W3C traceparent), or None."""
        if not self.enabled:
            return None
        from opentelemetry.propagate import extract

        return extract(headers)

    def inject(self) -> dict[str, str]:
        """The current trace context as W3C headers (traceparent, tracestate), for a hop that is not its own rpc
        (a call on a stream kept open); empty when tracing is off."""
        if not self.enabled:
            return {}
        from opentelemetry.propagate import inject

        carrier: dict[str, str] = {}
        inject(carrier)
        return carrier

    def shutdown(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()


def _span_kind(kind: str):
    from opentelemetry.trace import SpanKind

    return {"internal": SpanKind.INTERNAL, "server": SpanKind.SERVER, "client": SpanKind.CLIENT}[kind]


def set_attributes(span, attributes: Mapping) -> None:
    if span is not None:
        span.set_attributes({k: v for k, v in attributes.items() if v is not None})


def tracing_requested(environ: Mapping[str, str] = os.environ) -> bool:
    if environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    return bool(environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
