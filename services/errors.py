"""Exceptions → precise gRPC status codes and a typed reason (`services.failure`), for unary and server-streaming
servicer methods."""

from __future__ import annotations

import functools
import inspect
import logging

import grpc

from common.engine.async_engine import EngineDead
from common.engine.engine import NoRoomForPages, RequestRejected
from common.paged_cache import PageLayoutMismatch
from common.transfer import PullFailed
from services import failure
from services.failure import Reason

log = logging.getLogger(__name__)


class ShuttingDown(RuntimeError):
    """The worker is draining and takes no new work."""


class NotHeld(ShuttingDown):
    """A stage call for a role the worker does not hold now (it switched roles after the call was routed)."""


class SwitchFailed(RuntimeError):
    """A worker could not take the roles it was told to (its engine did not come idle): it keeps its old ones."""


class ImagesNotCached(Exception):
    """A stage sent without the request's images (predicted cached here) found them not cached: encode them."""

    def __init__(self, request_id: str):
        super().__init__(f"{request_id}: the images' KV is not in this worker's prefix cache")


_REASONS: list[tuple[type[BaseException], Reason]] = [
    (PageLayoutMismatch, Reason.MISMATCH),
    (SwitchFailed, Reason.NOT_IDLE),
    (ImagesNotCached, Reason.IMAGES_NOT_CACHED),
    (NoRoomForPages, Reason.NO_ROOM),  # a full cache: the gateway answers 503 + Retry-After
    (RequestRejected, Reason.INVALID),
    (ValueError, Reason.INVALID),
    (KeyError, Reason.NOT_FOUND),
    (PullFailed, Reason.SOURCE_FAILED),  # the pages' *source* failed: retry the request elsewhere
    (ShuttingDown, Reason.AWAY),  # and NotHeld: a route made before the worker's roles changed
    (EngineDead, Reason.DOWN),
]


def reason_for(exc: BaseException) -> tuple[Reason, grpc.StatusCode]:
    """Why `exc` ended a call, and the status code that says so."""
    reason = next((reason for kind, reason in _REASONS if isinstance(exc, kind)), Reason.INTERNAL)
    return reason, failure.CODES[reason]


def status_for(exc: BaseException) -> grpc.StatusCode:
    return reason_for(exc)[1]


def details_of(exc: BaseException) -> str:
    return str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)


async def _abort(context, exc: Exception, name: str) -> None:
    reason, code = reason_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("%s failed", name)
    await context.abort(code, details_of(exc) or type(exc).__name__, trailing_metadata=failure.metadata(reason))


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
