"""`epdmesh serve --topology T`: the whole mesh on this machine, each service its own process.

Life of a launch:
  1. Redis: `--redis-url` / `REDIS_URL`, else a private `redis-server` on a free loopback port,
     else stop and say what to install;
  2. the toggle (a fresh key prefix in Redis, so launches never see each other's workers);
  3. the workers of each topology group, which bind free ports and register with the toggle;
     the launch waits until all are registered;
  4. the gateway on `--host:--port`; ready when its /health answers;
  5. on SIGINT/SIGTERM, or when the gateway or toggle dies: stop the gateway, drain the workers
     (SIGTERM → graceful), stop the toggle and the private Redis. A dead worker is logged; the
     toggle stops routing to it when its heartbeat TTL passes.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid

from common.ports import free_port
from common.topology import WorkerGroup, decoders_join, parse_topology
from epdmesh.routing_args import router_argv

log = logging.getLogger("epdmesh.launch")
NO_REDIS = ("epdmesh serve needs Redis for the toggle's registry, and none was found: set REDIS_URL "
            "(e.g. REDIS_URL=redis://127.0.0.1:6379/0) or install redis-server "
            "(Debian/Ubuntu: apt-get install redis-server; macOS: brew install redis)")


def die_with_parent() -> None:
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def stop_process(proc: subprocess.Popen, timeout: float, name: str = "") -> None:
    """SIGTERM (graceful drain), then SIGKILL if it has not exited after `timeout` seconds."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        log.warning("%s did not stop in %.0f s; killing it", name or proc.args, timeout)
        proc.kill()
        proc.wait()


class Mesh:
    def __init__(self):
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.tmp = tempfile.TemporaryDirectory(prefix="epdmesh-")

    def spawn(self, name: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
        """Start a child; its traces carry its own service name (`$OTEL_SERVICE_NAME-<kind>` or `epdmesh-<kind>`)."""
        kind = name.split()[0] + ("-" + name.split()[1].split("#")[0].lower() if name.startswith("worker ") else "")
        service = f"{os.environ.get('OTEL_SERVICE_NAME', 'epdmesh')}-{kind}"
        proc = subprocess.Popen(argv, env={**os.environ, "OTEL_SERVICE_NAME": service, **(env or {})},
                                preexec_fn=die_with_parent)
        self.procs.append((name, proc))
        return proc

    def check_alive(self, only: tuple[str, ...] | None = None) -> None:
        """Raise if a child (of those named in `only`, default all) has exited."""
        for name, proc in self.procs:
            if only is not None and name not in only:
                continue
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with code {proc.returncode} during start-up")

    def stop(self, timeout: float = 15.0) -> None:
        for name, proc in reversed(self.procs):  # gateway first, redis last
            stop_process(proc, timeout, name)
        self.tmp.cleanup()


def start_redis(mesh: Mesh, redis_url: str | None) -> str:
    url = redis_url or os.environ.get("REDIS_URL")
    if url:
        return url
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit(NO_REDIS)
    port = free_port()
    mesh.spawn("redis", [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                         "--dir", mesh.tmp.name, "--logfile", os.path.join(mesh.tmp.name, "redis.log")])
    import redis

    client = redis.Redis(host="127.0.0.1", port=port)
    _wait(lambda: client.ping(), mesh, "redis-server", 20)
    log.info("started a private redis-server on 127.0.0.1:%d", port)
    return f"redis://127.0.0.1:{port}/0"


def _wait(probe, mesh: Mesh, what: str, timeout: float, only: tuple[str, ...] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while True:
        mesh.check_alive(only)
        try:
            if probe():
                return
        except Exception:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} was not ready after {timeout:.0f} s")
        time.sleep(0.2)


def _registered(toggle: str) -> int:
    import grpc

    from epdmesh.v1 import mesh_pb2 as pb
    from epdmesh.v1 import mesh_pb2_grpc as pb_grpc

    with grpc.insecure_channel(toggle) as channel:
        return len(pb_grpc.ToggleStub(channel).ListWorkers(pb.ListWorkersRequest(), timeout=2).workers)


def _http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=2) as r:
        return r.status == 200


