"""The worker's side of `StageCalls`: the unary stage calls, multiplexed on one stream per caller.

Life of a call here:
  1. a `StageCall` arrives on an open stream; its body names the stage method (encode, await_encode,
     prefill) and the call runs in its own task, as a unary call's handler would, under a server span
     continuing the caller's trace context;
  2. its reply goes out on the stream as soon as it finishes (replies of calls on one stream go out in
     the order they finish): the response, or the status code the unary rpc would have ended with;
  3. a `cancel` for its id cancels its task (no reply), as a cancelled unary call's handler is cancelled;
     so does the stream ending, from either side.
The stream ends when the caller half-closes it and its calls finished, or when the worker drains (`end`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import grpc

from common.telemetry.tracing import Tracing
from epdmesh.v1 import mesh_pb2 as pb
from epdmesh.v1 import mesh_pb2_grpc as pb_grpc
from services.errors import details_of, reason_for
from services.failure import Reason
from services.stage_calls.methods import METHODS, span_attributes

log = logging.getLogger(__name__)

Handler = Callable[[object], Awaitable[object]]
_END = object()


class StageCallsServicer(pb_grpc.StageCallsServicer):
    def __init__(self, handlers: dict[str, Handler], tracing: Tracing | None = None):
        """`handlers`: by call body, the stage methods this worker serves (a call for another gets UNIMPLEMENTED)."""
        unknown = set(handlers) - set(METHODS)
        if unknown:
            raise ValueError(f"no stage call named {sorted(unknown)}")
        self.handlers = handlers
        self.tracing = tracing or Tracing()
        self._open: set[_Served] = set()

    async def Open(self, request_iterator, context):
        # an async generator, not context.write(): OpenTelemetry's server interceptor wraps stream handlers as one
        served = _Served(self, context)
        self._open.add(served)
        try:
            async for reply in served.replies(request_iterator):
                yield reply
        finally:
            self._open.discard(served)

    def end(self) -> None:
        """Draining: end every open stream now (their callers open new ones, to another worker's answer)."""
        for served in list(self._open):
            served.outbox.put_nowait(_END)

    @property
    def num_open(self) -> int:
        return len(self._open)


class _Served:
    """One open stream: its calls under way and the replies waiting to go out."""

    def __init__(self, servicer: StageCallsServicer, context):
        self.servicer = servicer
        self.context = context
        self.calls: dict[int, asyncio.Task] = {}
        self.outbox: asyncio.Queue = asyncio.Queue()

    async def replies(self, request_iterator):
        await self.context.send_initial_metadata(())  # the caller writes once it knows the stream was taken
        reader = asyncio.create_task(self._read(request_iterator))
        try:
            while (reply := await self.outbox.get()) is not _END:
                yield reply
        finally:
            reader.cancel()
            for task in list(self.calls.values()):
                task.cancel()

    async def _read(self, request_iterator) -> None:
        try:
            async for call in request_iterator:
                self._dispatch(call)
        except Exception as exc:  # the caller went away; the handler's own cancellation follows
            log.debug("a stage-call stream broke: %s", exc)
        if self.calls:  # half-closed: the calls under way still reply, then the stream ends
            await asyncio.gather(*self.calls.values(), return_exceptions=True)
        self.outbox.put_nowait(_END)

    def _dispatch(self, call: pb.StageCall) -> None:
        kind = call.WhichOneof("body")
        if kind == "cancel":
            task = self.calls.get(call.call_id)
            if task is not None:
                task.cancel()
            return
        if call.call_id in self.calls:
            self._reply_error(call.call_id, grpc.StatusCode.ALREADY_EXISTS, f"call {call.call_id} is already open")
            return
        handler = self.servicer.handlers.get(kind)
        if handler is None:
            self._reply_error(
                call.call_id, grpc.StatusCode.UNIMPLEMENTED, f"this worker does not serve {kind or 'an empty call'}"
            )
            return
        task = asyncio.create_task(
            self._run(call.call_id, kind, handler, getattr(call, kind), dict(call.trace_context))
        )
        self.calls[call.call_id] = task
        task.add_done_callback(lambda _, call_id=call.call_id: self.calls.pop(call_id, None))

    async def _run(self, call_id: int, kind: str, handler: Handler, message, trace_context: dict[str, str]) -> None:
        method, reply_body = METHODS[kind]
        tracing = self.servicer.tracing
        try:
            with tracing.span(
                method,
                span_attributes(method),
                kind="server",
                context=tracing.extract(trace_context) if trace_context else None,
            ):
                response = await handler(message)
        except Exception as exc:
            reason, code = reason_for(exc)
            if code == grpc.StatusCode.INTERNAL:
                log.exception("%s failed", method)
            self._reply_error(call_id, code, details_of(exc) or type(exc).__name__, reason)
            return
        self.outbox.put_nowait(pb.StageReply(call_id=call_id, **{reply_body: response}))

    def _reply_error(self, call_id: int, code: grpc.StatusCode, details: str, reason: Reason | None = None) -> None:
        error = pb.CallError(code=code.value[0], details=details, reason=reason.value if reason is not None else "")
        self.outbox.put_nowait(pb.StageReply(call_id=call_id, error=error))
