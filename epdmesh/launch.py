"""`epdmesh serve --topology T`: the whole mesh on this machine, each service its own process.

Life of a launch:
  1. Redis: `--redis-url` / `REDIS_URL`, else a private `redis-server` on a free loopback port,
     else stop and say what to install;
  2. the toggle (a fresh key prefix in Redis, so launches never see each other's workers);
  3. the workers of each topology group, which bind free ports and register with the toggle;
     the launch waits until all are registered;
  4. the gateway on `--host:--port`; ready when its /health answers;
  5. a worker that dies (crash, OOM kill, SIGKILL) is deregistered at once, so nothing is routed to
     it, and started again after a backoff (1, 2, 4 … 30 s), at most --max-restarts times in a row;
     one killed by a signal while the mesh starts is started again once instead of failing it. A
     crashed toggle, gateway or private Redis is started again the same way, on its own port (the
     registry is soft state: workers register again at their next heartbeat);
  6. on SIGINT/SIGTERM, or when the gateway, toggle or Redis stops for good: stop the gateway, drain
     the workers (SIGTERM → graceful), stop the toggle and the private Redis.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
import uuid

from common import tls
from common.ports import free_port
from common.tls import MeshTls
from common.topology import WorkerGroup, decoders_join, parse_topology
from epdmesh.gpus import gpu_devices, memory_shares, worker_envs
from epdmesh.options import planner_argv, reserved_output_tokens, router_argv, trace_argv
from services.gateway.edge import ENV as API_KEY_ENV
from services.gateway.edge import api_keys

log = logging.getLogger("epdmesh.launch")
NO_REDIS = (
    "epdmesh serve needs Redis for the toggle's registry, and none was found: set REDIS_URL "
    "(e.g. REDIS_URL=redis://127.0.0.1:6379/0) or install redis-server "
    "(Debian/Ubuntu: apt-get install redis-server; macOS: brew install redis)"
)
RESTART_BACKOFF_S = (1, 2, 4, 8, 16, 30)  # before the n-th restart in a row of one worker
STABLE_S = 60.0  # a worker registered this long before it dies starts its count of restarts in a row again
TLS_ENV = "EPDMESH_TLS_DIR"  # every child of a launch reads its --tls-dir default from it
REDIS_ENV = "EPDMESH_REDIS_URL"  # a Redis URL with a password goes to the toggle and gateway here, not in argv
ASKED_TO_STOP = (-signal.SIGINT, -signal.SIGTERM)  # exit codes of a child stopped before its handlers were set


def die_with_parent() -> None:
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def stop_process(proc: subprocess.Popen, timeout: float, name: str = "") -> None:
    """SIGTERM (graceful drain), then SIGKILL if it has not exited after `timeout` seconds."""
    stop_processes([(name, proc)], timeout)


def stop_processes(named: list[tuple[str, subprocess.Popen]], timeout: float) -> None:
    """SIGTERM to each (they drain side by side), then SIGKILL to any that has not exited `timeout` seconds after."""
    running = [(name, proc) for name, proc in named if proc.poll() is None]
    for _, proc in running:
        proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for name, proc in running:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop in %.0f s; killing it", name or proc.args, timeout)
            proc.kill()
            proc.wait()


class Mesh:
    def __init__(self):
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.tmp = tempfile.TemporaryDirectory(prefix="epdmesh-")
        self.toggle: str | None = None  # the toggle's address, once it is up: dead workers are deregistered there
        self._argv: dict[str, tuple[list[str], dict | None]] = {}
        self._revived: set[str] = set()
        self.stopping = False  # set by SIGINT/SIGTERM: start-up ends, nothing is started again

    def spawn(self, name: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
        """Start a child; its traces carry its own service name (`$OTEL_SERVICE_NAME-<kind>` or `epdmesh-<kind>`)."""
        kind = name.split()[0] + ("-" + name.split()[1].split("#")[0].lower() if name.startswith("worker ") else "")
        service = f"{os.environ.get('OTEL_SERVICE_NAME', 'epdmesh')}-{kind}"
        inherited = {k: v for k, v in os.environ.items() if k != REDIS_ENV}  # the launch's Redis, not the shell's
        proc = subprocess.Popen(
            argv, env={**inherited, "OTEL_SERVICE_NAME": service, **(env or {})}, preexec_fn=die_with_parent
        )
        self._argv[name] = (argv, env)
        self.procs = [(n, p) for n, p in self.procs if n != name] + [(name, proc)]
        return proc

    def respawn(self, name: str) -> subprocess.Popen:
        """Start child `name` again as it was first started, in its place in the stopping order."""
        index = next(i for i, (n, _) in enumerate(self.procs) if n == name)
        proc = self.spawn(name, *self._argv[name])
        self.procs.insert(index, self.procs.pop())
        return proc

    def forget(self, pid: int) -> None:
        """Deregister the worker process `pid` from the toggle (best effort: else its TTL drops it)."""
        if self.toggle is None:
            return
        try:
            _deregister_pid(self.toggle, pid)
        except Exception as e:  # the toggle is down or slow: the registry's TTL still drops the worker
            log.warning("could not deregister dead worker pid %d: %s", pid, e)

    def check_alive(self, only: tuple[str, ...] | None = None) -> None:
        """Raise if a child (of those named in `only`, default all) has exited, or if the mesh is stopping. A
        worker killed by a signal (a crash; not a bad flag or a missing file, which exit with a code, nor a
        Ctrl-C) is deregistered and started again, once."""
        if self.stopping:
            raise Stopped("stopped while starting")
        for name, proc in list(self.procs):
            if only is not None and name not in only or proc.poll() is None:
                continue
            crashed = proc.returncode < 0 and proc.returncode not in ASKED_TO_STOP
            if name.startswith("worker ") and crashed and name not in self._revived:
                self._revived.add(name)
                log.warning("%s was killed by signal %d during start-up; starting it again", name, -proc.returncode)
                self.forget(proc.pid)
                self.respawn(name)
                continue
            raise RuntimeError(f"{name} exited with code {proc.returncode} during start-up")

    def stop(self, timeout: float = 15.0) -> None:
        """Gateway first, then every worker at once (each drains its own requests), then the toggle, Redis last."""
        tiers: list[list[tuple[str, subprocess.Popen]]] = []
        for name, proc in reversed(self.procs):
            worker = name.startswith("worker ")
            if worker and tiers and tiers[-1][0][0].startswith("worker "):
                tiers[-1].append((name, proc))
            else:
                tiers.append([(name, proc)])
        for tier in tiers:
            stop_processes(tier, timeout)
        self.tmp.cleanup()


class Stopped(RuntimeError):
    """SIGINT/SIGTERM arrived while the mesh was starting."""


class Restarts:
    """Children of a running mesh that die: a worker is deregistered at once; a child that failed is started
    again after a backoff, at most `limit` times in a row (a worker registered, or another child up, for
    STABLE_S before it died starts its count again). A worker that exits cleanly (code 0: drained) or is
    stopped by SIGINT/SIGTERM stays down; the toggle, gateway or Redis doing so stops the mesh."""

    def __init__(self, mesh: Mesh, limit: int, poll_s: float = 5.0):
        self.mesh = mesh
        self.limit = limit
        self.in_a_row: collections.Counter[str] = collections.Counter()
        self.due: dict[str, float] = {}  # child name → when to start it again
        self._seen: set[subprocess.Popen] = set()  # processes whose exit was handled
        self._stable_since: dict[subprocess.Popen, float] = {}  # a worker once registered, another child once up
        self._poll_s, self._next_poll = poll_s, 0.0

    def check(self) -> str | None:
        """Handle exits since the last call; a reason when the mesh cannot go on (a service down for good)."""
        now = time.monotonic()
        self._note_registrations(now)
        for name, proc in self.mesh.procs:
            worker = name.startswith("worker ")
            if proc.poll() is None:
                if not worker:
                    self._stable_since.setdefault(proc, now)
                continue
            if proc in self._seen:
                continue
            self._seen.add(proc)
            if worker:
                self.mesh.forget(proc.pid)
            if proc.returncode == 0 or proc.returncode in ASKED_TO_STOP:
                if not worker:
                    return f"{name} exited (code {proc.returncode})"
                log.warning("%s exited (code %s) as asked; not starting it again", name, proc.returncode)
                continue
            if now - self._stable_since.get(proc, now) >= STABLE_S:
                self.in_a_row[name] = 0
            if self.in_a_row[name] >= self.limit:
                if not worker:
                    return f"{name} exited with code {proc.returncode} after {self.in_a_row[name]} restarts in a row"
                log.error(
                    "%s exited with code %s; not starting it again (%d restarts in a row, --max-restarts "
                    "%d); the toggle routes around it",
                    name,
                    proc.returncode,
                    self.in_a_row[name],
                    self.limit,
                )
                continue
            delay = RESTART_BACKOFF_S[min(self.in_a_row[name], len(RESTART_BACKOFF_S) - 1)]
            self.in_a_row[name] += 1
            self.due[name] = now + delay
            log.error(
                "%s exited with code %s;%s starting it again in %g s (restart %d of at most %d in a row)",
                name,
                proc.returncode,
                " deregistered it," if worker else "",
                delay,
                self.in_a_row[name],
                self.limit,
            )
        for name, when in list(self.due.items()):
            if now >= when:
                del self.due[name]
                log.info("%s started again (pid %d)", name, self.mesh.respawn(name).pid)
        return None

    def _note_registrations(self, now: float) -> None:
        """When restarted workers first show up in the registry (every poll_s while one has not yet)."""
        waiting = [
            p
            for n, p in self.mesh.procs
            if n.startswith("worker ") and self.in_a_row[n] and p.poll() is None and p not in self._stable_since
        ]
        if not waiting or self.mesh.toggle is None or now < self._next_poll:
            return
        self._next_poll = now + self._poll_s
        try:
            pids = {entry.info.pid for entry in _list_workers(self.mesh.toggle)}
        except Exception:  # the toggle is slow or down: try again at the next poll
            return
        for proc in waiting:
            if proc.pid in pids:
                self._stable_since[proc] = now


def _port_of(url: str) -> int | None:
    return urllib.parse.urlsplit(url).port


def start_redis(
    mesh: Mesh, redis_url: str | None, avoid: frozenset[int] = frozenset(), mesh_tls: MeshTls | None = None
) -> str:
    """`avoid`: ports this launch will bind later (the gateway's): a private Redis must not take them first.
    `mesh_tls`: a private Redis serves TLS only (clients need a certificate from the mesh's CA) and a password."""
    url = redis_url or os.environ.get("REDIS_URL")
    if url:
        return url
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit(NO_REDIS)
    port = free_port(avoid=avoid)
    settings = {
        "port": str(port),
        "bind": "127.0.0.1",
        "save": '""',
        "appendonly": "no",
        "dir": mesh.tmp.name,
        "logfile": os.path.join(mesh.tmp.name, "redis.log"),
    }
    url = f"redis://127.0.0.1:{port}/0"
    if mesh_tls is not None:
        password = secrets.token_hex(16)
        d = mesh_tls.directory
        settings.update(
            {
                "port": "0",
                "tls-port": str(port),
                "tls-cert-file": str(d / "tls.crt"),
                "tls-key-file": str(d / "tls.key"),
                "tls-ca-cert-file": str(d / "ca.crt"),
                "tls-auth-clients": "yes",
                "requirepass": password,
            }
        )
        # the peer is this host's own Redis: its certificate is checked against the mesh's CA, not the address
        url = f"rediss://:{password}@127.0.0.1:{port}/0?ssl_check_hostname=false"
    config = os.path.join(mesh.tmp.name, "redis.conf")  # a file readable by this user only: it holds the password
    fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.writelines(f"{key} {value}\n" for key, value in settings.items())
    mesh.spawn("redis", [binary, config])
    import redis

    client = redis.Redis.from_url(url, **(mesh_tls.redis_kwargs(url) if mesh_tls else {}))
    _wait(lambda: client.ping(), mesh, "redis-server", 20)
    log.info("started a private redis-server on 127.0.0.1:%d%s", port, " (TLS, password)" if mesh_tls else "")
    return url


def _wait(
    probe, mesh: Mesh, what: str, timeout: float, only: tuple[str, ...] | None = None, restarts: Restarts | None = None
) -> None:
    """Until `probe()` is true. A child in `only` (default: all) that exits fails the start-up; with `restarts`,
    the others' exits are handled by its policy meanwhile."""
    deadline = time.monotonic() + timeout
    while True:
        mesh.check_alive(only)
        if restarts is not None and (reason := restarts.check()) is not None:
            raise RuntimeError(reason)
        try:
            if probe():
                return
        except Exception:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} was not ready after {timeout:.0f} s")
        time.sleep(0.2)


@contextlib.contextmanager
def _toggle(toggle: str):
    """(the toggle's stub, the message module) over one short-lived channel (mTLS when the mesh uses it)."""
    from epdmesh.v1 import mesh_pb2 as pb
    from epdmesh.v1 import mesh_pb2_grpc as pb_grpc

    with tls.channel(toggle, tls.load(os.environ.get(TLS_ENV)), aio=False) as channel:
        yield pb_grpc.ToggleStub(channel), pb


def _list_workers(toggle: str):
    with _toggle(toggle) as (stub, pb):
        return list(stub.ListWorkers(pb.ListWorkersRequest(), timeout=2).workers)


def _registered(toggle: str) -> int:
    return len(_list_workers(toggle))


def _deregister_pid(toggle: str, pid: int) -> None:
    with _toggle(toggle) as (stub, pb):
        for entry in stub.ListWorkers(pb.ListWorkersRequest(), timeout=2).workers:
            if entry.info.pid == pid:
                stub.Deregister(pb.DeregisterRequest(worker_id=entry.info.worker_id), timeout=2)
                log.info("deregistered %s (pid %d): the toggle no longer routes to it", entry.info.worker_id, pid)


def _http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=2) as r:
        return r.status == 200


