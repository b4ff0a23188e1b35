"""Per-request routing over the Redis registry: what the toggle's `Route` runs, and what a gateway runs in-process.

Life of a route:
  1. the registry snapshot (refreshed from Redis every `refresh_s` off the request path; the last good
     one is kept when Redis is unreachable, so routing degrades instead of failing);
  2. `common.policy.routing.route` (least loaded) or `common.policy.multiplex.route_slo` (the SLO-aware
     multiplexing toggle) picks encoder, prefill path and worker, decoder;
  3. the request's KV tokens are reserved on the chosen workers in Redis, atomically (a Lua script), so
     several routers — toggles or gateways — cannot overbook a worker; a worker without room is routed around;
  4. the chosen workers' loads in the local snapshot are bumped, so a burst between two refreshes spreads
     instead of piling onto one worker.
A gateway that routes in-process saves the gRPC hop to the toggle on every request's path to its first token
(the toggle still keeps the registry: workers register and heartbeat there, and it releases reservations).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import redis.exceptions

from common.latency import LatencyProfile
from common.policy.multiplex import MultiplexConfig, route_slo
from common.policy.routing import PrefillPath, RoutePlan, RouteSummary, RoutingConfig, route
from common.telemetry.tracing import Tracing
from common.workers import WorkerSnapshot
from services.toggle.registry import RedisRegistry
from services.toggle.reservations import Reservations, needs

MAX_RESERVE_ATTEMPTS = 4  # plans tried when workers have no KV room left

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class SloRouting:
    profile: LatencyProfile
    ttft_ms: float  # default targets for requests that bring none
    tbt_ms: float
    config: MultiplexConfig = MultiplexConfig()


class NoRoute(Exception):
    """No plan for this request. `busy`: workers exist but have no room (or no SLO fits): retry later;
    else no live worker set covers the request at all."""

    def __init__(self, message: str, busy: bool):
        super().__init__(message)
        self.message = message
        self.busy = busy


class Router:
    def __init__(self, registry: RedisRegistry, routing: RoutingConfig = RoutingConfig(), refresh_s: float = 0.05,
                 tracing: Tracing | None = None, slo: SloRouting | None = None,
                 reservations: Reservations | None = None):
        """`slo`: route by the SLO-aware multiplexing policy over this latency profile; None: least loaded.
        `reservations`: book each route's KV tokens in Redis so concurrent routers never overbook a worker."""
        self.registry = registry
        self.routing = routing
        self.refresh_s = refresh_s
        self.tracing = tracing or Tracing()
        self.slo = slo
        self.reservations = reservations
        self.decisions = {path: 0 for path in PrefillPath}
        self._snapshot: list[WorkerSnapshot] = []
        self._snapshot_at = float("-inf")
        self._lock = asyncio.Lock()

    @classmethod
    def over_redis(cls, client, prefix: str, routing: RoutingConfig = RoutingConfig(), tracing: Tracing | None = None,
                   slo: SloRouting | None = None, ttl_s: float = 3.0) -> Router:
        """A router over the mesh's registry and reservations under `prefix` in this Redis."""
        return cls(RedisRegistry(client, prefix, ttl_s), routing, tracing=tracing, slo=slo,
                   reservations=Reservations(client, prefix))

    def invalidate(self) -> None:
        """The registry changed (a worker came or went): the next read goes to Redis."""
        self._snapshot_at = float("-inf")

    async def workers(self) -> list[WorkerSnapshot]:
        """The registry snapshot: kept fresh by `refresh_forever`; read inline only when it is older than that."""
        if time.monotonic() - self._snapshot_at >= 2 * self.refresh_s:
            await self.refresh()
        return self._snapshot

    async def refresh(self) -> None:
        async with self._lock:
            now = time.monotonic()
            try:
                self._snapshot = await self.registry.snapshot()
            except (redis.exceptions.RedisError, OSError) as e:
                log.warning("registry unreachable (%s); routing on the last snapshot", e)
                self._snapshot = [dataclasses.replace(w, age_s=w.age_s + now - self._snapshot_at) for w in self._snapshot]
            self._snapshot_at = now

    async def refresh_forever(self) -> None:
        """Keep the snapshot fresh off the request path, so a route never waits on Redis for it."""
        while True:
            await self.refresh()
            await asyncio.sleep(self.refresh_s)

    async def route(self, summary: RouteSummary) -> RoutePlan:
        """The request's plan, its KV reserved on the chosen workers; raises NoRoute."""
        workers = await self.workers()
        full_workers: set[str] = set()
        plan, full = None, None
        for _ in range(MAX_RESERVE_ATTEMPTS):
            plan = self._plan(workers, summary)
            if plan is None and not full_workers:  # maybe workers registered (elsewhere) since the last refresh
                await self.refresh()
                workers = self._snapshot
                plan = self._plan(workers, summary)
            if plan is None and full_workers:
                break
            if plan is None:
                raise NoRoute(_why_no_route(workers, summary.num_images), busy=False)
            full = None if self.reservations is None else await self.reservations.reserve(summary.request_id,
                                                                                           needs(plan, summary))
            if full is None:
                break
            full_workers.add(full)
            summary = dataclasses.replace(summary, exclude=summary.exclude | {full})  # no room there: route around it
        if plan is None or full is not None:
            raise NoRoute("no worker has KV room for this request now (all reserved); retry later", busy=True)
        self._bump(plan, summary)
        self.decisions[plan.path] += 1
        self.tracing.annotate({"epdmesh.path": plan.path.value, "epdmesh.decoder": plan.decoder.worker_id,
                               "epdmesh.prefill": plan.prefill.worker_id,
                               "epdmesh.encoder": plan.encoder.worker_id if plan.encoder else None,
                               "epdmesh.live_workers": len(workers)})
        return plan

    def _plan(self, workers: list[WorkerSnapshot], summary: RouteSummary) -> RoutePlan | None:
        if self.slo is None:
            return route(workers, summary, self.routing)
        s = self.slo
        ttft, tbt = summary.ttft_slo_ms or s.ttft_ms, summary.tbt_slo_ms or s.tbt_ms
        decision = route_slo(workers, summary, ttft, tbt, summary.elapsed_ms, s.profile, s.config)
        self.tracing.annotate({"epdmesh.slack_ms": decision.slack_ms, "epdmesh.predicted_ttft_ms": decision.predicted_ttft_ms,
                               "epdmesh.route_reason": decision.reason, "epdmesh.meets_slo": decision.meets_slo})
        if decision.plan is None and s.config.admission_control and workers:
            raise NoRoute(f"no worker can serve this request within its SLO (TTFT {ttft:.0f} ms, TBT {tbt:.0f} ms, "
                          f"predicted TTFT {decision.predicted_ttft_ms:.0f} ms); retry later", busy=True)
        return decision.plan

    def _bump(self, plan: RoutePlan, summary: RouteSummary) -> None:
        """Book the request's work on the chosen workers in the local snapshot until the next refresh."""
        def bumped(w: WorkerSnapshot) -> WorkerSnapshot:
            load = w.load
            if w.worker_id == plan.decoder.worker_id:
                load = dataclasses.replace(load, unfinished_decode_tokens=load.unfinished_decode_tokens + summary.max_tokens)
            if w.worker_id == plan.prefill.worker_id:
                load = dataclasses.replace(load, num_waiting=load.num_waiting + 1,
                                           queued_prefill_tokens=load.queued_prefill_tokens + summary.num_prompt_tokens)
            if plan.encoder is not None and w.worker_id == plan.encoder.worker_id:
                load = dataclasses.replace(load, queued_images=load.queued_images + summary.num_images,
                                           num_waiting=load.num_waiting + (w.worker_id != plan.prefill.worker_id))
            return dataclasses.replace(w, load=load)
        self._snapshot = [bumped(w) for w in self._snapshot]


def _why_no_route(workers: list[WorkerSnapshot], num_images: int) -> str:
    if not workers:
        return "no live workers are registered"
    have = sorted({w.info.role_label for w in workers})
    need = "an encoder, a prefill and a decode role" if num_images else "a prefill and a decode role"
    return f"no live worker set covers {need}; live workers have roles {have}"
