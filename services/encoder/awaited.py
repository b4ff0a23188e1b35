"""Awaited encodes: an Encode's handle, handed to the next stage that asks for it (`AwaitEncode`).

The gateway sends an image request's `Encode` (marked awaited) and its next stage's call (`Prefill` or
`Decode` with `pending_images`) at the same time; that stage asks this encoder for the image pages' handle
and gets it as soon as the encode is done. The handle goes encoder → next stage directly instead of
encoder → gateway → next stage, one hop less before the prefill can start.

Either call may arrive first, so the first one makes the request's slot. A slot ends when its one waiter
took the outcome (a second `AwaitEncode` is NOT_FOUND), or `ttl_s` after it was made or settled while no
encode runs for it (a waiter then gets NOT_FOUND): no slot outlives a gateway or stage that went away.
The pages themselves stay under their lease (`common.transfer.leases`), which frees them if nobody acks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc

from common.transfer import PageHandle, PullFailed
from epdmesh.v1 import mesh_pb2 as pb
from services import wire

if TYPE_CHECKING:
    from services.stage_calls.client import StageCalls


@dataclasses.dataclass
class _Slot:
    outcome: asyncio.Future
    since: float  # clock() when made, or when its encode settled
    encoding: bool = False
    taken: bool = False


class AwaitedEncodes:
    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic):
        if ttl_s <= 0:
            raise ValueError("the awaited-encode ttl must be positive")
        self.ttl_s = ttl_s
        self.clock = clock
        self._slots: dict[str, _Slot] = {}

    def __len__(self) -> int:
        return len(self._slots)

    def _slot(self, request_id: str) -> _Slot:
        slot = self._slots.get(request_id)
        if slot is None:
            slot = self._slots[request_id] = _Slot(asyncio.get_running_loop().create_future(), self.clock())
        return slot

    def begin(self, request_id: str) -> None:
        """The awaited Encode arrived: its slot does not expire while the encode runs."""
        self._slot(request_id).encoding = True

    def settle(self, request_id: str, handle: PageHandle | None = None, error: BaseException | None = None) -> None:
        """The awaited Encode's outcome: the handle, or the error its waiter gets."""
        slot = self._slot(request_id)
        slot.encoding, slot.since = False, self.clock()
        if slot.outcome.done():
            return
        if error is not None:
            slot.outcome.set_exception(error)
        else:
            slot.outcome.set_result(handle)

    async def wait(self, request_id: str) -> PageHandle:
        """The handle of this request's awaited Encode, once it is done (it may not have arrived yet)."""
        slot = self._slot(request_id)
        if slot.taken:
            raise KeyError(f"the image pages of {request_id} were already asked for")
        slot.taken = True
        try:
            return await slot.outcome
        finally:
            self._discard(request_id)

    def expire(self) -> int:
        """End the slots past their ttl (a waiter on one gets NOT_FOUND); how many ended."""
        now = self.clock()
        stale = [rid for rid, s in self._slots.items() if not s.encoding and now - s.since > self.ttl_s]
        for request_id in stale:
            outcome = self._slots[request_id].outcome
            if not outcome.done():
                outcome.set_exception(KeyError(f"no awaited Encode of {request_id} arrived within {self.ttl_s:.0f} s"))
            if not self._slots[request_id].taken:  # a waiter will read it and discard the slot
                self._discard(request_id)
        return len(stale)

    def _discard(self, request_id: str) -> None:
        slot = self._slots.pop(request_id, None)
        if slot is not None and slot.outcome.done() and not slot.outcome.cancelled():
            slot.outcome.exception()  # read, so an outcome nobody awaited is not logged as lost


async def fetch_awaited(calls: StageCalls, pending: pb.PendingImages) -> PageHandle:
    """Ask the encoder of `pending` for its image pages' handle (the next stage's side of an awaited encode).
    Any failure there is the pages' source failing: PullFailed (the gateway routes around that encoder)."""
    try:
        reply = await calls.call(pending.address, "await_encode", pb.AwaitEncodeRequest(request_id=pending.request_id))
    except grpc.aio.AioRpcError as e:
        raise PullFailed(
            f"encoder {pending.worker_id} gave no image pages for {pending.request_id}: {e.code().name}: {e.details()}"
        ) from None
    return wire.handle_from_pb(reply.image_pages)


async def image_pages_of(calls: StageCalls, request) -> PageHandle | None:
    """A Prefill/Decode request's image pages: a handle it carries, or one its pending images' encoder gives."""
    if request.HasField("pending_images"):
        return await fetch_awaited(calls, request.pending_images)
    return wire.optional_handle(request, "image_pages")
