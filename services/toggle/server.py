"""The toggle: worker registry (Redis) and per-request routing (`router.Router`, a policy over a registry snapshot).

Workers `Register` once and `Heartbeat` their load; the TTL drops those that stop; a heartbeat also ends the
reservations of the requests the worker reports admitted. `Route(summary)` runs the router (snapshot, policy,
reservation in Redis) and returns the plan. A gateway given the Redis URL runs the same router in-process and
skips this hop; the registry stays here either way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal

import grpc
import redis.exceptions
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common import tls
from common.policy.routing import RoutingConfig
from common.telemetry.tracing import Tracing
from common.tls import MeshTls
from common.workers import HEARTBEAT_INTERVAL_S
from epdmesh.v1 import mesh_pb2 as pb
from epdmesh.v1 import mesh_pb2_grpc as pb_grpc
from services import failure, wire
from services.errors import grpc_errors
from services.routing.registry import redacted, redis_client
from services.routing.router import NoRoute, Router, SloRouting

__all__ = ["SloRouting", "ToggleOptions", "ToggleServicer", "run_toggle"]

log = logging.getLogger(__name__)


class ToggleServicer(pb_grpc.ToggleServicer):
    def __init__(self, router: Router, heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S):
        self.router = router
        self.registry = router.registry
        self.reservations = router.reservations
        self.heartbeat_interval_s = heartbeat_interval_s

    @property
    def decisions(self):
        return self.router.decisions

    @grpc_errors
    async def Register(self, request: pb.RegisterRequest, context) -> pb.RegisterResponse:
        info = wire.info_from_pb(request.info)
        await self.registry.register(info, wire.load_from_pb(request.load))
        self.router.invalidate()
        log.info("worker %s (%s) registered at %s", info.worker_id, info.role_label, info.address)
        return pb.RegisterResponse(heartbeat_interval_s=self.heartbeat_interval_s, ttl_s=self.registry.ttl_ms / 1e3)

    @grpc_errors
    async def Heartbeat(self, request: pb.HeartbeatRequest, context) -> pb.HeartbeatResponse:
        if self.reservations is not None:
            await self.reservations.release(request.worker_id, list(request.admitted_request_ids))
        return pb.HeartbeatResponse(
            known=await self.registry.heartbeat(request.worker_id, wire.load_from_pb(request.load))
        )

    @grpc_errors
    async def Deregister(self, request: pb.DeregisterRequest, context) -> pb.DeregisterResponse:
        await self.registry.deregister(request.worker_id)
        self.router.invalidate()
        log.info("worker %s deregistered", request.worker_id)
        return pb.DeregisterResponse()

    @grpc_errors
    async def Route(self, request: pb.RouteRequest, context) -> pb.RoutePlan:
        try:
            plan = await self.router.route(wire.summary_from_pb(request))
        except NoRoute as e:
            await context.abort(failure.CODES[e.reason], e.message, trailing_metadata=failure.metadata(e.reason))
        return wire.plan_to_pb(plan)

    @grpc_errors
    async def ListWorkers(self, request: pb.ListWorkersRequest, context) -> pb.ListWorkersResponse:
        self.router.invalidate()
        return pb.ListWorkersResponse(workers=[wire.snapshot_to_pb(w) for w in await self.router.workers()])


@dataclasses.dataclass(frozen=True, slots=True)
class ToggleOptions:
    redis_url: str
    prefix: str = "epdmesh:default:"
    host: str = "127.0.0.1"
    port: int = 0
    ttl_s: float = 3.0
    routing: RoutingConfig = RoutingConfig()
    slo: SloRouting | None = None
    tls: MeshTls | None = None  # mutual TLS on its gRPC server and, for a rediss:// URL, to Redis


async def run_toggle(
    options: ToggleOptions,
    ready: asyncio.Event | None = None,
    stop: asyncio.Event | None = None,
    bound: list | None = None,
) -> None:
    tracing = Tracing("epdmesh-toggle")  # before the server: its Route spans join the gateway's traces
    client = redis_client(options.redis_url, options.tls)
    try:
        await client.ping()
    except (redis.exceptions.RedisError, OSError) as e:
        raise SystemExit(f"cannot reach Redis at {redacted(options.redis_url)}: {e}") from None
    router = Router.over_redis(client, options.prefix, options.routing, tracing, options.slo, options.ttl_s)
    servicer = ToggleServicer(router)
    server = grpc.aio.server()
    port = tls.bind(server, f"{options.host}:{options.port}", options.tls)
    pb_grpc.add_ToggleServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    await server.start()
    refresher = asyncio.create_task(router.refresh_forever())
    for name in ("", "epdmesh.v1.Toggle"):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    address = f"{options.host}:{port}"
    if bound is not None:
        bound.append(address)
    log.info("toggle serving on %s (registry %s, prefix %s)", address, redacted(options.redis_url), options.prefix)
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
