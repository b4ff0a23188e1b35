"""`epdmesh deploy k8s --topology T`: the Kubernetes manifests of a mesh, from the topology grammar `serve` takes.

One Deployment per role set of T (its replicas the group's count; pods labelled `epdmesh.io/roles`, as llm-d labels
its pods `llm-d.ai/role`), the toggle, the gateway, Redis, an OpenTelemetry collector and Jaeger, with their
Services. Workers are not behind a Service: each registers its pod IP (`--advertise-host` from the downward API)
with the toggle, and the mesh dials it there. Readiness and liveness come from `grpc.health.v1` (the workers, the
toggle) and `/health` (the gateway); a worker's `preStop` hook drains it (`epdmesh drain`: out of the registry, its
running decodes handed back with their KV) inside a longer `terminationGracePeriodSeconds`.

What the manifests expect to exist (made by the operator, never rendered here: they hold secrets or data):
  - PersistentVolumeClaim `--model-volume` holding the checkpoint at `--model` (ReadOnlyMany: every pod mounts it);
  - Secret `epdmesh-redis` with key `password` (Redis requires it; the toggle and gateway log in with it; it goes
    into a Redis URL, so use URL-safe characters, e.g. `openssl rand -hex 16`);
  - with `--tls-secret S`: Secret S with `ca.crt`, `tls.crt`, `tls.key` (`epdmesh tls init DIR`, then
    `kubectl create secret generic S --from-file=DIR/ca.crt --from-file=DIR/tls.crt --from-file=DIR/tls.key`):
    mutual TLS on every gRPC hop, Redis over TLS only. Use a CA of the mesh's own: any certificate it signed is a
    member. Certificates are read at start: after a rotation, restart the pods;
  - optionally Secret `epdmesh-api-key` with key `key`: the gateway's API key (no Secret: the API is open).
"""

from __future__ import annotations

import argparse
import sys

import yaml

from common.topology import WorkerGroup, decoders_join, parse_topology

APP = "epdmesh"
ROLES_LABEL = "epdmesh.io/roles"
TOGGLE_PORT, WORKER_PORT, METRICS_PORT, GATEWAY_PORT = 50051, 50061, 9400, 8000
REDIS_PORT, OTLP_PORT, JAEGER_UI_PORT = 6379, 4317, 16686
REDIS_IMAGE, COLLECTOR_IMAGE = "redis:7.4", "otel/opentelemetry-collector-contrib:0.120.0"
JAEGER_IMAGE = "jaegertracing/jaeger:2.10.0"
PREFIX = "epdmesh:k8s:"
DRAIN_GRACE_S = 20  # the preStop drain: running decodes finish for this long, then are handed back with their KV
# the pod's whole grace: the drain's grace, its settle time (services/worker/switch.py SETTLE_S, 30 s), the worker's
# own SIGTERM drain (--grace, 10 s) and a margin
TERMINATION_GRACE_S = DRAIN_GRACE_S + 30 + 10 + 30
TLS_MOUNT, MODEL_MOUNT = "/etc/epdmesh/tls", "/models"
EPDMESH_UID, REDIS_UID = 10001, 999  # the images' users (the Dockerfile's epdmesh; redis's redis), and their groups
REDIS_SECRET, API_KEY_SECRET = "epdmesh-redis", "epdmesh-api-key"


def _labels(component: str, **extra: str) -> dict:
    return {"app.kubernetes.io/name": APP, "app.kubernetes.io/component": component, **extra}


def _service(name: str, component: str, ports: list[tuple[str, int]]) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "labels": _labels(component)},
        "spec": {
            "selector": _labels(component),
            "ports": [{"name": n, "port": p, "targetPort": n, "protocol": "TCP"} for n, p in ports],
        },
    }


def _deployment(
    name: str, component: str, replicas: int, pod: dict, labels: dict | None = None, uid: int = 0, gpus: bool = False
) -> dict:
    """`uid`: the pod runs as this user and group, never root, and mounted secrets belong to its group. `gpus`: a
    rolling update stops a pod before it starts the next (a surge pod would need a spare GPU)."""
    labels = labels or _labels(component)
    if uid:
        context = {"runAsNonRoot": True, "runAsUser": uid, "runAsGroup": uid, "fsGroup": uid}
        pod = {"securityContext": {**context, "seccompProfile": {"type": "RuntimeDefault"}}, **pod}
        locked = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
        pod["containers"] = [{**c, "securityContext": locked} for c in pod["containers"]]
    strategy = {"strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "replicas": replicas,
            **(strategy if gpus else {}),
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": pod},
        },
    }


