"""What the gateway records about each request: the trace's root span and the request metrics.

Life of a request here:
  1. `RequestObserver(...)` at arrival: root span `chat.completions` (continuing the client's W3C
     trace context if it sent one), `num_requests_running` up;
  2. `request(chat)`: the request's gen_ai attributes; `failed(status)` when it is refused;
  3. `observe(outputs)` wraps the output stream: TTFT at the first token, one inter-token gap per
     later output, and at the end the usage, finish reason, e2e latency and SLO outcome;
  4. the span ends and the gauge goes down exactly once, however the stream ends (finished,
     failed, or the client gone).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping

from common.engine.outputs import RequestOutput
from common.telemetry.metrics import GatewayMetrics
from common.telemetry.tracing import Tracing, set_attributes
from services.gateway.errors import ApiError
from services.gateway.protocol import ChatRequest


class _Stream:
    """One output stream's timings."""

    __slots__ = ("first_at", "last_at", "gaps", "final")

    def __init__(self):
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.gaps: list[float] = []
        self.final: RequestOutput | None = None


class RequestObserver:
    def __init__(
        self, metrics: GatewayMetrics, tracing: Tracing, headers: Mapping[str, str], model: str, operation: str = "chat"
    ):
        """`operation`: OpenTelemetry GenAI's name for it, "chat" or "text_completion" (`/v1/completions`)."""
        self.metrics = metrics
        self.tracing = tracing
        self.model = model
        self.arrival = time.monotonic()
        self.num_prompt = 0
        self._streams = 0  # output streams under way (one per choice)
        self._reasons: list[str] = []
        self._generated = 0
        self._ttft = float("inf")
        self.slo: tuple[float | None, float | None] = (None, None)  # the request's own targets, seconds
        self._open = True
        name = "chat.completions" if operation == "chat" else "completions"
        self.span = tracing.start_span(
            name,
            {"gen_ai.operation.name": operation, "gen_ai.system": "epdmesh", "gen_ai.request.model": model},
            kind="server",
            context=tracing.extract(headers),
        )
        if headers.get("x-request-id"):  # the client's own id for it (echoed in the answer's headers: `edge.py`)
            set_attributes(self.span, {"http.request.header.x-request-id": [headers["x-request-id"][:256]]})
        metrics.running.labels(model).inc()

    def request(self, chat: ChatRequest, request_id: str) -> None:
        self.slo = (
            chat.slo_ttft_ms / 1e3 if chat.slo_ttft_ms else None,
            chat.slo_tbt_ms / 1e3 if chat.slo_tbt_ms else None,
        )
        s = chat.sampling
        set_attributes(
            self.span,
            {
                "gen_ai.request.max_tokens": s.max_tokens if chat.max_tokens_given else None,
                "gen_ai.request.temperature": s.temperature,
                "gen_ai.request.top_p": s.top_p,
                "gen_ai.request.seed": s.seed,
                "gen_ai.response.id": request_id,
                "epdmesh.stream": chat.stream,
            },
        )

    def abandoned(self) -> None:
        """The request ended before an answer because its client left (or the server stopped): not an error."""
        if self.span is not None:
            self.span.set_attribute("epdmesh.abandoned", True)
        self._close()

    def failed(self, status: int, message: str) -> None:
        if not self._open:  # another of its streams (n > 1) failed first: one request, one error
            return
        self.metrics.errors.labels(self.model, str(status)).inc()
        if self.span is not None:
            from opentelemetry.trace import Status, StatusCode

            self.span.set_status(Status(StatusCode.ERROR, message))
            self.span.set_attribute("http.response.status_code", status)
        self._close()

    def observe(self, outputs: AsyncIterator[RequestOutput], num_prompt: int) -> AsyncIterator[RequestOutput]:
        """One output stream of the request (n > 1: one per choice, each counted as a sequence in the metrics);
        the request's span and gauge end with the last of them (counted from now, not from its first read)."""
        self.num_prompt = num_prompt
        self._streams += 1
        return self._observe(outputs)

    async def _observe(self, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
        stream = _Stream()
        try:
            async for out in outputs:
                self._tokens(out, stream)
                stream.final = out
                yield out
        except ApiError as e:
            self.failed(e.status, e.message)
            raise
        except Exception as e:  # a bug of ours mid-stream: counted as a 500
            self.failed(500, f"{type(e).__name__}: {e}")
            raise
        finally:
            self._streams -= 1
            if self._open:
                self._finish(stream)
            if hasattr(outputs, "aclose"):  # its request ends now (the client gone), not when it is collected
                await outputs.aclose()

    def _tokens(self, out: RequestOutput, stream: _Stream) -> None:
        if not out.new_token_ids:
            return
        now = time.monotonic()
        if stream.first_at is None:
            stream.first_at = now
            self.metrics.first_token(now - self.arrival)
        else:
            stream.gaps.append(now - stream.last_at)
            self.metrics.inter_token(now - stream.last_at)
        stream.last_at = now

    def _finish(self, stream: _Stream) -> None:
        final = stream.final
        reason = final.finish_reason if final is not None and final.finished else "abort"  # abort: the client left
        generated = len(final.output_token_ids) if final is not None else 0
        ttft = (stream.first_at or time.monotonic()) - self.arrival
        self.metrics.finished(
            reason, self.num_prompt, generated, time.monotonic() - self.arrival, ttft, stream.gaps, *self.slo
        )
        self._reasons.append(reason)
        self._generated += generated
        self._ttft = min(self._ttft, ttft)
        if self._streams:
            return
        set_attributes(
            self.span,
            {
                "gen_ai.usage.input_tokens": self.num_prompt,
                "gen_ai.usage.output_tokens": self._generated,
                "gen_ai.response.finish_reasons": self._reasons,
                "epdmesh.ttft_ms": self._ttft * 1e3,
            },
        )
        self._close()

    def _close(self) -> None:
        if not self._open:
            return
        self._open = False
        self.metrics.running.labels(self.model).dec()
        if self.span is not None:
            self.span.end()