def worker_argv(group: WorkerGroup, toggle: str, args, threads: int) -> list[str]:
    argv = [sys.executable, "-m", "epdmesh.cli", "worker", "--roles", group.label, "--toggle", toggle,
            "--model", args.model, "--dtype", args.dtype, "--device", args.device, "--kv-cache-gib", str(args.kv_cache_gib),
            "--slo-ttft-ms", str(args.slo_ttft_ms), "--slo-tbt-ms", str(args.slo_tbt_ms),
            "--budget-headroom", str(args.budget_headroom), "--budget-alpha", str(args.budget_alpha),
            "--decoder-joins", args.decoder_joins, "--max-num-seqs", str(args.max_num_seqs), "--attention-backend", args.attention_backend,
            "--transfer", args.transfer, "--threads", str(threads), "--backend", args.backend]
    if args.backend == "emulated":
        argv += ["--profile", args.profile, "--emulated-kv-bytes-per-token", str(args.emulated_kv_bytes_per_token),
                 "--emulated-image-bytes-per-token", str(args.emulated_image_bytes_per_token)]
    if args.max_model_len:
        argv += ["--max-model-len", str(args.max_model_len)]
    for flag, value in (("--token-budget", args.token_budget), ("--image-budget", args.image_budget),
                        ("--latency-profile", args.latency_profile)):
        if value is not None:
            argv += [flag, str(value)]
    if args.enable_prefix_caching:
        argv.append("--enable-prefix-caching")
    return argv


def serve_mesh(args) -> int:
    groups = parse_topology(args.topology)
    if args.decoder_joins == "auto":
        args.decoder_joins = "first" if decoders_join(groups) else "off"
    num_workers = sum(g.count for g in groups)
    threads = args.threads or max(1, (os.cpu_count() or 1) // num_workers)
    mesh = Mesh()
    stopping = False

    def on_signal(signum, _frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        redis_url = start_redis(mesh, args.redis_url)
        toggle = f"127.0.0.1:{free_port()}"
        prefix = f"epdmesh:{uuid.uuid4().hex[:12]}:"
        routing = router_argv(args, args.latency_profile, worker_budgets=args.token_budget is None)
        mesh.spawn("toggle", [sys.executable, "-m", "epdmesh.cli", "toggle", "--redis-url", redis_url, "--prefix", prefix,
                              "--port", toggle.rsplit(":", 1)[1], *routing])
        _wait(lambda: _registered(toggle) >= 0, mesh, "the toggle", 60)
        for group in groups:
            for i in range(group.count):
                mesh.spawn(f"worker {group.label}#{i}", worker_argv(group, toggle, args, threads))
        _wait(lambda: _registered(toggle) == num_workers, mesh, f"{num_workers} workers", 600)
        gateway_argv = [sys.executable, "-m", "epdmesh.cli", "gateway", "--toggle", toggle, "--model", args.model,
                        "--host", args.host, "--port", str(args.port), "--served-model-name", args.served_model_name,
                        *routing]
        if args.route_in == "gateway":
            gateway_argv += ["--redis-url", redis_url, "--prefix", prefix]
        if args.max_model_len:
            gateway_argv += ["--max-model-len", str(args.max_model_len)]
        if args.allow_remote_images:
            gateway_argv.append("--allow-remote-images")
        mesh.spawn("gateway", gateway_argv)
        # from here on a worker may die (or be killed) without stopping the mesh: the toggle routes around it
        _wait(lambda: _http_ok(f"http://{args.host}:{args.port}/health"), mesh, "the gateway", 120,
              only=("redis", "toggle", "gateway"))
        print(f"EPDMESH_READY http://{args.host}:{args.port}/v1 topology={args.topology} workers={num_workers}", flush=True)
        log.info("mesh %s up: OpenAI API on http://%s:%d/v1 (Ctrl-C stops it)", args.topology, args.host, args.port)
        reported: set[str] = set()
        while not stopping:
            for name, proc in mesh.procs:
                if proc.poll() is None or name in reported:
                    continue
                reported.add(name)
                if name in ("gateway", "toggle", "redis"):
                    log.error("%s exited with code %s; stopping the mesh", name, proc.returncode)
                    stopping = True
                else:
                    log.error("%s exited with code %s; the toggle routes around it (its heartbeat TTL drops it)",
                              name, proc.returncode)
            time.sleep(0.2)
        return 0
    except RuntimeError as e:
        log.error("%s", e)
        return 1
    finally:
        mesh.stop()
