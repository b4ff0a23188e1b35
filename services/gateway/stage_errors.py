"""How a failed gRPC stage call becomes the request's HTTP error, and which worker the gateway routes around."""

from __future__ import annotations

import asyncio
import logging

import grpc

from epdmesh.v1 import mesh_pb2 as pb
from services import wire
from services.gateway.protocol import ApiError
from services.toggle.router import NoRoute

log = logging.getLogger(__name__)


class StageFailed(Exception):
    """A stage failed before the request produced output; `blame` is the worker to route around (None: don't retry)."""

    def __init__(self, error: ApiError, blame: str | None, busy: bool = False):
        super().__init__(error.message)
        self.error = error
        self.blame = blame
        self.busy = busy  # not a failure: the worker had no room for it (its KV was reserved meanwhile)


def failure(stage: str, callee: str, source: str | None, e: grpc.aio.AioRpcError) -> StageFailed:
    if e.code() == grpc.StatusCode.UNAVAILABLE:  # the callee is down or draining
        return StageFailed(api_error_from_rpc(e, stage), callee)
    if e.code() == grpc.StatusCode.ABORTED:  # the callee could not pull its pages: their source failed
        return StageFailed(ApiError(503, f"{stage} could not get its pages: {e.details()}"), source or callee)
    if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:  # no room for the pages there yet: not its failure
        return StageFailed(api_error_from_rpc(e, stage), callee, busy=True)
    return StageFailed(api_error_from_rpc(e, stage), None)


async def stage_call(stage: str, callee: str, source: str | None, call):
    try:
        return await call
    except grpc.aio.AioRpcError as e:
        raise failure(stage, callee, source, e) from None


def api_error_from_rpc(e: grpc.aio.AioRpcError, stage: str) -> ApiError:
    code = e.code()
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return ApiError(400, e.details())
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # admission control: come back shortly
        return ApiError(503, f"{stage}: {e.details()}", headers={"Retry-After": "1"})
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return ApiError(503, f"{stage} is unavailable: {e.details()}")
    log.error("%s failed: %s %s", stage, code.name, e.details())
    return ApiError(500, f"{stage} failed: {code.name}: {e.details()}")


async def encoded(encoding: asyncio.Task | None, held: list[pb.PageHandle], call) -> None:
    """Wait for the awaited Encode the next stage's `call` depends on; its failure is the request's (the call,
    left waiting for pages that will not come, is cancelled). The image handle is held until the call took it."""
    if encoding is None:
        return
    try:
        reply = await encoding
    except BaseException:
        call.cancel()
        raise
    held.append(reply.image_pages)


async def encoded_unless_answered(encoding: asyncio.Task | None, held: list[pb.PageHandle], answer: asyncio.Future) -> None:
    """`encoded`, unless the next stage's `answer` comes first: a worker whose prefix cache holds the images' KV does
    not wait for their pages (`WorkerRuntime.pin_cached_images`), so its first token is not held up behind an encode it
    does not need — and the Encode is cancelled (the encoder stops the work, if it has not finished it)."""
    if encoding is None:
        return
    await asyncio.wait((encoding, answer), return_when=asyncio.FIRST_COMPLETED)
    if encoding.done() or _source_failed(answer):  # a failed encode fails its waiting stage (ABORTED) at once:
        await encoded(encoding, held, answer)        # the Encode's own error says what went wrong (a 400, say)
    else:
        encoding.cancel()


def _source_failed(answer: asyncio.Future) -> bool:
    """The stage answered that the source of its pages failed."""
    if not answer.done() or answer.cancelled():
        return False
    e = answer.exception()
    return isinstance(e, grpc.aio.AioRpcError) and e.code() == grpc.StatusCode.ABORTED


async def confirmed(reserved: asyncio.Future | None, plan: pb.RoutePlan) -> None:
    """The plan's reservation is made; a worker that had no room after all is routed around (a 503 with
    Retry-After when no other one has room)."""
    if reserved is None:
        return
    try:
        await reserved
    except NoRoute as e:
        full = next((r for r in (plan.decoder, plan.prefill) if r.worker_id == e.full), None)
        raise StageFailed(ApiError(503, f"routing: {e.message}", headers={"Retry-After": "1"}),
                          wire.ref_registration(full) if full is not None else None, busy=True) from None
