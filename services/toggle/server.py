"""The toggle: worker registry (Redis) and per-request routing (a pure policy over a registry snapshot).

Life of a request here:
  1. `Route(summary)` takes the registry snapshot (refreshed from Redis every `refresh_s` off the
     request path; the last good one is kept when Redis is unreachable, so routing degrades
     instead of failing);
  2. `common.policy.routing.route` picks encoder, prefill path and worker, decoder;
  3. the request's KV tokens are reserved on the chosen workers in Redis, atomically (a Lua
     script), so several toggles cannot overbook a worker; a worker without room is routed around;
  4. the chosen workers' loads in the local snapshot are bumped, so a burst between two
     refreshes spreads instead of piling onto one worker; the plan goes back to the gateway.
Workers `Register` once and `Heartbeat` their load; the TTL drops those that stop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import time

import grpc
import redis.asyncio as aioredis
import redis.exceptions
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.latency import LatencyProfile
from common.policy.multiplex import MultiplexConfig, route_slo
from common.policy.routing import PrefillPath, RoutePlan, RoutingConfig, route
from common.telemetry.tracing import Tracing
from common.workers import WorkerSnapshot
from epdmesh.v1 import mesh_pb2 as pb
from epdmesh.v1 import mesh_pb2_grpc as pb_grpc
from services import wire
from services.errors import grpc_errors
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


class ToggleServicer(pb_grpc.ToggleServicer):
    def __init__(self, registry: RedisRegistry, routing: RoutingConfig, heartbeat_interval_s: float = 0.5,
                 refresh_s: float = 0.05, tracing: Tracing | None = None, slo: SloRouting | None = None,
                 reservations: Reservations | None = None):
        """`slo`: route by the SLO-aware multiplexing policy over this latency profile; None: least loaded.
        `reservations`: book each route's KV tokens in Redis so concurrent toggles never overbook a worker."""
        self.registry = registry
        self.reservations = reservations
        self.slo = slo
        self.tracing = tracing or Tracing()
        self.routing = routing
        self.heartbeat_interval_s = heartbeat_interval_s
        self.refresh_s = refresh_s
        self._snapshot: list[WorkerSnapshot] = []
        self._snapshot_at = float("-inf")
        self._lock = asyncio.Lock()
        self.decisions = {path: 0 for path in PrefillPath}

    async def _workers(self) -> list[WorkerSnapshot]:
        """The registry snapshot: kept fresh by `refresh_forever`; read inline only when it is older than that."""
        if time.monotonic() - self._snapshot_at >= 2 * self.refresh_s:
            await self._refresh()
        return self._snapshot

    async def _refresh(self) -> None:
        async with self._lock:
            now = time.monotonic()
            try:
                self._snapshot = await self.registry.snapshot()
            except (redis.exceptions.RedisError, OSError) as e:
                log.warning("registry unreachable (%s); routing on the last snapshot", e)
                self._snapshot = [dataclasses.replace(w, age_s=w.age_s + now - self._snapshot_at) for w in self._snapshot]
            self._snapshot_at = now

    async def refresh_forever(self) -> None:
        """Keep the snapshot fresh off the request path, so Route never waits on Redis."""
        while True:
            await self._refresh()
            await asyncio.sleep(self.refresh_s)

    @grpc_errors
    async def Register(self, request: pb.RegisterRequest, context) -> pb.RegisterResponse:
        info = wire.info_from_pb(request.info)
        await self.registry.register(info, wire.load_from_pb(request.load))
        self._snapshot_at = float("-inf")
        log.info("worker %s (%s) registered at %s", info.worker_id, info.role_label, info.address)
        return pb.RegisterResponse(heartbeat_interval_s=self.heartbeat_interval_s, ttl_s=self.registry.ttl_ms / 1e3)

    @grpc_errors
    async def Heartbeat(self, request: pb.HeartbeatRequest, context) -> pb.HeartbeatResponse:
        if self.reservations is not None:
            await self.reservations.release(request.worker_id, list(request.admitted_request_ids))
        return pb.HeartbeatResponse(known=await self.registry.heartbeat(request.worker_id, wire.load_from_pb(request.load)))

    @grpc_errors
    async def Deregister(self, request: pb.DeregisterRequest, context) -> pb.DeregisterResponse:
        await self.registry.deregister(request.worker_id)
        self._snapshot_at = float("-inf")
        log.info("worker %s deregistered", request.worker_id)
        return pb.DeregisterResponse()

    @grpc_errors
    async def Route(self, request: pb.RouteRequest, context) -> pb.RoutePlan:
        summary = wire.summary_from_pb(request)
        workers = await self._workers()
        full_workers: set[str] = set()
        plan, full = None, None
        for _ in range(MAX_RESERVE_ATTEMPTS):
            plan = await self._plan(workers, summary, context)
            if plan is None and not full_workers:  # maybe workers registered (elsewhere) since the last refresh
                await self._refresh()
                workers = self._snapshot
                plan = await self._plan(workers, summary, context)
            if plan is None and full_workers:
                break
            if plan is None:
                await context.abort(grpc.StatusCode.UNAVAILABLE, _why_no_route(workers, summary.num_images))
            full = None if self.reservations is None else await self.reservations.reserve(summary.request_id,
                                                                                           needs(plan, summary))
            if full is None:
                break
            full_workers.add(full)
            summary = dataclasses.replace(summary, exclude=summary.exclude | {full})  # no room there: route around it
        if plan is None or full is not None:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                "no worker has KV room for this request now (all reserved); retry later")
        self._bump(plan, summary)
        self.decisions[plan.path] += 1
        self.tracing.annotate({"epdmesh.path": plan.path.value, "epdmesh.decoder": plan.decoder.worker_id,
                               "epdmesh.prefill": plan.prefill.worker_id,
                               "epdmesh.encoder": plan.encoder.worker_id if plan.encoder else None,
                               "epdmesh.live_workers": len(workers)})
        return wire.plan_to_pb(plan)

    async def _plan(self, workers, summary, context) -> RoutePlan | None:
        if self.slo is None:
            return route(workers, summary, self.routing)
        return await self._route_slo(workers, summary, context)

    async def _route_slo(self, workers, summary, context) -> RoutePlan | None:
        s = self.slo
        ttft, tbt = summary.ttft_slo_ms or s.ttft_ms, summary.tbt_slo_ms or s.tbt_ms
        decision = route_slo(workers, summary, ttft, tbt, summary.elapsed_ms, s.profile, s.config)
        self.tracing.annotate({"epdmesh.slack_ms": decision.slack_ms, "epdmesh.predicted_ttft_ms": decision.predicted_ttft_ms,
                               "epdmesh.route_reason": decision.reason, "epdmesh.meets_slo": decision.meets_slo})
        if decision.plan is None and s.config.admission_control and workers:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"no worker can serve this request within its SLO (TTFT {ttft:.0f} ms, TBT {tbt:.0f} ms, "
                                f"predicted TTFT {decision.predicted_ttft_ms:.0f} ms); retry later")
        return decision.plan

    @grpc_errors
    async def ListWorkers(self, request: pb.ListWorkersRequest, context) -> pb.ListWorkersResponse:
        self._snapshot_at = float("-inf")
        return pb.ListWorkersResponse(workers=[wire.snapshot_to_pb(w) for w in await self._workers()])

    def _bump(self, plan: RoutePlan, summary) -> None:
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


