"""Routes for the gateway's requests: in-process over the registry, or from the toggle; waiting for room.

1. `route`: the plan, from the router in this process (`services.routing`, one Redis round trip for the
   reservation) when the gateway was given the registry, else from the toggle's `Route` rpc (protobuf ends here:
   the router's own `RoutePlan` travels on). With `ahead`, the plan comes before its reservation is made: the
   first stage call goes out meanwhile (`Router.route_ahead`).
2. `reroute`: a request no worker has room for waits for room (up to ROOM_WAIT_S), as a queued request would; one
   that was under way also waits (up to FAILOVER_WAIT_S) for a worker of a role none is left of — a restarted one.
3. Each attempt's `Route` carries the router's record of the request: which worker the request reaches when
   (`reached`), its first token (`prefilled`), its end (`end`): until then its route loads those workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable

import grpc

from common.policy.routing import RoutePlan, RouteSummary, RoutingConfig
from common.telemetry.metrics import GatewayMetrics
from common.telemetry.tracing import Tracing
from common.transfer.channels import ChannelPool
from common.workers import WorkerSnapshot
from epdmesh.v1 import mesh_pb2 as pb
from epdmesh.v1 import mesh_pb2_grpc as pb_grpc
from services import wire
from services.failure import Reason
from services.gateway.mesh.outcome import StageError, classify, consume
from services.routing.router import NoRoute, Router, largest_decoder_cache

log = logging.getLogger(__name__)

# a request whose worker died waits this long for one to take its place (`epdmesh serve` restarts a dead worker,
# which registers within seconds) before it fails; new requests are not held: they get a 503 at once
FAILOVER_WAIT_S = 30.0
# a stream under way (tokens sent) that no decoder has room for waits this long — as a queued request would; a
# decoder that handed it back made room for an older one that may run for minutes
ROOM_WAIT_S = 300.0
FAILOVER_POLL_S = 0.25
CAPACITY_REFRESH_S = 5.0
# a worker is counted as long as routing still sends it work: /health says what the router believes
HEALTHY_HEARTBEAT_AGE_S = RoutingConfig().max_heartbeat_age_s


def wait_for(reason: Reason, under_way: bool) -> float | None:
    """How long `RouteClient.reroute` waits out a route refused for `reason` (None: not at all, the client's error
    at once): room always; a worker of a role none is left of only for a request that was under way."""
    if reason == Reason.NO_ROOM:
        return ROOM_WAIT_S
    if under_way and reason in (Reason.NO_WORKER, Reason.DOWN, Reason.AWAY):
        return FAILOVER_WAIT_S
    return None


@dataclasses.dataclass(slots=True)
class Route:
    """One attempt's route: the plan, its KV reservation (None: made already, or none), and the router's record of
    the request (None: the toggle routed it, and keeps none)."""

    plan: RoutePlan
    request_id: str
    router: Router | None = None
    reserved: asyncio.Future | None = None
    # the first stage call's message is out: a reservation made ahead may go to Redis now
    written: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    def reached(self, worker: WorkerSnapshot) -> None:
        """The request's stage call to `worker` goes out now: until then its route loads that worker."""
        if self.router is not None:
            self.router.sent(self.request_id, worker.worker_id)

    def prefilled(self) -> None:
        """Its first token came: its prefill no longer loads the worker."""
        if self.router is not None:
            self.router.prefilled(self.request_id)

    async def confirmed(self) -> None:
        """The reservation is made; a worker that had no room after all is a StageError(NO_ROOM) blaming it."""
        if self.reserved is None:
            return
        try:
            await self.reserved
        except NoRoute as e:
            full = next((w for w in (self.plan.decoder, self.plan.prefill) if w.worker_id == e.full), None)
            raise StageError(
                Reason.NO_ROOM, "routing", e.message, full.info.registration if full is not None else None
            ) from None

    def end(self) -> None:
        """The attempt is over (finished, failed, or routed again): its reservation and record end with it."""
        self.written.set()
        if self.reserved is not None:
            self.reserved.cancel()  # a no-op once it is done
        if self.router is not None:
            self.router.forget(self.request_id)


