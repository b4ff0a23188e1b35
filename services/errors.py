"""Exceptions → precise gRPC status codes, for unary and server-streaming servicer methods."""

from __future__ import annotations

import functools
import inspect
import logging

import grpc

from common.engine.async_engine import EngineDead
from common.engine.engine import NoRoomForPages, RequestRejected
from common.paged_cache import PageLayoutMismatch
from common.transfer import PullFailed
from services.wire import IMAGES_NOT_CACHED
from services.worker.runtime import ShuttingDown

log = logging.getLogger(__name__)

class ImagesNotCached(Exception):
    """A stage sent without the request's images (predicted cached here) found them not cached: encode them."""

    def __init__(self, request_id: str):
        super().__init__(f"{request_id}: {IMAGES_NOT_CACHED}")


_CODES: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (PageLayoutMismatch, grpc.StatusCode.FAILED_PRECONDITION),
    (ImagesNotCached, grpc.StatusCode.FAILED_PRECONDITION),
    (NoRoomForPages, grpc.StatusCode.RESOURCE_EXHAUSTED),  # a full cache: the gateway answers 503 + Retry-After
    (RequestRejected, grpc.StatusCode.INVALID_ARGUMENT),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
    (KeyError, grpc.StatusCode.NOT_FOUND),
    (PullFailed, grpc.StatusCode.ABORTED),  # the *source* of the pages failed: retry the request elsewhere
    (ShuttingDown, grpc.StatusCode.UNAVAILABLE),
    (EngineDead, grpc.StatusCode.UNAVAILABLE),
]


def status_for(exc: BaseException) -> grpc.StatusCode:
    for kind, code in _CODES:
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL


def details_of(exc: BaseException) -> str:
    return str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)


async def _abort(context, exc: Exception, name: str) -> None:
    code = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("%s failed", name)
    await context.abort(code, details_of(exc) or type(exc).__name__)


def grpc_errors(method):
    """Wrap a servicer method so that our exceptions end the call with the right status code."""
    if inspect.isasyncgenfunction(method):
        @functools.wraps(method)
        async def stream(self, request, context):
            try:
                async for item in method(self, request, context):
                    yield item
            except Exception as exc:
                if isinstance(exc, grpc.aio.AbortError):
                    raise
                await _abort(context, exc, method.__qualname__)
        return stream

    @functools.wraps(method)
    async def unary(self, request, context):
        try:
            return await method(self, request, context)
        except Exception as exc:
            if isinstance(exc, grpc.aio.AbortError):
                raise
            await _abort(context, exc, method.__qualname__)
    return unary