class Mesh:
    """The objects of one mesh (`render`), from the command's options."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.groups = parse_topology(args.topology)
        self.tls = args.tls_secret is not None

    # --- pieces every epdmesh pod shares -------------------------------------------------------------------
    def _env(self, service: str, redis: bool = False) -> list[dict]:
        env = [
            {"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": f"http://otel-collector:{OTLP_PORT}"},
            {"name": "OTEL_EXPORTER_OTLP_PROTOCOL", "value": "grpc"},
            {"name": "OTEL_SERVICE_NAME", "value": service},
        ]
        if redis:  # the URL holds the password: built in the pod from the Secret, never written here
            scheme, query = ("rediss", "?ssl_check_hostname=false") if self.tls else ("redis", "")
            env += [
                {"name": "REDIS_PASSWORD", "valueFrom": {"secretKeyRef": {"name": REDIS_SECRET, "key": "password"}}},
                {"name": "EPDMESH_REDIS_URL", "value": f"{scheme}://:$(REDIS_PASSWORD)@redis:{REDIS_PORT}/0{query}"},
            ]
        return env

    def _mounts(self, model: bool = True) -> tuple[list[dict], list[dict]]:
        """(volumeMounts, volumes): the model read-only, the TLS secret."""
        mounts, volumes = [], []
        if model:
            mounts.append({"name": "models", "mountPath": MODEL_MOUNT, "readOnly": True})
            claim = {"claimName": self.args.model_volume, "readOnly": True}
            volumes.append({"name": "models", "persistentVolumeClaim": claim})
        if self.tls:
            mounts.append({"name": "tls", "mountPath": TLS_MOUNT, "readOnly": True})
            # readable by the pod's group (`fsGroup`: the image's user), not by the world
            volumes.append({"name": "tls", "secret": {"secretName": self.args.tls_secret, "defaultMode": 0o440}})
        return mounts, volumes

    def _tls_argv(self) -> list[str]:
        return ["--tls-dir", TLS_MOUNT] if self.tls else []

    def _grpc_probe(self, port: int, **timing) -> dict:
        """grpc.health.v1 on `port`: kubelet's own gRPC probe, or (mutual TLS: kubelet has no client certificate)
        `epdmesh health` in the pod with the pod's certificate."""
        if self.tls:
            command = ["epdmesh", "health", f"127.0.0.1:{port}", *self._tls_argv()]
            probe = {"exec": {"command": command}}
        else:
            probe = {"grpc": {"port": port}}
        return {**probe, "periodSeconds": 10, "timeoutSeconds": 5, **timing}

    def _container(self, name: str, command: list[str], ports: list[tuple[str, int]], **more) -> dict:
        return {
            "name": name,
            "image": self.args.image,
            "imagePullPolicy": "IfNotPresent",
            "command": command,
            "ports": [{"name": n, "containerPort": p, "protocol": "TCP"} for n, p in ports],
            **more,
        }

    # --- the services ------------------------------------------------------------------------------------
    def worker(self, group: WorkerGroup, joins: bool) -> dict:
        a = self.args
        command = ["epdmesh", "worker", "--roles", group.label, "--model", a.model, "--toggle", f"toggle:{TOGGLE_PORT}"]
        command += ["--host", "0.0.0.0", "--port", str(WORKER_PORT), "--advertise-host", "$(POD_IP)"]
        command += ["--worker-id", "$(POD_NAME)", "--metrics-port", str(METRICS_PORT), "--grace", "10"]
        command += ["--decoder-joins", "first" if joins else "off", *self._slo_argv(), *self._tls_argv()]
        command += ["--device", "cuda"] if a.gpus_per_worker else ["--device", "cpu"]
        env = [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            *self._env(f"epdmesh-worker-{group.label.lower()}"),
        ]
        mounts, volumes = self._mounts()
        mounts.append({"name": "shm", "mountPath": "/dev/shm"})  # torch's shared memory: a pod's default is 64 MiB
        volumes.append({"name": "shm", "emptyDir": {"medium": "Memory"}})
        drain = ["epdmesh", "drain", f"127.0.0.1:{WORKER_PORT}", "--grace", str(DRAIN_GRACE_S), *self._tls_argv()]
        container = self._container(
            "worker",
            command,
            [("grpc", WORKER_PORT), ("metrics", METRICS_PORT)],
            env=env,
            volumeMounts=mounts,
            startupProbe=self._grpc_probe(WORKER_PORT, periodSeconds=5, failureThreshold=120),  # a model loads
            readinessProbe=self._grpc_probe(WORKER_PORT),
            livenessProbe=self._grpc_probe(WORKER_PORT, failureThreshold=3),
            lifecycle={"preStop": {"exec": {"command": drain}}},
        )
        if a.gpus_per_worker:
            container["resources"] = {"limits": {"nvidia.com/gpu": a.gpus_per_worker}}
        pod = {"terminationGracePeriodSeconds": TERMINATION_GRACE_S, "containers": [container], "volumes": volumes}
        labels = _labels("worker", **{ROLES_LABEL: group.label})
        name = f"worker-{group.label.lower()}"
        return _deployment(name, "worker", group.count, pod, labels, EPDMESH_UID, gpus=bool(a.gpus_per_worker))

    def toggle(self) -> list[dict]:
        command = ["epdmesh", "toggle", "--prefix", PREFIX, "--host", "0.0.0.0", "--port", str(TOGGLE_PORT)]
        command += [*self._slo_argv(), *self._tls_argv()]
        mounts, volumes = self._mounts(model=False)
        container = self._container(
            "toggle",
            command,
            [("grpc", TOGGLE_PORT)],
            env=self._env("epdmesh-toggle", redis=True),
            volumeMounts=mounts,
            readinessProbe=self._grpc_probe(TOGGLE_PORT),
            livenessProbe=self._grpc_probe(TOGGLE_PORT, failureThreshold=3),
        )
        pod = {"containers": [container], "volumes": volumes}
        return [
            _deployment("toggle", "toggle", 1, pod, uid=EPDMESH_UID),
            _service("toggle", "toggle", [("grpc", TOGGLE_PORT)]),
        ]

    def gateway(self) -> list[dict]:
        a = self.args
        command = ["epdmesh", "gateway", "--toggle", f"toggle:{TOGGLE_PORT}", "--model", a.model, "--prefix", PREFIX]
        command += ["--host", "0.0.0.0", "--port", str(GATEWAY_PORT), *self._slo_argv(), *self._tls_argv()]
        if a.served_model_name:
            command += ["--served-model-name", a.served_model_name]
        if a.first_token_hold:
            command.append("--first-token-hold")
        if a.record_trace:  # every replica into the mesh Redis's one stream (its Redis URL in the environment)
            command += ["--record-trace", "redis"]
        env = self._env("epdmesh-gateway", redis=True)
        key = {"secretKeyRef": {"name": API_KEY_SECRET, "key": "key", "optional": True}}
        env.append({"name": "EPDMESH_API_KEY", "valueFrom": key})
        mounts, volumes = self._mounts()
        # ready when the mesh behind it covers every stage (/health); alive while its HTTP server accepts: /health
        # is a 503 while workers load or the toggle restarts, which must not restart the gateway
        health = {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10, "timeoutSeconds": 5}
        alive = {"tcpSocket": {"port": "http"}, "periodSeconds": 10, "timeoutSeconds": 5}
        container = self._container(
            "gateway",
            command,
            [("http", GATEWAY_PORT)],
            env=env,
            volumeMounts=mounts,
            startupProbe={**alive, "periodSeconds": 5, "failureThreshold": 60},
            readinessProbe=health,
            livenessProbe={**alive, "failureThreshold": 3},
        )
        pod = {"containers": [container], "volumes": volumes}
        return [
            _deployment("gateway", "gateway", a.gateways, pod, uid=EPDMESH_UID),
            _service("gateway", "gateway", [("http", GATEWAY_PORT)]),
        ]

    def redis(self) -> list[dict]:
        """The registry (soft state: nothing on disk). A password always; with TLS, TLS only."""
        argv = ["--save", "", "--appendonly", "no", "--requirepass", "$(REDIS_PASSWORD)"]
        if self.tls:
            argv += ["--port", "0", "--tls-port", str(REDIS_PORT), "--tls-auth-clients", "yes"]
            argv += ["--tls-cert-file", f"{TLS_MOUNT}/tls.crt", "--tls-key-file", f"{TLS_MOUNT}/tls.key"]
            argv += ["--tls-ca-cert-file", f"{TLS_MOUNT}/ca.crt"]
        mounts, volumes = self._mounts(model=False)
        probe = {"tcpSocket": {"port": "redis"}, "periodSeconds": 10}
        container = {
            "name": "redis",
            "image": REDIS_IMAGE,
            "command": ["redis-server"],
            "args": argv,
            "env": [
                {"name": "REDIS_PASSWORD", "valueFrom": {"secretKeyRef": {"name": REDIS_SECRET, "key": "password"}}}
            ],
            "ports": [{"name": "redis", "containerPort": REDIS_PORT, "protocol": "TCP"}],
            "volumeMounts": mounts,
            "readinessProbe": probe,
            "livenessProbe": probe,
        }
        pod = {"containers": [container], "volumes": volumes}
        return [
            _deployment("redis", "redis", 1, pod, uid=REDIS_UID),  # its command skips the image's switch to redis
            _service("redis", "redis", [("redis", REDIS_PORT)]),
        ]

    def tracing(self) -> list[dict]:
        """An OpenTelemetry collector every process sends to, which exports to Jaeger (v2, in memory)."""
        config = {
            "receivers": {"otlp": {"protocols": {"grpc": {"endpoint": f"0.0.0.0:{OTLP_PORT}"}}}},
            "processors": {"batch": {}},
            "exporters": {"otlp": {"endpoint": f"jaeger:{OTLP_PORT}", "tls": {"insecure": True}}},
            "extensions": {"health_check": {"endpoint": "0.0.0.0:13133"}},
            "service": {
                "extensions": ["health_check"],
                "pipelines": {"traces": {"receivers": ["otlp"], "processors": ["batch"], "exporters": ["otlp"]}},
            },
        }
        config_map = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "otel-collector", "labels": _labels("otel-collector")},
            "data": {"config.yaml": yaml.safe_dump(config, sort_keys=False)},
        }
        health = {"httpGet": {"path": "/", "port": "health"}, "periodSeconds": 10}
        collector = {
            "name": "otel-collector",
            "image": COLLECTOR_IMAGE,
            "args": ["--config=/etc/otel/config.yaml"],
            "ports": [
                {"name": "otlp", "containerPort": OTLP_PORT, "protocol": "TCP"},
                {"name": "health", "containerPort": 13133, "protocol": "TCP"},
            ],
            "volumeMounts": [{"name": "config", "mountPath": "/etc/otel", "readOnly": True}],
            "readinessProbe": health,
            "livenessProbe": health,
        }
        collector_pod = {
            "containers": [collector],
            "volumes": [{"name": "config", "configMap": {"name": "otel-collector"}}],
        }
        jaeger_health = {"httpGet": {"path": "/status", "port": "health"}, "periodSeconds": 10}
        jaeger = {
            "name": "jaeger",
            "image": JAEGER_IMAGE,
            "ports": [
                {"name": "otlp", "containerPort": OTLP_PORT, "protocol": "TCP"},
                {"name": "ui", "containerPort": JAEGER_UI_PORT, "protocol": "TCP"},
                {"name": "health", "containerPort": 13133, "protocol": "TCP"},
            ],
            "readinessProbe": jaeger_health,
            "livenessProbe": jaeger_health,
        }
        return [
            config_map,
            _deployment("otel-collector", "otel-collector", 1, collector_pod),
            _service("otel-collector", "otel-collector", [("otlp", OTLP_PORT)]),
            _deployment("jaeger", "jaeger", 1, {"containers": [jaeger]}),
            _service("jaeger", "jaeger", [("otlp", OTLP_PORT), ("ui", JAEGER_UI_PORT)]),
        ]

    def network_policy(self) -> dict:
        """Only the mesh's own pods reach its workers, toggle and Redis (their gRPC admin calls — Drain,
        SwitchRoles, Register — take no other credential without TLS); the gateway and Jaeger's UI stay open to the
        cluster."""
        protected = ["worker", "toggle", "redis", "otel-collector"]
        return {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": "epdmesh-internal", "labels": _labels("network-policy")},
            "spec": {
                "podSelector": {
                    "matchLabels": {"app.kubernetes.io/name": APP},
                    "matchExpressions": [{"key": "app.kubernetes.io/component", "operator": "In", "values": protected}],
                },
                "policyTypes": ["Ingress"],
                "ingress": [{"from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": APP}}}]}],
            },
        }

    def _slo_argv(self) -> list[str]:
        a = self.args
        argv = ["--slo-ttft-ms", f"{a.slo_ttft_ms:g}", "--slo-tbt-ms", f"{a.slo_tbt_ms:g}"]
        return argv + (["--latency-profile", a.latency_profile] if a.latency_profile else [])

    def render(self) -> list[dict]:
        joins = decoders_join(self.groups)
        objects = [*self.redis(), *self.tracing(), *self.toggle()]
        objects += [self.worker(g, joins) for g in self.groups]
        return objects + self.gateway() + [self.network_policy()]