@dataclasses.dataclass(frozen=True, slots=True)
class ToggleOptions:
    redis_url: str
    prefix: str = "epdmesh:default:"
    host: str = "127.0.0.1"
    port: int = 0
    ttl_s: float = 3.0
    routing: RoutingConfig = RoutingConfig()
    slo: SloRouting | None = None


async def run_toggle(options: ToggleOptions, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None,
                     bound: list | None = None) -> None:
    tracing = Tracing("epdmesh-toggle")  # before the server: its Route spans join the gateway's traces
    client = aioredis.from_url(options.redis_url)
    try:
        await client.ping()
    except (redis.exceptions.RedisError, OSError) as e:
        raise SystemExit(f"cannot reach Redis at {options.redis_url}: {e}") from None
    registry = RedisRegistry(client, options.prefix, options.ttl_s)
    servicer = ToggleServicer(registry, options.routing, tracing=tracing, slo=options.slo,
                              reservations=Reservations(client, options.prefix))
    server = grpc.aio.server()
    port = server.add_insecure_port(f"{options.host}:{options.port}")
    pb_grpc.add_ToggleServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    await server.start()
    refresher = asyncio.create_task(servicer.refresh_forever())
    for name in ("", "epdmesh.v1.Toggle"):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    address = f"{options.host}:{port}"
    if bound is not None:
        bound.append(address)
    log.info("toggle serving on %s (registry %s, prefix %s)", address, options.redis_url, options.prefix)
    print(f"EPDMESH_TOGGLE_READY {address}", flush=True)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    if ready is not None:
        ready.set()
    try:
        await stop.wait()
    finally:
        refresher.cancel()
        await health_servicer.enter_graceful_shutdown()
        await server.stop(2)
        await client.aclose()
        tracing.shutdown()
