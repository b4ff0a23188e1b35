"""`epdmesh deploy k8s`: the rendered examples in deploy/k8s/ are what the generator writes now; every object is
valid against the Kubernetes 1.37 schemas (strict: no unknown field); and the mesh is wired — every Service selects
pods that expose its ports, every address in a command or setting is a Service and port that exists, the role
labels say the roles the workers are started with, and every epdmesh command parses with the real CLI."""

from __future__ import annotations

import copy
import re
import shlex
from collections import Counter
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from common.topology import parse_topology
from epdmesh import deploy_k8s
from epdmesh.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "deploy" / "k8s").glob("*.yaml"))
K8S_VERSION = "1.37.0"
ADDRESS = re.compile(r"(?:^|[/@:\s])([a-z][a-z0-9-]*):(\d{2,5})\b")


def _command(path: Path) -> list[str]:
    first = path.read_text().splitlines()[0]
    assert first.startswith("# epdmesh deploy k8s "), path
    return shlex.split(first[2:])


def _objects(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


def _pods(objects: list[dict]) -> list[tuple[dict, dict]]:
    """(deployment, pod template) of every Deployment."""
    return [(o, o["spec"]["template"]) for o in objects if o["kind"] == "Deployment"]


def _containers(objects):
    for deployment, template in _pods(objects):
        for container in template["spec"]["containers"]:
            yield deployment, template, container


def test_there_are_examples_and_each_is_what_the_generator_writes_now():
    assert len(EXAMPLES) >= 3
    for path in EXAMPLES:
        argv = _command(path)
        args = deploy_k8s.build_parser().parse_args(argv[3:])
        assert deploy_k8s.render_yaml(args) == path.read_text(), (
            f"{path.name} is stale: regenerate it with `{' '.join(argv)} --out {path.relative_to(ROOT)}`"
        )


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_object_is_valid_against_the_kubernetes_schemas(path):
    objects = _objects(path.read_text())
    for o in objects:
        kubernetes_validate.validate(o, K8S_VERSION, strict=True)
    # the validator is not lenient: a misspelt field of a pod is refused
    broken = copy.deepcopy(next(o for o in objects if o["kind"] == "Deployment"))
    broken["spec"]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_the_mesh_is_wired(path):
    args = deploy_k8s.build_parser().parse_args(_command(path)[3:])
    objects = _objects(path.read_text())
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    config_maps = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ConfigMap"}
    names = [o["kind"] + "/" + o["metadata"]["name"] for o in objects]
    assert len(names) == len(set(names)), Counter(names).most_common(3)

    for deployment, template in _pods(objects):  # a Deployment selects its own pods
        selector = deployment["spec"]["selector"]["matchLabels"]
        assert selector.items() <= template["metadata"]["labels"].items(), deployment["metadata"]["name"]

    for name, service in services.items():  # every Service selects pods that have its ports
        selected = [
            t for _, t in _pods(objects) if service["spec"]["selector"].items() <= t["metadata"]["labels"].items()
        ]
        assert selected, f"Service {name} selects no pods"
        for port in service["spec"]["ports"]:
            for template in selected:
                exposed = {p["name"] for c in template["spec"]["containers"] for p in c["ports"]}
                numbers = {p["containerPort"] for c in template["spec"]["containers"] for p in c["ports"]}
                assert port["targetPort"] in exposed | numbers, (name, port)

    addresses = []  # every host:port in a command, an argument, a setting or a config file
    for _, _, container in _containers(objects):
        texts = container.get("command", []) + container.get("args", [])
        texts += [e["value"] for e in container.get("env", []) if "value" in e]
        addresses += [(container["name"], host, int(port)) for t in texts for host, port in ADDRESS.findall(t)]
    for name, config_map in config_maps.items():
        for text in config_map["data"].values():
            addresses += [(name, host, int(port)) for host, port in ADDRESS.findall(text)]
    addresses = [(who, host, port) for who, host, port in addresses if host not in ("localhost",)]
    assert {host for _, host, _ in addresses} >= {"toggle", "redis", "otel-collector", "jaeger"}
    for who, host, port in addresses:
        assert host in services, f"{who} dials {host}:{port}: no such Service"
        assert port in {p["port"] for p in services[host]["spec"]["ports"]}, f"{who} dials {host}:{port}"

    parser = build_parser()
    groups = {g.label: g.count for g in parse_topology(args.topology)}
    workers = {}
    for deployment, template, container in _containers(objects):
        command = container.get("command", [])
        if command[:1] != ["epdmesh"]:
            continue
        parsed = parser.parse_args(command[1:])  # the real CLI takes it
        probes = [container.get(k, {}) for k in ("readinessProbe", "livenessProbe", "startupProbe")]
        for probe in probes:  # an exec probe or hook is an epdmesh command too
            if "exec" in probe:
                parser.parse_args(probe["exec"]["command"][1:])
        assert ("--tls-dir" in command) == bool(args.tls_secret), container["name"]
        if command[1] == "worker":
            label = template["metadata"]["labels"][deploy_k8s.ROLES_LABEL]
            assert label == parsed.roles, (label, parsed.roles)
            workers[label] = deployment["spec"]["replicas"]
            drain = container["lifecycle"]["preStop"]["exec"]["command"]
            assert parser.parse_args(drain[1:]).func.__name__ == "_cmd_drain"
            assert float(drain[drain.index("--grace") + 1]) + 30 < template["spec"]["terminationGracePeriodSeconds"]
            assert "$(POD_IP)" in command and "$(POD_NAME)" in command  # own address and id per pod
            gpus = container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0)
            assert gpus == args.gpus_per_worker and parsed.device == ("cuda" if gpus else "cpu")
            # as serve sets it: decoders that prefill take hand-overs when the mesh has prefill-only workers too
            assert parsed.decoder_joins == ("first" if "PD" in groups and "P" in groups else "off")
    assert workers == groups

    for _, template in _pods(objects):  # what pods mount: rendered ConfigMaps, the documented Secrets and claim
        for volume in template["spec"].get("volumes", []):
            if "configMap" in volume:
                assert volume["configMap"]["name"] in config_maps
            if "secret" in volume:
                assert volume["secret"]["secretName"] == args.tls_secret
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] == args.model_volume
    # the network policy covers the workers, the toggle and Redis, and lets every pod of the mesh in
    policy = next(o for o in objects if o["kind"] == "NetworkPolicy")["spec"]
    allowed = next(iter(policy["podSelector"]["matchExpressions"]))["values"]
    covered = {
        t["metadata"]["labels"]["app.kubernetes.io/component"]
        for _, t in _pods(objects)
        if policy["podSelector"]["matchLabels"].items() <= t["metadata"]["labels"].items()
        and t["metadata"]["labels"]["app.kubernetes.io/component"] in allowed
    }
    assert covered >= {"worker", "toggle", "redis"}
    source = policy["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
    assert all(source.items() <= t["metadata"]["labels"].items() for _, t in _pods(objects))
    for _, template in _pods(objects):  # epdmesh's pods never run as root
        if template["spec"]["containers"][0]["image"] == args.image:
            assert template["spec"]["securityContext"]["runAsNonRoot"]


def test_a_bad_topology_is_a_clear_error(capsys):
    assert deploy_k8s.main(["--topology", "E1+P1"]) == 2
    assert "no worker for ['decode']" in capsys.readouterr().err


def test_a_recorded_trace_goes_from_every_gateway_into_the_mesh_redis():
    args = deploy_k8s.build_parser().parse_args(["--topology", "EPD2", "--gateways", "2", "--record-trace"])
    objects = _objects(deploy_k8s.render_yaml(args))
    (gateway,) = [c for d, _, c in _containers(objects) if d["metadata"]["name"] == "gateway"]
    command = gateway["command"] + gateway.get("args", [])
    assert command[command.index("--record-trace") + 1] == "redis"
    assert any(e["name"] == "EPDMESH_REDIS_URL" for e in gateway["env"])  # the gateway's --redis-url default
    plain = deploy_k8s.build_parser().parse_args(["--topology", "EPD2"])
    assert "--record-trace" not in deploy_k8s.render_yaml(plain)