def command_line(args: argparse.Namespace) -> str:
    """The command that renders these manifests, with every option (what the examples' headers hold)."""
    parts = ["epdmesh deploy k8s", f"--topology {args.topology}", f"--image {args.image}"]
    parts += [f"--model {args.model}", f"--model-volume {args.model_volume}"]
    if args.gpus_per_worker:
        parts.append(f"--gpus-per-worker {args.gpus_per_worker}")
    if args.tls_secret:
        parts.append(f"--tls-secret {args.tls_secret}")
    if args.latency_profile:
        parts.append(f"--latency-profile {args.latency_profile}")
    if args.served_model_name:
        parts.append(f"--served-model-name {args.served_model_name}")
    if args.gateways != 1:
        parts.append(f"--gateways {args.gateways}")
    if args.first_token_hold:
        parts.append("--first-token-hold")
    if args.record_trace:
        parts.append("--record-trace")
    parts += [f"--slo-ttft-ms {args.slo_ttft_ms:g}", f"--slo-tbt-ms {args.slo_tbt_ms:g}"]
    return " ".join(parts)


class _Plain(yaml.SafeDumper):
    """Every object written out in full: no anchors and aliases where two share a dict (the labels)."""

    def ignore_aliases(self, data) -> bool:
        return True


def render_yaml(args: argparse.Namespace) -> str:
    header = [f"# {command_line(args)}", "# Rendered by `epdmesh deploy k8s`; what it expects to exist:"]
    header += [
        "#   " + line.strip()
        for line in __doc__.split("What the manifests expect to exist")[1].splitlines()[1:]
        if line.strip()
    ]
    body = yaml.dump_all(Mesh(args).render(), Dumper=_Plain, sort_keys=False, width=120)
    return "\n".join(header) + "\n---\n" + body


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="epdmesh deploy k8s", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--topology", required=True, help="role sets and counts, as `epdmesh serve` takes them (E2+P2+D4)")
    p.add_argument(
        "--image",
        default="epdmesh:local",
        help="the epdmesh image (the repository's Dockerfile; a CUDA build of torch in it for --gpus-per-worker)",
    )
    p.add_argument("--model", default=f"{MODEL_MOUNT}/llava-1.5-7b-hf", help="the checkpoint's path in the pods")
    p.add_argument("--model-volume", default="epdmesh-models", help="the PersistentVolumeClaim mounted at /models")
    p.add_argument("--gpus-per-worker", type=int, default=0, help="nvidia.com/gpu each worker asks for (0: CPU)")
    p.add_argument("--tls-secret", help="a Secret with ca.crt, tls.crt, tls.key: mutual TLS inside the mesh")
    p.add_argument("--latency-profile", help="a latency profile's path in the pods (budgets and SLO routing)")
    p.add_argument("--served-model-name")
    p.add_argument("--gateways", type=int, default=1, help="gateway replicas")
    p.add_argument(
        "--first-token-hold",
        action="store_true",
        help="the gateway sends a handed-over request's first token with its second (`epdmesh serve --help`)",
    )
    p.add_argument(
        "--record-trace",
        action="store_true",
        help="every gateway records its requests into one Redis stream, epdmesh:trace (`epdmesh serve --help`; "
        "this Redis keeps nothing on disk: `epdmesh trace export` it, e.g. from a gateway pod)",
    )
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tbt-ms", type=float, default=200.0)
    p.add_argument("--out", help="write here instead of standard output")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        text = render_yaml(args)
    except ValueError as e:
        print(f"epdmesh deploy k8s: {e}", file=sys.stderr)
        return 2
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0
