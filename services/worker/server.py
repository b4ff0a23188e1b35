"""A worker process: one engine, the servicers of its roles on one grpc.aio server, registration with the toggle.

Life of a worker:
  1. load the model and build the engine (its own thread), the transfer backend and the runtime;
  2. bind the gRPC server (port 0 = any free port), mount Worker + Health + the role servicers, start;
  3. register with the toggle and heartbeat its load (re-registering if the toggle forgot it);
  4. on `Worker.SwitchRoles`: leave the registry, drain, take the new roles, register again (`switch.py`);
  5. on SIGTERM/SIGINT: health NOT_SERVING, deregister, finish in-flight work and wait for
     leases to be acked (grace period), `server.stop(grace)`, stop the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import uuid
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import start_http_server

from common import tls
from common.engine.async_engine import AsyncEngine
from common.engine.config import EngineConfig
from common.engine.engine import Engine
from common.request import Stage
from common.telemetry.metrics import WorkerMetrics
from common.telemetry.tracing import Tracing
from common.tls import MeshTls
from common.transfer.channels import CHANNEL_OPTIONS, ChannelPool
from common.workers import WorkerInfo, registered_budgets
from epdmesh.v1 import mesh_pb2_grpc as pb_grpc
from services.stage_calls.client import StageCalls
from services.stage_calls.server import StageCallsServicer
from services.worker.runtime import WorkerRuntime
from services.worker.servicer import WorkerServicer
from services.worker.switch import ALL_SERVICES, Registration, RoleSwitch, services_of

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerOptions:
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str | None = None  # the host others dial (default: host)
    worker_id: str | None = None
    toggle: str | None = None  # toggle address; None: run unregistered
    transfer: str = "auto"  # auto | nixl | grpc
    lease_ttl_s: float = 30.0
    grace_s: float = 10.0
    metrics_port: int | None = 0  # Prometheus /metrics on host:port (0: any free port; None: off)
    stage_calls: str = "stream"  # how this worker calls others (AwaitEncode): stream | unary (services/stage_calls)
    emulation: EmulationOptions | None = None  # run the emulated backend instead of the model
    tls: MeshTls | None = None  # mutual TLS on its server and every channel it opens (common/tls.py)
    threads: int | None = None  # intra-op threads of the engine thread, the only one that computes (None: as is)
    # the engine configuration a role switch (`Worker.SwitchRoles`) takes for a role set: its budgets from the
    # worker's flags; None: `engine` with the roles replaced (its budgets kept)
    configure: Callable[[frozenset[Stage]], EngineConfig] | None = None
    freeze_heap: bool = False  # a serving process: its objects out of the collector's sight once up (common/memory.py)


@dataclasses.dataclass(frozen=True, slots=True)
class EmulationOptions:
    """The emulated backend (common/engine/emulated.py): iterations take the profile's predicted time."""

    profile: str  # latency profile file (epdmesh-latency/1), or H20 / H100 / H200 for the analytic LLaVA-1.5-7B one
    kv_bytes_per_token: int = 256  # real bytes moved per token, standing in for the model's
    image_bytes_per_token: int = 64


def build_engine(config: EngineConfig, emulation: EmulationOptions | None = None) -> Engine:
    """The model's engine, or the emulated one."""
    if emulation is not None:
        from common.engine.emulated import EmulatedEngine, light_detokenizer, word_token_pool
        from common.latency.roofline import load_profile

        e = emulation
        return EmulatedEngine(
            config,
            load_profile(e.profile),
            light_detokenizer(config.model),
            word_token_pool(config.model),
            e.kv_bytes_per_token,
            e.image_bytes_per_token,
        )
    from common.model.processor import ChatProcessor

    engine = Engine(config, None, ChatProcessor(config.model).detokenize)
    if config.roles & {Stage.PREFILL, Stage.DECODE}:  # it samples: ready for structured output before it serves
        engine.grammar.load()
    return engine


def _mount_stages(server: grpc.aio.Server, runtime: WorkerRuntime, calls: StageCalls) -> StageCallsServicer:
    """Every stage's servicer, and the StageCalls stream that carries their unary stage methods: a worker's roles
    can change while it runs (`Worker.SwitchRoles`), and a call for a stage it does not hold now is refused by its
    runtime (DOWN: the caller routes around it). Its health says which stages it serves."""
    from services.decoder.servicer import DecoderServicer
    from services.encoder.servicer import EncoderServicer
    from services.prefill.servicer import PrefillServicer

    encoder, prefill = EncoderServicer(runtime), PrefillServicer(runtime, calls)
    pb_grpc.add_EncoderServicer_to_server(encoder, server)
    pb_grpc.add_PrefillerServicer_to_server(prefill, server)
    pb_grpc.add_DecoderServicer_to_server(DecoderServicer(runtime, calls), server)
    handlers = dict(encode=encoder.encode, await_encode=encoder.await_encode, prefill=prefill.prefill)
    stage_calls = StageCallsServicer(handlers, runtime.tracing)
    pb_grpc.add_StageCallsServicer_to_server(stage_calls, server)
    return stage_calls


