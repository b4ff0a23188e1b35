"""A mesh across two hosts: two network namespaces joined by a veth pair (192.0.2.1 and 192.0.2.2, made here and
removed after). Host A runs Redis, the toggle, an EP worker and the gateway; host B a decoder that registers the
address A reaches it at (`--advertise-host`). Greedy chats give transformers' tokens, and the decoder pulled its
KV pages from host A — over NIXL/UCX on the veth (`UCX_NET_DEVICES` names it, not loopback), and over the gRPC
stream fallback."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from tests.services.servers import MODEL, TINY_ENGINE, TINY_IMAGE_CACHE
from tests.services.test_gateway import to_openai

A, B = "192.0.2.1", "192.0.2.2"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@contextlib.contextmanager
def two_hosts():
    """(namespace A, namespace B, the veth's name in each): removed at the end whatever happens."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2's `ip`")
    tag = uuid.uuid4().hex[:6]
    ns_a, ns_b, veth_a, veth_b = f"epd-a-{tag}", f"epd-b-{tag}", f"epda{tag}", f"epdb{tag}"
    try:
        _ip("netns", "add", ns_a)
    except subprocess.CalledProcessError as e:
        pytest.skip(f"cannot make a network namespace here: {e.stderr.strip()}")
    try:
        _ip("netns", "add", ns_b)
        _ip("link", "add", veth_a, "type", "veth", "peer", "name", veth_b)
        for ns, veth, address in ((ns_a, veth_a, A), (ns_b, veth_b, B)):
            _ip("link", "set", veth, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", veth)
            _ip("-n", ns, "link", "set", veth, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield ns_a, ns_b, veth_a, veth_b
    finally:
        for ns in (ns_a, ns_b):  # the veth pair goes with its namespaces
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


class Processes:
    def __init__(self, log_dir):
        self.log_dir = log_dir
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, ns: str, argv: list[str], env: dict | None = None) -> None:
        log = open(self.log_dir / f"{name}.log", "w")
        environ = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        environ.pop("REDIS_URL", None)
        proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, *argv], stdout=log, stderr=subprocess.STDOUT, env=environ, cwd=ROOT
        )
        self.procs.append((name, proc))

    def logs(self) -> str:
        return "\n".join(f"--- {n}\n" + (self.log_dir / f"{n}.log").read_text()[-2500:] for n, _ in self.procs)

    def stop(self) -> None:
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        for _, proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


# runs in host A: the chats through the gateway, then the decoder's page counters from its /metrics on host B
CLIENT = textwrap.dedent(
    """
    import json, sys, time, httpx
    base, metrics, bodies = sys.argv[1], sys.argv[2], json.load(open(sys.argv[3]))
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200 and len(
                httpx.get(base + "/stats", timeout=5).json().get("workers", {})) == 2:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            sys.exit("the mesh did not come up with two workers")
        time.sleep(0.5)
    tokens = [httpx.post(base + "/v1/chat/completions", json=b, timeout=120).json()["choices"][0]["token_ids"]
              for b in bodies]
    stats = httpx.get(base + "/stats", timeout=5).json()
    print(json.dumps({"tokens": tokens, "workers": stats["workers"], "metrics": httpx.get(metrics).text}))
    """
)


def _mesh(tiny_dir, tmp_path, ns_a, ns_b, transfer: str, env_a: dict, env_b: dict) -> Processes:
    procs = Processes(tmp_path)
    python = [sys.executable, "-m", "epdmesh.cli"]
    engine = [
        "--model",
        str(tiny_dir),
        *TINY_ENGINE,
        *TINY_IMAGE_CACHE,
        "--transfer",
        transfer,
        "--toggle",
        f"{A}:50051",
        "--port",
        "50061",
    ]
    password = uuid.uuid4().hex  # a Redis reachable from another host asks for one
    url = f"redis://:{password}@{A}:6379/0"
    redis = ["redis-server", "--bind", A, "--port", "6379", "--save", "", "--appendonly", "no"]
    redis += ["--requirepass", password]
    procs.start("redis", ns_a, redis)
    ping = ["ip", "netns", "exec", ns_a, "redis-cli", "-h", A, "-a", password, "--no-auth-warning", "ping"]
    deadline = time.monotonic() + 20
    while subprocess.run(ping, capture_output=True, text=True).stdout.strip() != "PONG":  # the toggle needs it up
        assert time.monotonic() < deadline, "redis-server did not start in host A"
        time.sleep(0.1)
    toggle = [*python, "toggle", "--host", A, "--port", "50051"]
    procs.start("toggle", ns_a, toggle, {"EPDMESH_REDIS_URL": url})
    procs.start("ep", ns_a, [*python, "worker", "--roles", "EP", "--host", A, *engine], env_a)
    procs.start("d", ns_b, [*python, "worker", "--roles", "D", "--host", "0.0.0.0", "--advertise-host", B,
                            "--metrics-port", "9400", *engine], env_b)  # fmt: skip
    gateway = [*python, "gateway", "--toggle", f"{A}:50051", "--model", str(tiny_dir), "--host", A, "--port", "8000"]
    gateway += ["--served-model-name", MODEL, "--prefill-mode", "dedicated"]
    procs.start("gateway", ns_a, gateway, {"EPDMESH_REDIS_URL": url})
    return procs


@pytest.mark.parametrize("transfer", ["nixl", "grpc"])
def test_a_mesh_across_two_hosts_answers_exactly_with_pages_pulled_between_them(
    transfer, tiny_dir, chat_reference, tmp_path
):
    cases, refs = chat_reference
    bodies = [
        {"model": MODEL, "messages": to_openai(c.conversation), "max_tokens": c.max_tokens, "temperature": 0}
        | {"return_token_ids": True}
        for c in cases
    ]
    (tmp_path / "bodies.json").write_text(json.dumps(bodies))
    (tmp_path / "client.py").write_text(CLIENT)
    with two_hosts() as (ns_a, ns_b, veth_a, veth_b):
        # UCX on the link between the hosts; never loopback, which would not reach the other host
        env_a, env_b = ({"UCX_NET_DEVICES": veth_a}, {"UCX_NET_DEVICES": veth_b}) if transfer == "nixl" else ({}, {})
        procs = _mesh(tiny_dir, tmp_path, ns_a, ns_b, transfer, env_a, env_b)
        try:
            client = [sys.executable, str(tmp_path / "client.py"), f"http://{A}:8000", f"http://{B}:9400/metrics"]
            done = subprocess.run(
                ["ip", "netns", "exec", ns_a, *client, str(tmp_path / "bodies.json")],
                capture_output=True,
                text=True,
                timeout=400,
                cwd=ROOT,
            )
            assert done.returncode == 0, done.stderr[-3000:] + procs.logs()
            result = json.loads(done.stdout.strip().splitlines()[-1])
        finally:
            procs.stop()
    for case, tokens in zip(cases, result["tokens"]):
        assert tokens == refs[case.name].tokens, case.name
    addresses = sorted(w["address"] for w in result["workers"].values())
    assert addresses == [f"{A}:50061", f"{B}:50061"]  # the decoder registered the address host A dials
    pulled = [
        float(line.rsplit(" ", 1)[1])
        for line in result["metrics"].splitlines()
        if line.startswith("epdmesh:transfer_bytes_total{") and f'backend="{transfer}"' in line and 'kind="kv"' in line
    ]
    assert pulled and sum(pulled) > 0, result["metrics"][-2000:]  # the decoder pulled KV pages across the link