class RouteClient:
    def __init__(
        self,
        channels: ChannelPool,
        toggle_address: str,
        router: Router | None = None,
        tracing: Tracing | None = None,
        metrics: GatewayMetrics | None = None,
    ):
        """`router`: route in this process over the registry in Redis; None: ask the toggle (a gRPC hop)."""
        self.channels = channels
        self.toggle_address = toggle_address
        self.router = router
        self.tracing = tracing or Tracing()
        self.metrics = metrics
        self._refresher: asyncio.Task | None = None
        self._capacity, self._capacity_at = 0, float("-inf")  # toggle-routed: the largest decoder's cache, and when

    @property
    def toggle(self) -> pb_grpc.ToggleStub:
        return pb_grpc.ToggleStub(self.channels.get(self.toggle_address))

    async def route(self, summary: RouteSummary, span, attempt: int, ahead: bool = False) -> Route:
        """The request's route, or StageError. `ahead`: its reservation still under way in `Route.reserved` (the
        caller sends its first stage call meanwhile and sets `Route.written` once that call's message is out)."""
        try:
            with self.tracing.activate(span), self.tracing.span("route", {"epdmesh.attempt": attempt}):
                if self.router is None:
                    reply = await self.toggle.Route(wire.summary_to_pb(summary), timeout=10)
                    return Route(wire.plan_from_pb(reply), summary.request_id)
                if self._refresher is None:  # in the serving loop, where the Redis client's connections live
                    self._refresher = asyncio.ensure_future(self.router.refresh_forever())
                if not ahead:
                    return Route(await self.router.route(summary), summary.request_id, self.router)
                written = asyncio.Event()
                plan, reserved = await self.router.route_ahead(summary, written)
                reserved.add_done_callback(consume)  # awaited by the stages, unless they failed first
                return Route(plan, summary.request_id, self.router, reserved, written)
        except grpc.aio.AioRpcError as e:
            raise classify("routing", e) from None
        except NoRoute as e:
            raise StageError(e.reason, "routing", e.message) from None

    async def reroute(
        self, summary_of: Callable[[], RouteSummary], span, attempt: int, wait_for_worker: bool = True
    ) -> Route:
        """The route of a request a worker failed or handed back, or of one no worker had room for: while every
        worker is full, wait up to ROOM_WAIT_S for room (a refusal by admission control is not waited out); with
        `wait_for_worker` (a request that was under way), also wait up to FAILOVER_WAIT_S for a worker of a role
        none is left of. A new request in that case gets its 503 + Retry-After at once."""
        start, said, counted = time.monotonic(), False, False
        waiting = self.metrics.waiting_for_room.labels(self.metrics.model) if self.metrics is not None else None
        try:
            while True:
                try:
                    return await self.route(summary_of(), span, attempt)
                except StageError as e:
                    wait_s = wait_for(e.reason, wait_for_worker)
                    if wait_s is None or time.monotonic() >= start + wait_s:
                        raise
                    if not said:  # once per request, not once per poll
                        log.info(
                            "request %s waits up to %.0f s for %s (%s)",
                            summary_of().request_id,
                            wait_s,
                            "room" if e.no_room else "a worker to take over",
                            e.message,
                        )
                        said = True
                    if e.no_room and waiting is not None and not counted:
                        waiting.inc()
                        counted = True
                    await asyncio.sleep(FAILOVER_POLL_S)
        finally:
            if counted:
                waiting.dec()

    async def workers(self) -> list[WorkerSnapshot]:
        """The registry as the router sees it (this process's, else the toggle's)."""
        if self.router is not None:
            return await self.router.workers()
        reply = await self.toggle.ListWorkers(pb.ListWorkersRequest(), timeout=2)
        return [wire.snapshot_from_pb(w) for w in reply.workers]

    async def largest_cache(self) -> int:
        """KV tokens the largest live decoder's whole cache holds (0: none known); from the toggle, read again at
        most every CAPACITY_REFRESH_S (caches do not change size)."""
        if self.router is not None:
            return largest_decoder_cache(await self.router.workers(), HEALTHY_HEARTBEAT_AGE_S)
        if time.monotonic() - self._capacity_at >= CAPACITY_REFRESH_S:
            self._capacity_at = time.monotonic()
            with contextlib.suppress(grpc.aio.AioRpcError):
                self._capacity = largest_decoder_cache(await self.workers(), HEALTHY_HEARTBEAT_AGE_S)
        return self._capacity

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
        if self.router is not None:
            await self.router.settle()
            await self.router.registry.redis.aclose()
