"""The `epdmesh` command: make-tiny-model, serve (the whole mesh), worker, toggle, gateway."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import sys
from pathlib import Path

from common import tls
from common.model.tiny import PRESETS
from common.topology import hands_over, parse_topology
from epdmesh import engine_setup as setup
from epdmesh import gateway_process, trace_cli
from epdmesh.checkpoints import make_model
from epdmesh.options import (
    add_budget_args,
    add_chat_template_arg,
    add_engine_args,
    add_first_token_hold_arg,
    add_model_args,
    add_planner_args,
    add_remote_image_args,
    add_reserved_output_arg,
    add_router_args,
    add_routing_args,
    add_slo_args,
    add_stage_calls_arg,
    add_tls_arg,
    add_trace_args,
    profile_spec,
    routing_policy,
)
from services.gateway.edge import add_api_key_arg


def _cmd_make_tiny_model(args) -> int:
    make_model(Path(args.dir), args.preset, args.seed)
    print(args.dir)
    return 0


def _serving_process(args) -> None:
    """Settings of a process that serves: malloc keeping freed memory (no page faults per forward). Its torch
    threads go to the engine thread (`_engine_threads`)."""
    from common.memory import keep_freed_memory

    keep_freed_memory()


def _engine_threads(args) -> int | None:
    """Intra-op threads of a serving process's engine thread: --threads, else torch's default (the cores); None
    for the emulated backend, which computes nothing."""
    if getattr(args, "backend", "torch") == "emulated":
        return None
    import torch

    return args.threads or torch.get_num_threads()


def _set_threads(args) -> None:
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)


def nothing_held(args) -> bool:
    """`--first-token-hold` on a topology that hands no request over (`local`, colocated workers)."""
    return args.first_token_hold and (args.topology == "local" or not hands_over(parse_topology(args.topology)))


def _cmd_serve(args) -> int:
    if args.record_trace == "redis" and not args.redis_url:
        args.redis_url = os.environ.get("REDIS_URL")
    if args.record_trace == "redis" and not args.redis_url:
        raise SystemExit(
            "--record-trace redis: serve's own Redis ends with the mesh; give --redis-url (a Redis that outlives it) "
            "or record to a file"
        )
    if args.record_trace == "redis" and args.topology != "local" and args.route_in != "gateway":
        raise SystemExit("--record-trace redis: the gateway reaches Redis with --route-in gateway only")
    setup.resolve_model(args)
    if nothing_held(args):
        logging.getLogger("epdmesh").warning(
            "--first-token-hold: no worker of %s prefills without decoding, so no request is handed over and "
            "none is held",
            args.topology,
        )
    from epdmesh.auto_profile import ensure_profile, wants_auto_profile

    if args.topology == "local" and wants_auto_profile(args):
        import torch

        args.latency_profile = ensure_profile(args, args.threads or torch.get_num_threads())
    if args.topology != "local":
        from epdmesh.launch import serve_mesh

        return serve_mesh(args)
    from common.engine.async_engine import AsyncEngine
    from services.gateway.local import LocalBackend
    from services.worker.server import build_engine

    _serving_process(args)
    metrics, tracing = gateway_process.telemetry(args)
    processor = gateway_process.chat_processor(args)
    config, emulation = setup.engine_config(args), setup.emulation(args)
    engine = AsyncEngine(build=lambda: build_engine(config, emulation), threads=_engine_threads(args))
    from common.memory import freeze_heap

    frozen = freeze_heap()  # the engine is up: its objects out of the collector's full collections
    logging.getLogger("epdmesh").info("%d objects frozen out of the garbage collector's full collections", frozen)
    logging.getLogger("epdmesh").info(
        "serving %s (%s) in one process on http://%s:%d/v1", args.served_model_name, args.model, args.host, args.port
    )
    from services.gateway.trace_record import recorder_of

    recorder = recorder_of(args, processor.config.image_token_id, metrics=metrics)
    try:
        gateway_process.serve_http(LocalBackend(processor, engine, recorder), args, metrics, tracing, "info")
    finally:
        engine.shutdown()
    return 0


def _cmd_worker(args) -> int:
    import uvloop

    from services.worker.server import WorkerOptions, run_worker

    setup.resolve_model(args)
    _serving_process(args)
    options = WorkerOptions(
        engine=setup.engine_config(args, args.roles),
        host=args.host,
        port=args.port,
        advertise_host=args.advertise_host,
        worker_id=args.worker_id,
        toggle=args.toggle,
        transfer=args.transfer,
        lease_ttl_s=args.lease_ttl,
        grace_s=args.grace,
        metrics_port=None if args.metrics_port < 0 else args.metrics_port,
        emulation=setup.emulation(args),
        stage_calls=args.stage_calls,
        threads=_engine_threads(args),
        tls=tls.load(args.tls_dir),
        configure=lambda roles: setup.engine_config(args, "".join(s.name[0] for s in sorted(roles))),
        freeze_heap=True,
    )
    uvloop.run(run_worker(options))
    _quick_exit()
    return 0


def _quick_exit() -> None:
    """A service that has shut down: its objects out of the garbage collector's sight, so that the interpreter's
    exit does not walk them all once more (a worker's or the toggle's exit took ~1.2 s after its shutdown, ~0.2 s
    so). Nothing is left to collect that matters: the process ends."""
    import gc

    gc.freeze()


def _call_worker(args, method: str, request):
    """One call of the Worker service at `args.worker`; None (the error printed) when it fails."""
    import grpc

    from epdmesh.v1 import mesh_pb2_grpc as pb_grpc

    async def call():
        async with tls.channel(args.worker, tls.load(args.tls_dir)) as channel:
            return await getattr(pb_grpc.WorkerStub(channel), method)(request, timeout=args.timeout)

    try:
        return asyncio.run(call())
    except grpc.aio.AioRpcError as e:
        print(f"{args.worker}: {e.code().name}: {e.details()}", file=sys.stderr)
        return None


def _cmd_health(args) -> int:
    """A probe (Kubernetes exec, compose healthcheck) that speaks the mesh's TLS."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with tls.channel(args.address, tls.load(args.tls_dir), aio=False) as channel:
            request = health_pb2.HealthCheckRequest(service=args.service)
            status = health_pb2_grpc.HealthStub(channel).Check(request, timeout=args.timeout).status
    except grpc.RpcError as e:
        print(f"{args.address}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    print(f"{args.address}{' ' + args.service if args.service else ''}: {name}")
    return 0 if status == health_pb2.HealthCheckResponse.SERVING else 1


def _cmd_drain(args) -> int:
    from epdmesh.v1 import mesh_pb2 as pb

    reply = _call_worker(args, "Drain", pb.DrainRequest(grace_s=args.grace))
    if reply is None:
        return 1
    state = "idle" if reply.idle else "NOT idle: work was still in flight when the settle time ran out"
    print(f"{args.worker} left the mesh: {reply.handed_back} decodes handed back, {reply.seconds:.2f} s, {state}")
    return 0 if reply.idle else 1


def _cmd_switch_roles(args) -> int:
    from common.engine.config import parse_roles
    from epdmesh.v1 import mesh_pb2 as pb
    from services import wire

    request = pb.SwitchRolesRequest(roles=wire.roles_to_pb(parse_roles(args.roles)), grace_s=args.grace)
    reply = _call_worker(args, "SwitchRoles", request)
    if reply is None:
        return 1
    info = wire.info_from_pb(reply.info)
    print(
        f"{info.worker_id} at {info.address} is {info.role_label} ({reply.handed_back} decodes handed back, "
        f"{reply.seconds:.2f} s; budgets {info.token_budget} tokens, {info.image_budget} images)"
    )
    return 0


def _cmd_tls_init(args) -> int:
    made = tls.init(args.dir, tuple(args.name), args.days)
    print(f"wrote {made.directory}/{{ca.crt,ca.key,tls.crt,tls.key}} (valid {args.days} days)")
    print(
        f"Kubernetes: kubectl create secret generic epdmesh-tls --from-file={made.directory}/ca.crt "
        f"--from-file={made.directory}/tls.crt --from-file={made.directory}/tls.key"
    )
    return 0


def _cmd_toggle(args) -> int:
    import uvloop

    from services.toggle.server import ToggleOptions, run_toggle

    routing, slo = routing_policy(args)
    options = ToggleOptions(
        args.redis_url, args.prefix, args.host, args.port, args.ttl, routing, slo, tls.load(args.tls_dir)
    )
    uvloop.run(run_toggle(options))
    _quick_exit()
    return 0


def _cmd_profile(args) -> int:
    import platform

    from common.latency.roofline import ACCELERATORS, load_profile

    out = Path(args.out)
    if args.prefill_saturation is not None and (not args.analytic or args.prefill_saturation < 1):
        raise SystemExit("--prefill-saturation takes a number of tokens (≥ 1), and applies to --analytic profiles only")
    if args.analytic:
        if args.analytic.partition(":")[0].upper() not in ACCELERATORS:
            raise SystemExit(f"--analytic {args.analytic}: choose an accelerator of {', '.join(ACCELERATORS)}")
        try:
            profile = load_profile(args.analytic, prefill_saturation=args.prefill_saturation)
        except ValueError as error:
            raise SystemExit(f"--analytic {args.analytic}: {error}") from None
    else:
        from tqdm import tqdm

        from common.engine.engine import Engine
        from common.engine.profiler import Profiler
        from common.scheduler import SchedulerConfig

        setup.resolve_model(args)
        _set_threads(args)
        config = dataclasses.replace(
            setup.engine_config(args),
            kv_cache_gib=args.kv_cache_gib,
            scheduler=SchedulerConfig(token_budget=1 << 15, image_budget=64, max_num_seqs=256),
        )
        encodes, lengths, batches, contexts = [1, 2, 3, 4], [16, 32, 64, 128, 256, 512], [1, 2, 4, 8, 16], [64, 256]
        steps = len(encodes) + len(lengths) + len(batches) * len(contexts) + 1
        with tqdm(total=steps, desc="profiling the engine", unit="point", file=sys.stderr) as bar:
            profiler = Profiler(Engine(config), args.repeats, lambda what: (bar.set_postfix_str(what), bar.update()))
            profiler.encode(encodes)
            profiler.prefill(lengths)
            profiler.decode(batches, contexts)
            transfer = profiler.transfer()
        import torch

        hardware = (
            f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads, {config.dtype}"
        )
        profile = profiler.profile(
            f"{Path(args.model).name} on this machine (measured)", hardware, Path(args.model).name, transfer
        )
    profile.save(out)
    print(f"wrote {out}: {profile.name}")
    return 0


def _worker_command(sub, name: str, help: str, func, grace: float) -> argparse.ArgumentParser:
    """A command that calls one running worker's Worker service."""
    p = sub.add_parser(name, help=help)
    p.add_argument("worker", help="the worker's gRPC address host:port (the gateway's /stats lists them)")
    p.add_argument(
        "--grace",
        type=float,
        default=grace,
        help="seconds running decodes may finish there before they are handed back",
    )
    p.add_argument("--timeout", type=float, default=120.0)
    add_tls_arg(p)
    p.set_defaults(func=func)
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="epdmesh", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("bench", help="benchmarks against a running or launched mesh: epdmesh bench {goodput,shift} --help")
    sub.add_parser(
        "sim", help="the goodput benchmark on simulated time, over the live policies: epdmesh sim goodput --help"
    )
    sub.add_parser("deploy", help="the Kubernetes manifests of a mesh: epdmesh deploy k8s --help")
    health = sub.add_parser("health", help="ask a worker or toggle for its grpc.health.v1 status (exit 0: SERVING)")
    health.add_argument("address", help="host:port")
    health.add_argument("--service", default="", help="e.g. epdmesh.v1.Decoder (default: the process)")
    health.add_argument("--timeout", type=float, default=3.0)
    add_tls_arg(health)
    health.set_defaults(func=_cmd_health)
    sub.add_parser("plan", help="rank the deployments of N instances by simulated goodput: epdmesh plan --help")

    make = sub.add_parser("make-tiny-model", help="write a small random LLaVA-1.5 checkpoint in Hugging Face format")
    make.add_argument("dir")
    make.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    make.add_argument("--seed", type=int, default=0)
    make.set_defaults(func=_cmd_make_tiny_model)

    serve = sub.add_parser("serve", help="bring up the mesh (toggle, workers, gateway) behind an OpenAI-compatible API")
    add_model_args(serve)
    add_engine_args(serve)
    add_routing_args(serve)
    serve.add_argument(
        "--topology",
        default="E1+P1+D1",
        help="worker role sets and counts, e.g. EPD1, E1+P1+D1, EP1+D2, ED1+P1, E2+P2+D4; "
        "'local' = one process, no gRPC or Redis",
    )
    serve.add_argument(
        "--auto-profile",
        action=argparse.BooleanOptionalAction,
        default=os.environ.get("EPDMESH_AUTO_PROFILE", "1") != "0",
        help="without --latency-profile or --token-budget: measure this setup's latency profile once "
        "(cached in ~/.cache/epdmesh/profiles) and size budgets and routing by it and the SLOs "
        "(default from $EPDMESH_AUTO_PROFILE)",
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--redis-url", help="default: $REDIS_URL, else a private redis-server (rediss://: Redis over TLS)"
    )
    serve.add_argument(
        "--route-in",
        default="gateway",
        choices=["gateway", "toggle"],
        help="where requests are routed: in the gateway (over Redis, no extra hop) or by a gRPC call to "
        "the toggle; the toggle keeps the registry either way",
    )
    serve.add_argument("--transfer", default="auto", choices=["auto", "nixl", "grpc"], help="page transfer backend")
    add_stage_calls_arg(serve)
    add_first_token_hold_arg(serve)
    add_remote_image_args(serve)
    add_chat_template_arg(serve)
    add_api_key_arg(serve)
    add_tls_arg(serve)
    serve.add_argument(
        "--internal-tls",
        default="off",
        choices=["off", "auto"],
        help="auto: mutual TLS on every gRPC hop with a throwaway CA made for this launch (kept in its private "
        "temporary directory), and the private Redis (if serve starts one) over TLS with a password; "
        "--tls-dir: a CA of your own instead",
    )
    serve.add_argument(
        "--gpus",
        help="with --device cuda: the GPU ids workers get one each, round-robin "
        "(default: $CUDA_VISIBLE_DEVICES, else all)",
    )
    serve.add_argument(
        "--max-restarts",
        type=int,
        default=5,
        help="times in a row a crashed worker, toggle, gateway or private Redis is started again "
        "(backoff 1 s … 30 s; 0: never)",
    )
    add_slo_args(serve)
    add_budget_args(serve)
    add_planner_args(serve)
    add_trace_args(serve)
    serve.set_defaults(func=_cmd_serve)

    worker = sub.add_parser("worker", help="one worker: an engine and the gRPC services of its roles")
    add_model_args(worker)
    add_engine_args(worker)
    worker.add_argument("--roles", default="encode,prefill,decode", help="e.g. encode,prefill or EP")
    add_reserved_output_arg(worker)
    add_slo_args(worker)
    add_budget_args(worker)
    worker.add_argument("--host", default="127.0.0.1")
    worker.add_argument("--port", type=int, default=0, help="0: any free port (registered with the toggle)")
    worker.add_argument("--advertise-host", help="the host other services dial (default: --host)")
    worker.add_argument("--worker-id")
    worker.add_argument("--toggle", help="toggle address host:port to register with")
    worker.add_argument("--transfer", default="auto", choices=["auto", "nixl", "grpc"])
    add_tls_arg(worker)
    add_stage_calls_arg(worker)
    worker.add_argument("--lease-ttl", type=float, default=30.0, help="seconds a page lease waits for its ack")
    worker.add_argument("--grace", type=float, default=10.0, help="seconds to drain on shutdown")
    worker.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="Prometheus /metrics port on --host (0: any free port, shown in the gateway's /stats; -1: off)",
    )
    worker.set_defaults(func=_cmd_worker)

    switch = _worker_command(
        sub,
        "switch-roles",
        "tell a running worker to take a new role set (it drains, keeps its weights, registers again)",
        _cmd_switch_roles,
        grace=2.0,
    )
    switch.add_argument("roles", help="e.g. EP, D, encode,prefill")
    _worker_command(
        sub,
        "drain",
        "tell a running worker to leave the mesh before it stops (a Kubernetes preStop hook): out of the registry, "
        "running decodes handed back with their KV after --grace; it then waits, idle, to be stopped",
        _cmd_drain,
        grace=10.0,
    )

    certs = sub.add_parser("tls", help="certificates for a mesh's mutual TLS: epdmesh tls init DIR")
    certs_sub = certs.add_subparsers(dest="tls_command", required=True)
    init = certs_sub.add_parser(
        "init",
        help="write a new CA and one certificate for every service of a mesh (ca.crt, tls.crt, tls.key; "
        "the CA's key as ca.key): the directory --tls-dir takes, or a Kubernetes secret's files",
    )
    init.add_argument("dir")
    init.add_argument(
        "--name",
        action="append",
        default=[],
        help=f"another DNS name or IP address for the certificate (it always names {tls.MESH_NAME}, localhost, "
        "127.0.0.1 and ::1; peers check that name, not the address they dial)",
    )
    init.add_argument("--days", type=int, default=365)
    init.set_defaults(func=_cmd_tls_init)

    trace_cli.add_parser(sub)

    profile = sub.add_parser("profile", help="write a latency profile: measured on this machine, or analytic")
    add_model_args(profile)
    add_engine_args(profile)
    profile.add_argument(
        "--analytic",
        metavar="ACCELERATOR[:SHAPE]",
        help="the roofline profile of LLaVA-1.5-7B on H20, H100 or H200 instead of measuring "
        "(H20:qwen2-vl-7b-1344: of that model shape)",
    )
    profile.add_argument(
        "--prefill-saturation",
        type=int,
        metavar="TOKENS",
        help="--analytic: prefill reaches 90%% of its throughput at this many prompt tokens on H20 instead of "
        "TriInfer's 1024 (which its data bound from above only): how a result depends on small chunks' cost",
    )
    profile.add_argument("--repeats", type=int, default=3)
    add_slo_args(profile)
    add_budget_args(profile)
    profile.add_argument("--out", default="latency-profile.json")
    profile.set_defaults(func=_cmd_profile)

    toggle = sub.add_parser("toggle", help="the toggle: worker registry in Redis and request routing")
    toggle.add_argument(
        "--redis-url",
        default=os.environ.get("EPDMESH_REDIS_URL") or os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"),
        help="the registry (redis://[:PASSWORD@]HOST:PORT/DB, rediss:// over TLS); default: $EPDMESH_REDIS_URL, "
        "else $REDIS_URL, else redis://127.0.0.1:6379/0",
    )
    toggle.add_argument("--prefix", default="epdmesh:default:", help="Redis key prefix of this mesh")
    toggle.add_argument("--host", default="127.0.0.1")
    toggle.add_argument("--port", type=int, default=50051)
    toggle.add_argument("--ttl", type=float, default=3.0, help="seconds a worker stays registered without a heartbeat")
    add_tls_arg(toggle)
    add_routing_args(toggle)
    add_slo_args(toggle)
    add_router_args(toggle)
    toggle.set_defaults(func=_cmd_toggle)

    gateway = sub.add_parser("gateway", help="the OpenAI-compatible HTTP gateway of a mesh")
    add_model_args(gateway)
    gateway.add_argument("--toggle", required=True, help="toggle address host:port")
    gateway.add_argument("--host", default="127.0.0.1")
    gateway.add_argument("--port", type=int, default=8000)
    add_remote_image_args(gateway)
    add_chat_template_arg(gateway)
    add_api_key_arg(gateway)
    add_stage_calls_arg(gateway)
    add_first_token_hold_arg(gateway)
    add_tls_arg(gateway)
    gateway.add_argument(
        "--redis-url",
        default=os.environ.get("EPDMESH_REDIS_URL"),
        help="route in the gateway over this registry (one Redis round trip per "
        "request instead of a gRPC hop to the toggle); default: $EPDMESH_REDIS_URL, else ask the toggle",
    )
    gateway.add_argument("--prefix", default="epdmesh:default:", help="with --redis-url: the mesh's Redis key prefix")
    gateway.add_argument(
        "--wait-for-workers",
        type=int,
        default=0,
        metavar="N",
        help="open the HTTP port only once the toggle lists N workers (serve passes its mesh's count: the gateway "
        "starts beside its workers and answers no client before the mesh is whole); default 0: at once",
    )
    add_routing_args(gateway)
    add_slo_args(gateway)
    add_router_args(gateway)
    add_planner_args(gateway)
    add_trace_args(gateway)
    gateway.set_defaults(func=gateway_process.run)
    return parser


BENCHMARKS = {"goodput": "bench.goodput", "shift": "bench.shift"}
SIMULATIONS = {"goodput": "sim.goodput"}  # `epdmesh sim goodput`: the benchmark on simulated time
PLAN = "sim.plan"  # `epdmesh plan`: the topology search


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in filter(None, (n.strip() for n in os.environ.get("EPDMESH_DEBUG", "").split(","))):
        logging.getLogger(name).setLevel(logging.DEBUG)  # e.g. EPDMESH_DEBUG=epdmesh.iterations
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["deploy", "k8s"]:  # its own parser, as the plan's
        from epdmesh.deploy_k8s import main as deploy_k8s

        return deploy_k8s(argv[2:])
    if argv[:1] == ["plan"]:  # its own parser takes the rest (loaded by name, as the simulations are)
        import importlib

        return importlib.import_module(PLAN).main(argv[1:])
    commands = {"bench": BENCHMARKS, "sim": SIMULATIONS}
    if argv[:1] and argv[0] in commands:  # `epdmesh bench NAME ARGS`: the benchmark's own parser takes ARGS
        names = commands[argv[0]]
        if len(argv) < 2 or argv[1] not in names:
            print(f"usage: epdmesh {argv[0]} {{{','.join(names)}}} [ARGS] (--help for its own)", file=sys.stderr)
            return 2
        import importlib

        return importlib.import_module(names[argv[1]]).main(argv[2:])
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("profile", "latency_profile"):  # files of this machine, now that the command runs here
        if getattr(args, name, None):
            try:
                profile_spec(getattr(args, name))
            except argparse.ArgumentTypeError as error:
                parser.error(f"argument --{name.replace('_', '-')}: {error}")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
