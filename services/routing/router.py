"""Per-request routing over the Redis registry: what the toggle's `Route` runs, and what a gateway runs in-process.

Life of a route:
  1. the registry snapshot (refreshed from Redis every `refresh_s` off the request path while routes are
     being made, every `idle_refresh_s` after `IDLE_AFTER_S` without one; the last good one is kept when
     Redis is unreachable, so routing degrades instead of failing);
  2. `common.policy.routing.route` (least loaded) or `common.policy.multiplex.route_slo` (the SLO-aware
     multiplexing toggle) picks encoder, prefill path and worker, decoder — given what each worker is predicted to
     hold of the prompt in its prefix cache (`common.policy.affinity`: the prompts this router sent it before);
  3. the request's KV tokens are reserved on the chosen workers in Redis, atomically (a Lua script), so
     several routers — toggles or gateways — cannot overbook a worker; a worker without room is routed around;
  4. the route is remembered as pending and the chosen workers' loads in the local snapshot are bumped, so a
     burst between two refreshes spreads instead of piling onto one worker. A worker's load in Redis is its
     last heartbeat's (every 0.5 s): each refresh adds back the pending routes made after that heartbeat,
     which it cannot include yet. A gateway that routes in-process tells the router when a request's prefill
     is done (`prefilled`: its queued tokens and images are gone) and when it ends (`forget`).
The decisions and the routes remembered are a `RouteBook` (`services/routing/book.py`, no I/O); this adds the
registry and the reservations in Redis, and the wall clock.
A gateway that routes in-process saves the gRPC hop to the toggle on every request's path to its first token
(the toggle still keeps the registry: workers register and heartbeat there, and it releases reservations).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time

import redis.exceptions

from common.policy.routing import RoutePlan, RouteSummary, RoutingConfig
from common.telemetry.tracing import Tracing
from common.workers import WorkerSnapshot
from services.failure import Reason
from services.routing.book import REFRESH, NoRoute, RouteBook, SloRouting, largest_decoder_cache
from services.routing.registry import RedisRegistry
from services.routing.reservations import Reservations, needs

__all__ = ["NoRoute", "REFRESH_S", "Router", "SloRouting", "largest_decoder_cache"]

REFRESH_S = 0.05  # the registry snapshot is read this often while routes are being made
IDLE_AFTER_S = 2.0  # no route for this long: the snapshot is refreshed every idle_refresh_s
AHEAD_WAIT_S = 0.05  # a reservation made ahead waits at most this long for its stage call to be written

log = logging.getLogger(__name__)


class Router:
    def __init__(
        self,
        registry: RedisRegistry,
        routing: RoutingConfig = RoutingConfig(),
        refresh_s: float = REFRESH_S,
        tracing: Tracing | None = None,
        slo: SloRouting | None = None,
        reservations: Reservations | None = None,
        reports_delivery: bool = False,
        idle_refresh_s: float = 0.5,
    ):
        """`slo`, `reports_delivery`: the `RouteBook`'s. `reservations`: book each route's KV tokens in Redis so
        concurrent routers never overbook a worker."""
        self.registry = registry
        self.book = RouteBook(routing, slo, tracing, reports_delivery)
        self.refresh_s = refresh_s
        self.idle_refresh_s = max(idle_refresh_s, refresh_s)
        self._last_route = float("-inf")  # time.monotonic() of the last route asked for
        self._routing = asyncio.Event()  # set by a route: an idle refresher goes back to refresh_s at once
        self.reservations = reservations
        self._snapshot_at = float("-inf")
        self._lock = asyncio.Lock()
        # by request id, oldest first: when, and the workers its KV is reserved on (until forgotten or expired)
        self._reserved: dict[str, tuple[float, tuple[str, ...]]] = {}
        self._releases: set[asyncio.Task] = set()

    @classmethod
    def over_redis(
        cls,
        client,
        prefix: str,
        routing: RoutingConfig = RoutingConfig(),
        tracing: Tracing | None = None,
        slo: SloRouting | None = None,
        ttl_s: float = 3.0,
        reports_delivery: bool = False,
    ) -> Router:
        """A router over the mesh's registry and reservations under `prefix` in this Redis."""
        return cls(
            RedisRegistry(client, prefix, ttl_s),
            routing,
            tracing=tracing,
            slo=slo,
            reservations=Reservations(client, prefix),
            reports_delivery=reports_delivery,
        )

    @property
    def routing(self) -> RoutingConfig:
        return self.book.routing

    @property
    def slo(self) -> SloRouting | None:
        return self.book.slo

    @property
    def decisions(self) -> dict:
        return self.book.decisions

    def invalidate(self) -> None:
        """The registry changed (a worker came or went): the next read goes to Redis."""
        self._snapshot_at = float("-inf")

    async def workers(self) -> list[WorkerSnapshot]:
        """The registry snapshot: kept fresh by `refresh_forever`; read inline only when it is older than that."""
        if time.monotonic() - self._snapshot_at >= 2 * self.refresh_s:
            await self.refresh()
        return self.book.snapshot

    async def refresh(self) -> None:
        async with self._lock:
            now = time.monotonic()
            try:
                self.book.refreshed(await self.registry.snapshot(), time.time())
            except (redis.exceptions.RedisError, OSError) as e:
                log.warning("registry unreachable (%s); routing on the last snapshot", e)
                self.book.snapshot = [
                    dataclasses.replace(w, age_s=w.age_s + now - self._snapshot_at) for w in self.book.snapshot
                ]
            self._snapshot_at = now

    async def refresh_forever(self) -> None:
        """Keep the snapshot fresh off the request path, so a route never waits on Redis for it. With no route
        for `IDLE_AFTER_S`, refresh every `idle_refresh_s` only (an idle toggle or gateway then reads Redis
        2 times a second instead of 20); the first route after that reads the snapshot inline if it is older
        than 2 × `refresh_s` (one Redis round trip), and wakes this loop to `refresh_s` again."""
        while True:
            await self.refresh()
            if time.monotonic() - self._last_route < IDLE_AFTER_S:
                await asyncio.sleep(self.refresh_s)
                continue
            self._routing.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._routing.wait(), self.idle_refresh_s)

    async def route(self, summary: RouteSummary) -> RoutePlan:
        """The request's plan, its KV reserved on the chosen workers; raises NoRoute (`RouteBook.steps`)."""
        self._last_route = time.monotonic()
        self._routing.set()
        await self.workers()
        steps = self.book.steps(summary, self.routing.reserved_output_tokens, self.reservations is not None)
        reply = None
        try:
            while True:
                ask = steps.send(reply)
                if ask == REFRESH:  # maybe workers registered (elsewhere) since the last refresh
                    await self.refresh()
                    reply = None
                    continue
                try:
                    reply = await self.reservations.reserve(summary.request_id, ask)
                except asyncio.CancelledError:  # its client left: the script may have run in Redis all the same
                    self._reserve_noted(summary.request_id, tuple(ask))
                    self.forget(summary.request_id)
                    raise
        except StopIteration as done:
            plan, summary, amounts = done.value
        if amounts is not None:
            self._reserve_noted(summary.request_id, tuple(amounts))
        self.book.chosen(plan, summary, time.time())
        return plan

    async def route_ahead(
        self, summary: RouteSummary, after: asyncio.Event | None = None
    ) -> tuple[RoutePlan, asyncio.Future]:
        """The plan at once and its KV reservation under way: the caller sends the first stage's call without
        waiting on Redis, and awaits `reserved` before anything that needs the reservation (the decoder's KV).
        `reserved` gives None, or raises NoRoute with `full` set when a planned worker had no room after all (the
        caller then cancels what it sent and routes again without that worker). Raises NoRoute as `route` does.
        `after`: the reservation's Redis call waits until it is set (the caller's stage call written: the client
        side of the script costs ~0.1 ms of this loop, which the call's message would otherwise wait behind), or
        AHEAD_WAIT_S at most; None: one loop turn."""
        await self.workers()
        self.book.check_fits(summary)
        plan = self.book.plan(summary) if self.reservations is not None else None
        if plan is None:  # nothing to overlap, or no plan on this snapshot: route's own refresh and reasons
            reserved = asyncio.get_running_loop().create_future()
            reserved.set_result(None)
            return await self.route(summary), reserved
        self._last_route = time.monotonic()
        self._routing.set()
        amounts = needs(plan, summary, self.routing.reserved_output_tokens)
        self.book.chosen(plan, summary, time.time())
        reserved = asyncio.ensure_future(self._reserve_ahead(summary.request_id, amounts, after))
        return plan, reserved

    async def _reserve_ahead(
        self, request_id: str, amounts: dict[str, tuple[int, int]], after: asyncio.Event | None
    ) -> None:
        try:
            if after is None:
                await asyncio.sleep(0)  # one loop turn: a stage call made next goes out first
            else:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(after.wait(), AHEAD_WAIT_S)
            full = await self.reservations.reserve(request_id, amounts)
        except BaseException:  # cancelled (its client left) or Redis failed: the script may have run all the same
            self._reserve_noted(request_id, tuple(amounts))
            self.forget(request_id)
            raise
        if full is not None:
            self.forget(request_id)  # all or nothing: none was made, and its work no longer loads the workers
            raise NoRoute(
                f"worker {full} has no KV room left for this request (reserved meanwhile)", Reason.NO_ROOM, full=full
            )
        self._reserve_noted(request_id, tuple(amounts))

    def prefilled(self, request_id: str) -> None:
        """The request's first token came: its encode and prefill no longer load the workers it was routed to."""
        self.book.prefilled(request_id)

    def sent(self, request_id: str, worker_id: str) -> None:
        """The request's stage on worker_id is being called now: a heartbeat from it after this includes it."""
        self.book.sent(request_id, worker_id, time.time())

    def _reserve_noted(self, request_id: str, workers: tuple[str, ...]) -> None:
        now = time.time()
        self._reserved[request_id] = (now, workers)
        while (oldest := next(iter(self._reserved.items()), None)) and oldest[1][0] < now - self.reservations.ttl_s:
            del self._reserved[oldest[0]]  # expired in Redis by now (the toggle's router never forgets a route)

    def forget(self, request_id: str) -> None:
        """The request ended (finished, failed or routed again under another id). Its KV reservations end now
        too: a worker ends one when it admits the request, but a request can end before its decoder ever
        sees it (done at its first token, its client gone, its prefill worker failed), and its reservation
        would hold KV room for nothing until it expires."""
        self.book.forget(request_id)
        _, workers = self._reserved.pop(request_id, (0.0, ()))
        if workers and self.reservations is not None:
            task = asyncio.ensure_future(self.reservations.release_request(request_id, workers))
            self._releases.add(task)
            task.add_done_callback(self._released)

    def _released(self, task: asyncio.Task) -> None:
        self._releases.discard(task)
        if not task.cancelled() and task.exception() is not None:  # it expires by itself: nothing is lost
            log.debug("releasing a reservation failed: %s", task.exception())

    async def settle(self) -> None:
        """Wait for the reservations being released (before closing the Redis client)."""
        if self._releases:
            await asyncio.gather(*self._releases, return_exceptions=True)
