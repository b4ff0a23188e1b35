"""Why a call between services failed: a typed reason in the call's trailing metadata.

A servicer that ends a call with an error names its reason (`services.errors`, the toggle's `Route`); the caller
reads it once, at its gRPC edge (`reason_of`). A call that never reached a servicer (a dead worker, a deadline)
carries only its status code, and the reason is read from that.
"""

from __future__ import annotations

import enum

import grpc

REASON_KEY = "epdmesh-reason"


class Reason(enum.Enum):
    DOWN = "down"  # the callee is down (dead, unreachable, its engine failed): route around it
    # the callee left the mesh on purpose — it drains, switches roles, or no longer holds the stage the call was
    # routed to it for: route around it, and it is not a failure of the request (it counts against no attempt)
    AWAY = "away"
    SOURCE_FAILED = "source-failed"  # the callee could not pull its pages: their source failed, route around that
    NO_ROOM = "no-room"  # no room now (KV full, every worker full): not a failure; route again when there is room
    REFUSED = "refused"  # admission control: no path meets the request's SLO; the client is told at once
    IMAGES_NOT_CACHED = "images-not-cached"  # sent without its images (predicted cached there): encode, send again
    TOO_LARGE = "too-large"  # no worker could ever hold the request: the client's error
    NO_WORKER = "no-worker"  # no live set of workers covers the request's stages
    INVALID = "invalid"  # the client's error
    NOT_FOUND = "not-found"
    MISMATCH = "mismatch"  # the two workers' configurations differ (their page layouts): ours, not the client's
    NOT_IDLE = "not-idle"  # a role switch found the worker's engine still busy after its grace: it keeps its roles
    INTERNAL = "internal"


CODES = {
    Reason.DOWN: grpc.StatusCode.UNAVAILABLE,
    Reason.AWAY: grpc.StatusCode.UNAVAILABLE,
    Reason.SOURCE_FAILED: grpc.StatusCode.ABORTED,
    Reason.NO_ROOM: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Reason.REFUSED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Reason.IMAGES_NOT_CACHED: grpc.StatusCode.FAILED_PRECONDITION,
    Reason.TOO_LARGE: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.NO_WORKER: grpc.StatusCode.UNAVAILABLE,
    Reason.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    Reason.MISMATCH: grpc.StatusCode.FAILED_PRECONDITION,
    Reason.NOT_IDLE: grpc.StatusCode.FAILED_PRECONDITION,
    Reason.INTERNAL: grpc.StatusCode.INTERNAL,
}
# a call that carries no reason: what its status code alone says
_FROM_CODE = {
    grpc.StatusCode.UNAVAILABLE: Reason.DOWN,
    grpc.StatusCode.DEADLINE_EXCEEDED: Reason.DOWN,
    grpc.StatusCode.ABORTED: Reason.SOURCE_FAILED,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Reason.NO_ROOM,
    grpc.StatusCode.INVALID_ARGUMENT: Reason.INVALID,
    grpc.StatusCode.NOT_FOUND: Reason.NOT_FOUND,
}


def metadata(reason: Reason) -> tuple[tuple[str, str], ...]:
    """The trailing metadata that names `reason`."""
    return ((REASON_KEY, reason.value),)


def reason_of(e: grpc.aio.AioRpcError) -> Reason:
    """The reason the callee gave, else the one its status code implies."""
    for key, value in e.trailing_metadata() or ():
        if key == REASON_KEY:
            try:
                return Reason(value)
            except ValueError:
                break  # a newer callee's reason: its code still says enough
    return _FROM_CODE.get(e.code(), Reason.INTERNAL)