def _mesh_tls(args, mesh: Mesh) -> MeshTls | None:
    """The launch's TLS: `--tls-dir`, else with `--internal-tls auto` a throwaway CA in the launch's private
    directory. Every child finds it in its environment (`TLS_ENV`, its `--tls-dir` default)."""
    if args.tls_dir:
        made = tls.MeshTls.load(args.tls_dir)
    elif getattr(args, "internal_tls", "off") == "auto":
        made = tls.init(os.path.join(mesh.tmp.name, "tls"), days=30, keep_ca_key=False)
        log.info("internal TLS: a throwaway CA for this launch in %s", made.directory)
    else:
        return None
    os.environ[TLS_ENV] = str(made.directory)
    return made


def _redis_to_children(url: str) -> tuple[list[str], dict[str, str]]:
    """How the toggle and gateway get the Redis URL: in argv, or in their environment when it holds a password
    (argv is visible to every user of the host)."""
    if urllib.parse.urlsplit(url).password is None:
        return ["--redis-url", url], {}
    return [], {REDIS_ENV: url}


def worker_argv(group: WorkerGroup, toggle: str, args, threads: int) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        "epdmesh.cli",
        "worker",
        "--roles",
        group.label,
        "--toggle",
        toggle,
        "--model",
        args.model,
        "--dtype",
        args.dtype,
        "--device",
        args.device,
        "--slo-ttft-ms",
        str(args.slo_ttft_ms),
        "--slo-tbt-ms",
        str(args.slo_tbt_ms),
        "--budget-headroom",
        str(args.budget_headroom),
        "--budget-alpha",
        str(args.budget_alpha),
        "--decoder-joins",
        args.decoder_joins,
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--attention-backend",
        args.attention_backend,
        "--transfer",
        args.transfer,
        "--threads",
        str(threads),
        "--backend",
        args.backend,
        "--stage-calls",
        args.stage_calls,
        "--kv-admission",
        args.kv_admission,
        "--reserved-output-tokens",
        str(reserved_output_tokens(args)),
    ]
    if args.backend == "emulated":
        argv += [
            "--profile",
            args.profile,
            "--emulated-kv-bytes-per-token",
            str(args.emulated_kv_bytes_per_token),
            "--emulated-image-bytes-per-token",
            str(args.emulated_image_bytes_per_token),
        ]
    if args.max_model_len:
        argv += ["--max-model-len", str(args.max_model_len)]
    if args.kv_cache_gib is not None:  # else each sizes its own from its GPU's memory
        argv += ["--kv-cache-gib", str(args.kv_cache_gib)]
    argv += ["--image-cache-gib", str(args.image_cache_gib)]
    for flag, value in (
        ("--token-budget", args.token_budget),
        ("--image-budget", args.image_budget),
        ("--latency-profile", args.latency_profile),
    ):
        if value is not None:
            argv += [flag, str(value)]
    if not args.enable_prefix_caching:
        argv.append("--no-enable-prefix-caching")
    if getattr(args, "share_weights", False):
        argv.append("--share-weights")
    if getattr(args, "enforce_eager", False):
        argv.append("--enforce-eager")
    if not getattr(args, "amx_tiles", True):
        argv.append("--no-amx-tiles")
    if not getattr(args, "prompt_kernel", True):
        argv.append("--no-prompt-kernel")
    if getattr(args, "gap_slack", False):
        argv += ["--gap-slack", "--gap-slack-reserve", str(args.gap_slack_reserve)]
    else:
        argv.append("--no-gap-slack")
    return argv


