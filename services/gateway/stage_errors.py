"""How a failed gRPC stage call becomes the request's HTTP error, and which worker the gateway routes around."""

from __future__ import annotations

import logging

import grpc

from services.gateway.protocol import ApiError

log = logging.getLogger(__name__)


class StageFailed(Exception):
    """A stage failed before the request produced output; `blame` is the worker to route around (None: don't retry)."""

    def __init__(self, error: ApiError, blame: str | None):
        super().__init__(error.message)
        self.error = error
        self.blame = blame


def failure(stage: str, callee: str, source: str | None, e: grpc.aio.AioRpcError) -> StageFailed:
    if e.code() == grpc.StatusCode.UNAVAILABLE:  # the callee is down or draining
        return StageFailed(api_error_from_rpc(e, stage), callee)
    if e.code() == grpc.StatusCode.ABORTED:  # the callee could not pull its pages: their source failed
        return StageFailed(ApiError(503, f"{stage} could not get its pages: {e.details()}"), source or callee)
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