async def run_worker(
    options: WorkerOptions,
    engine: Engine | None = None,
    ready: asyncio.Event | None = None,
    stop: asyncio.Event | None = None,
    bound: list | None = None,
) -> None:
    """Serve until `stop` is set (or SIGTERM/SIGINT); `bound` gets the address, then `ready` is set."""
    from common.transfer.factory import make_transfer

    config = options.engine
    label = "".join(s.name[0] for s in sorted(config.roles)).lower()
    tracing = Tracing(f"epdmesh-worker-{label}")  # before any server or channel: it instruments grpc.aio
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    port = tls.bind(server, f"{options.host}:{options.port}", options.tls)
    address = f"{options.advertise_host or options.host}:{port}"
    worker_id = options.worker_id or f"{label}-{port}"
    metrics = WorkerMetrics(worker_id, label.upper())

    def on_iteration(seconds: float) -> None:  # under the roles the worker holds now
        metrics.iteration.labels(**metrics.labels).observe(seconds)

    if engine is None:  # built on the thread that steps it (common/engine/threads.py)
        async_engine = await asyncio.to_thread(
            AsyncEngine,
            on_iteration=on_iteration,
            threads=options.threads,
            build=lambda: build_engine(config, options.emulation),
        )
        engine = async_engine.engine
    else:
        async_engine = AsyncEngine(engine, on_iteration=on_iteration)
    channels = ChannelPool(options.tls)
    transfer = make_transfer(options.transfer, engine, channels, worker_id)
    runtime = WorkerRuntime(
        worker_id,
        address,
        async_engine,
        transfer.puller,
        options.lease_ttl_s,
        transfer.offer,
        transfer.backend_info,
        metrics,
        tracing,
        on_leases=transfer.serving,
        registered=transfer.registered,
    )
    engine_gauges(metrics, async_engine)
    metrics_server, metrics_port = None, 0
    if options.metrics_port is not None:
        metrics_server, _ = start_http_server(options.metrics_port, options.host, registry=metrics.registry)
        metrics_port = metrics_server.server_port
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    calls = StageCalls(channels, options.stage_calls, tracing)
    stage_calls = _mount_stages(server, runtime, calls)
    info = WorkerInfo(
        worker_id,
        address,
        config.roles,
        config.model,
        engine.max_model_len,
        transfer.offer,
        os.getpid(),
        metrics_port,
        instance=uuid.uuid4().hex[:12],
        prefix_caching=config.enable_prefix_caching,
        **registered_budgets(engine.scheduler.config),
    )
    toggle = pb_grpc.ToggleStub(channels.get(options.toggle)) if options.toggle else None
    registration = Registration(toggle, info, runtime)
    configure = options.configure or (lambda roles: dataclasses.replace(config, roles=roles))
    switch = RoleSwitch(runtime, registration, health_servicer, configure)
    pb_grpc.add_WorkerServicer_to_server(WorkerServicer(runtime, switch), server)
    await server.start()
    if options.freeze_heap:
        from common.memory import freeze_heap

        log.info("%d objects frozen out of the garbage collector's full collections", freeze_heap())
    for name in ["", "epdmesh.v1.Worker", "epdmesh.v1.StageCalls", *ALL_SERVICES]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    for name in ["", "epdmesh.v1.Worker", "epdmesh.v1.StageCalls", *services_of(config.roles)]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info(
        "worker %s (%s) serving on %s, transfer %s, metrics on port %s%s",
        worker_id,
        label.upper(),
        address,
        transfer.offer,
        metrics_port or "-",
        f", emulated by {options.emulation.profile}" if options.emulation is not None else "",
    )

    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread (tests)
            pass
    tasks = [asyncio.create_task(runtime.expire_leases())]
    if toggle is not None:
        tasks.append(asyncio.create_task(registration.run()))
    if bound is not None:
        bound.append(address)
    if ready is not None:
        ready.set()
    print(f"EPDMESH_WORKER_READY {worker_id} {address}", flush=True)
    try:
        await stop.wait()
    finally:
        log.info("worker %s shutting down: draining for up to %.0f s", worker_id, options.grace_s)
        await health_servicer.enter_graceful_shutdown()
        if toggle is not None:
            tasks[-1].cancel()
            await registration.leave()
        await runtime.drain(options.grace_s)
        stage_calls.end()  # its callers' open streams: they would keep server.stop waiting for the whole grace
        await server.stop(options.grace_s)
        await calls.close()
        for task in tasks:
            task.cancel()
        await transfer.close()
        await channels.close()
        async_engine.shutdown()
        if metrics_server is not None:
            metrics_server.shutdown()
        tracing.shutdown()


def engine_gauges(metrics: WorkerMetrics, async_engine: AsyncEngine) -> None:
    """The worker's Prometheus gauges, read at scrape time from what its heartbeats report (`AsyncEngine.stats`):
    a request handed over during a long step counts as waiting, as the router sees it."""
    engine = async_engine.engine
    pool = engine.scheduler.kv.pool
    metrics.gauges(
        running=lambda: async_engine.stats().num_running,
        waiting=lambda: async_engine.stats().num_waiting,
        kv_usage=lambda: 1 - pool.num_free / pool.num_blocks,
        preemptions=lambda: engine.scheduler.num_preemptions,
        prefix_cache=lambda: (
            engine.scheduler.kv.num_queried_tokens,
            engine.scheduler.kv.num_hit_tokens,
            engine.scheduler.num_encodes_skipped,
        ),
    )