def serve_mesh(args) -> int:
    groups = parse_topology(args.topology)
    if args.decoder_joins == "auto":
        args.decoder_joins = "first" if decoders_join(groups) else "off"
    num_workers = sum(g.count for g in groups)
    threads = args.threads or max(1, (os.cpu_count() or 1) // num_workers)
    # every process of this mesh is on this host: UCX stays on loopback unless the caller chose its network
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    from epdmesh.auto_profile import ensure_profile, wants_auto_profile

    if wants_auto_profile(args):  # before anything starts: the cores are the profile's alone
        args.latency_profile = ensure_profile(args, threads)
    try:  # one GPU per worker (--device cuda), decided before anything starts
        gpu_envs = worker_envs(num_workers, gpu_devices(args.device, getattr(args, "gpus", None)))
    except ValueError as e:
        log.error("%s", e)
        return 2
    mesh = Mesh()

    def on_signal(signum, _frame):
        mesh.stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        # --port is the gateway's: the toggle's port avoids it (a test saw the toggle take it); workers bind ephemeral
        # ports, which a --port below the ephemeral range (the default's) never is
        mesh_tls = _mesh_tls(args, mesh)
        redis_url = start_redis(mesh, args.redis_url, avoid=frozenset({args.port}), mesh_tls=mesh_tls)
        redis_argv, redis_env = _redis_to_children(redis_url)
        toggle = f"127.0.0.1:{free_port(avoid={args.port, _port_of(redis_url)})}"
        prefix = f"epdmesh:{uuid.uuid4().hex[:12]}:"
        routing = router_argv(args, args.latency_profile)
        mesh.spawn(
            "toggle",
            [
                sys.executable,
                "-m",
                "epdmesh.cli",
                "toggle",
                *redis_argv,
                "--prefix",
                prefix,
                "--port",
                toggle.rsplit(":", 1)[1],
                *routing,
            ],
            env=redis_env,
        )
        # the workers and the gateway start beside the toggle (each takes seconds of imports and loading); a worker
        # registers once the toggle answers, the gateway opens its port once every worker has (--wait-for-workers)
        shares = iter(memory_shares(gpu_envs, args.gpu_memory_utilization, args.device))
        gpu_envs = iter(gpu_envs)
        for group in groups:
            for i in range(group.count):
                share = next(shares)
                memory = [] if share is None else ["--gpu-memory-utilization", f"{share:.6g}"]
                mesh.spawn(
                    f"worker {group.label}#{i}", worker_argv(group, toggle, args, threads) + memory, next(gpu_envs)
                )
        gateway_argv = [
            sys.executable,
            "-m",
            "epdmesh.cli",
            "gateway",
            "--toggle",
            toggle,
            "--model",
            args.model,
            "--host",
            args.host,
            "--port",
            str(args.port),
            "--served-model-name",
            args.served_model_name,
            "--stage-calls",
            args.stage_calls,
            "--wait-for-workers",
            str(num_workers),
            *routing,
            *planner_argv(args),
            *trace_argv(args),
        ]
        gateway_env = {}
        if args.route_in == "gateway":
            gateway_argv += [*redis_argv, "--prefix", prefix]
            gateway_env.update(redis_env)
        if args.max_model_len:
            gateway_argv += ["--max-model-len", str(args.max_model_len)]
        if args.first_token_hold:
            gateway_argv.append("--first-token-hold")
        if args.allow_remote_images:
            gateway_argv += ["--allow-remote-images", "--allowed-image-domains", args.allowed_image_domains]
        if args.chat_template:  # a file's path as this process sees it, or the template itself
            path = os.path.abspath(os.path.expanduser(args.chat_template))
            gateway_argv += ["--chat-template", path if os.path.isfile(path) else args.chat_template]
        keys = api_keys(args, os.environ)  # to the gateway by its environment: argv is visible to every local user
        if keys:
            gateway_env[API_KEY_ENV] = ",".join(keys)
        mesh.spawn("gateway", gateway_argv, env=gateway_env or None)
        _wait(lambda: _registered(toggle) >= 0, mesh, "the toggle", 60)
        mesh.toggle = toggle
        _wait(lambda: _registered(toggle) == num_workers, mesh, f"{num_workers} workers", 600)
        # from here on a child may die (or be killed) without stopping the mesh: `Restarts` brings it back — even
        # while the gateway starts (its /health may answer a client before the probe here sees it) — except the
        # gateway itself, which fails the start-up if it exits before answering (a bad flag, a missing file)
        restarts = Restarts(mesh, args.max_restarts)
        _wait(
            lambda: _http_ok(f"http://{args.host}:{args.port}/health"),
            mesh,
            "the gateway",
            120,
            only=("gateway",),
            restarts=restarts,
        )
        print(
            f"EPDMESH_READY http://{args.host}:{args.port}/v1 topology={args.topology} workers={num_workers}",
            flush=True,
        )
        log.info("mesh %s up: OpenAI API on http://%s:%d/v1 (Ctrl-C stops it)", args.topology, args.host, args.port)
        while not mesh.stopping:
            reason = restarts.check()
            if reason is not None:
                log.error("%s; stopping the mesh", reason)
                return 1
            time.sleep(0.2)
        return 0
    except Stopped as e:
        log.info("%s", e)
        return 0
    except RuntimeError as e:
        log.error("%s", e)
        return 1
    finally:
        mesh.stop()
