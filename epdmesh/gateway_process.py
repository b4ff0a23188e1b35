"""The gateway process: the OpenAI-compatible HTTP API in front of a mesh (`epdmesh gateway`) or of a local engine
(`serve --topology local`) — its chat processor, telemetry and router, built from the command's arguments.

Its life: resolve the model and its context; telemetry first (before any gRPC channel); the router in-process over
Redis where `--redis-url` is given (else the toggle routes); the processor; the mesh backend and, with `--planner`,
its planner; wait until the toggle lists `--wait-for-workers` workers; serve HTTP until stopped.
"""

from __future__ import annotations

import logging
import os

from common import tls
from epdmesh import engine_setup as setup
from epdmesh.options import allowed_image_domains, chat_template, planner_config, routing_policy
from services.gateway.edge import api_keys, edge


def chat_processor(args, config=None):
    """The gateway's processor, with the `--chat-template` if one is given (one that cannot render a chat: exit)."""
    from common.model.processor import ChatProcessor

    try:
        return ChatProcessor(args.model, config, chat_template(args))
    except ValueError as e:
        if args.chat_template is None:
            raise
        raise SystemExit(f"--chat-template: {e}") from None


def serve_http(backend, args, metrics, tracing, log_level: str) -> None:
    """The gateway's HTTP API over `backend`, behind its edge (API keys, request ids), until the server stops."""
    import uvicorn

    from services.gateway.app import build_app

    app = build_app(
        backend,
        args.served_model_name,
        allow_remote_images=args.allow_remote_images,
        metrics=metrics,
        tracing=tracing,
        allowed_image_domains=allowed_image_domains(args),
    )
    uvicorn.run(
        edge(app, api_keys(args, os.environ)),
        host=args.host,
        port=args.port,
        loop="uvloop",
        http="httptools",
        log_level=log_level,
        timeout_graceful_shutdown=5,
    )


def run(args) -> int:
    from common.memory import keep_freed_memory
    from common.model.config import LlavaConfig
    from services.gateway.mesh import MeshBackend
    from services.routing.registry import redacted

    setup.resolve_model(args)
    keep_freed_memory()  # images: megabytes of pixels parsed and freed per request
    metrics, tracing = telemetry(args)
    config = LlavaConfig.from_pretrained(args.model)
    limit = config.text.max_position_embeddings
    max_model_len = min(args.max_model_len or limit, limit)
    mesh_tls = tls.load(args.tls_dir)
    router = mesh_router(args, tracing, mesh_tls) if args.redis_url else None
    processor = chat_processor(args, config)
    pixels = "uint8, finished by the encoder" if processor.deferred_scaling is not None else "float32"
    hold = args.slo_ttft_ms if args.first_token_hold else None
    backend = MeshBackend(
        processor, args.toggle, max_model_len, metrics, tracing, router, args.stage_calls, mesh_tls, hold
    )
    from services.gateway.trace_record import recorder_of

    backend.recorder = recorder_of(args, config.image_token_id, mesh_tls, metrics)
    if args.planner:
        if not args.latency_profile:
            raise SystemExit("--planner needs a latency profile (--latency-profile; serve measures one by default)")
        from common.latency.roofline import load_profile
        from services.gateway.planner import PlannerTask

        backend.planner = PlannerTask(
            backend.status,
            backend.channels,
            load_profile(args.latency_profile),
            args.slo_ttft_ms,
            args.slo_tbt_ms,
            planner_config(args),
            metrics,
            tracing,
        )
    logging.getLogger("epdmesh").info(
        "gateway for %s on http://%s:%d/v1, toggle %s, routing %s, image pixels sent as %s",
        args.served_model_name,
        args.host,
        args.port,
        args.toggle,
        f"in-process over {redacted(args.redis_url)}" if router else "by the toggle",
        pixels,
    )
    wait_for_workers(args.toggle, args.wait_for_workers, mesh_tls)
    serve_http(backend, args, metrics, tracing, "warning")
    return 0


def wait_for_workers(toggle: str, count: int, mesh_tls) -> None:
    """Until the toggle lists `count` workers (0: no wait). `serve` starts its gateway beside the workers, so that
    the gateway's own start-up overlaps theirs; it opens its port only once the mesh is whole, as if started after."""
    if count <= 0:
        return
    import time

    import grpc

    from epdmesh.v1 import mesh_pb2 as pb
    from epdmesh.v1 import mesh_pb2_grpc as pb_grpc

    logging.getLogger("epdmesh").info("waiting for %d workers to register before the port opens", count)
    while True:
        try:
            with tls.channel(toggle, mesh_tls, aio=False) as channel:
                listed = pb_grpc.ToggleStub(channel).ListWorkers(pb.ListWorkersRequest(), timeout=2).workers
            if len(listed) >= count:
                return
        except grpc.RpcError:  # the toggle is starting too
            pass
        time.sleep(0.2)


def mesh_router(args, tracing, mesh_tls):
    """The toggle's router run in the gateway: one Redis round trip (the reservation) instead of a gRPC hop."""
    from services.routing.registry import redis_client
    from services.routing.router import Router

    routing, slo = routing_policy(args)
    return Router.over_redis(
        redis_client(args.redis_url, mesh_tls), args.prefix, routing, tracing, slo, reports_delivery=True
    )


def telemetry(args):
    from common.telemetry.metrics import GatewayMetrics
    from common.telemetry.tracing import Tracing

    tracing = Tracing("epdmesh-gateway")  # before any gRPC channel exists
    return GatewayMetrics(args.served_model_name, args.slo_ttft_ms / 1e3, args.slo_tbt_ms / 1e3), tracing
