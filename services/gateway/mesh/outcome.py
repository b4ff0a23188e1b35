"""How a stage or a route failed the request: one typed outcome, classified once at the gRPC edge.

A call's error becomes a `StageError` (`classify`): its `Reason` (the callee's, from trailing metadata, else from the
status code), the worker to route around (`blame`), and the message. The failover loop decides on the reason alone;
`api_error` is the one place a failure becomes the client's HTTP status.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from services.failure import Reason, reason_of
from services.gateway.errors import ApiError

log = logging.getLogger(__name__)

_RETRY = {"Retry-After": "1"}


class StageError(Exception):
    """A stage (or the route) failed the request. `blame`: the worker registration to route around (None: another
    route would fail the same way)."""

    def __init__(self, reason: Reason, stage: str, message: str, blame: str | None = None):
        super().__init__(message)
        self.reason = reason
        self.stage = stage
        self.message = message
        self.blame = blame

    @property
    def away(self) -> bool:
        """Not a failure: the worker left the mesh on purpose after the route chose it (route around it)."""
        return self.reason == Reason.AWAY

    @property
    def no_room(self) -> bool:
        """Not a failure: no worker has room now (it routes again when one has)."""
        return self.reason == Reason.NO_ROOM

    def api_error(self) -> ApiError:
        """What the client is told."""
        stage, message = self.stage, self.message
        match self.reason:
            case Reason.INVALID:
                return ApiError(400, message)
            case Reason.TOO_LARGE:
                return ApiError(400, message, "max_tokens")
            case Reason.NO_ROOM | Reason.REFUSED:
                return ApiError(503, f"{stage}: {message}", headers=_RETRY)
            case Reason.DOWN | Reason.AWAY | Reason.NO_WORKER:
                return ApiError(503, f"{stage} is unavailable: {message}", headers=_RETRY)
            case Reason.SOURCE_FAILED:
                return ApiError(503, f"{stage} could not get its pages: {message}", headers=_RETRY)
        log.error("%s failed: %s %s", stage, self.reason.name, message)
        return ApiError(500, f"{stage} failed: {self.reason.name}: {message}")


class HandedBack(Exception):
    """The decoder preempted the request and could not recompute it, or is switching roles: go on with it elsewhere
    — from its KV pages (`kv`: the prompt's and every output token's but the last) when it handed those back too."""

    def __init__(self, worker_id: str, kv=None, source: str | None = None):
        super().__init__(f"worker {worker_id} handed the request back")
        self.worker_id = worker_id
        self.kv = kv  # a pb.PageHandle, or None
        self.source = source  # the registration of the worker that holds them


def classify(stage: str, e: grpc.aio.AioRpcError, callee: str | None = None, source: str | None = None) -> StageError:
    """The outcome of a failed call to `callee` (a worker registration; None: the toggle), whose pages (if any)
    came from `source`: a worker down is routed around, a failed source too, a full one waited out."""
    reason = reason_of(e)
    blame = {Reason.DOWN: callee, Reason.AWAY: callee, Reason.NO_ROOM: callee, Reason.SOURCE_FAILED: source or callee}
    blame = blame.get(reason)
    return StageError(reason, stage, e.details() or e.code().name, blame)


async def answer_of(stage: str, call, callee: str, source: str | None = None):
    """The call's reply; its failure as a StageError."""
    try:
        return await call
    except grpc.aio.AioRpcError as e:
        raise classify(stage, e, callee, source) from None


def is_uncached(answer_error: BaseException | None) -> bool:
    """A stage sent without its images (predicted cached there) answered that they are not."""
    return isinstance(answer_error, grpc.aio.AioRpcError) and reason_of(answer_error) == Reason.IMAGES_NOT_CACHED


def source_failed(answer_error: BaseException | None) -> bool:
    """A stage answered that the source of its pages failed."""
    return isinstance(answer_error, grpc.aio.AioRpcError) and reason_of(answer_error) == Reason.SOURCE_FAILED


def consume(task: asyncio.Future) -> None:
    """Retrieve a background task's outcome (a reservation, an awaited Encode), so an error nobody awaited is not
    logged as unhandled."""
    if not task.cancelled():
        task.exception()
