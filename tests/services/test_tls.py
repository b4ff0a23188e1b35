"""Mutual TLS in the mesh (common/tls.py): a mesh launched with `--internal-tls auto` answers with transformers'
tokens while its workers, its toggle and its private Redis refuse a client without the mesh's certificate."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common import tls
from tests.services.servers import assert_pools_full, running_server
from tests.services.test_mesh import _ask_all


def _health(channel: grpc.Channel) -> int:
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return reply.status


def _refused(channel: grpc.Channel) -> grpc.StatusCode:
    with channel, pytest.raises(grpc.RpcError) as e:
        _health(channel)
    return e.value.code()


def _grpc_clients(address: str, own: tls.MeshTls, other: tls.MeshTls) -> None:
    """`address` answers a client with the mesh's certificate, and refuses one in plaintext, one that has no
    certificate and one whose certificate another CA signed."""
    with tls.channel(address, own, aio=False) as channel:
        assert _health(channel) == health_pb2.HealthCheckResponse.SERVING, address
    assert _refused(grpc.insecure_channel(address)) == grpc.StatusCode.UNAVAILABLE, address
    no_cert = grpc.ssl_channel_credentials(root_certificates=own.ca)
    no_cert_channel = grpc.secure_channel(address, no_cert, options=[("grpc.ssl_target_name_override", tls.MESH_NAME)])
    assert _refused(no_cert_channel) == grpc.StatusCode.UNAVAILABLE, address
    assert _refused(tls.channel(address, other, aio=False)) == grpc.StatusCode.UNAVAILABLE, address


def test_a_tls_mesh_answers_exactly_and_refuses_clients_without_its_certificate(tiny_dir, chat_reference, tmp_path):
    cases, refs = chat_reference
    other = tls.init(tmp_path / "other-ca")  # a CA of the same shape that is not the mesh's
    log_path = tmp_path / "serve.log"
    extra = ("--internal-tls", "auto")  # --transfer auto: the gRPC stream, encrypted
    with running_server(tiny_dir, "E1+P1+D1", log_path, *extra, redis_url=None) as base:
        log = log_path.read_text()
        directory = re.search(r"internal TLS: a throwaway CA for this launch in (\S+)", log).group(1)
        redis_port = int(re.search(r"private redis-server on 127\.0\.0\.1:(\d+) \(TLS, password\)", log).group(1))
        toggle = re.search(r"toggle serving on (\S+)", log).group(1)
        own = tls.MeshTls.load(directory)
        assert log.count("transfer grpc") == 3, log[-3000:]
        assert (Path(directory) / "tls.key").stat().st_mode & 0o077 == 0  # the key is its owner's alone

        for case, resp in zip(cases, asyncio.run(_ask_all(base, cases))):
            assert resp.choices[0].model_extra["token_ids"] == refs[case.name].tokens, case.name
        assert_pools_full(base)

        workers = httpx.get(f"{base}/stats", timeout=10).json()["workers"]
        assert len(workers) == 3
        for address in [toggle, *(w["address"] for w in workers.values())]:
            _grpc_clients(address, own, other)

        probe = [sys.executable, "-m", "epdmesh.cli", "health", toggle]  # the probe `deploy k8s` gives a TLS pod
        with_tls = subprocess.run([*probe, "--tls-dir", directory], capture_output=True, text=True, timeout=60)
        assert with_tls.returncode == 0 and "SERVING" in with_tls.stdout, with_tls
        assert subprocess.run(probe, capture_output=True, text=True, timeout=60).returncode == 1

        # Redis: TLS only, with a client certificate from the mesh's CA, and a password
        with pytest.raises(redis.ConnectionError):
            redis.Redis(port=redis_port, socket_timeout=3).ping()
        with pytest.raises(redis.AuthenticationError):
            url = f"rediss://127.0.0.1:{redis_port}/0?ssl_check_hostname=false"
            redis.Redis.from_url(url, **own.redis_kwargs(url)).ping()
        with pytest.raises(redis.ConnectionError):  # a client certificate from another CA: Redis refuses it
            url = f"rediss://:x@127.0.0.1:{redis_port}/0?ssl_check_hostname=false"
            foreign = {
                **own.redis_kwargs(url),
                **{k: v for k, v in other.redis_kwargs(url).items() if k != "ssl_ca_certs"},
            }
            redis.Redis.from_url(url, **foreign).ping()
        with pytest.raises(redis.ConnectionError):  # the wrong CA
            redis.Redis.from_url(
                f"rediss://:x@127.0.0.1:{redis_port}/0?ssl_check_hostname=false", **other.redis_kwargs("rediss://")
            ).ping()
        config = Path(directory).parent / "redis.conf"  # the launch's private directory
        assert config.stat().st_mode & 0o077 == 0
        password = re.search(r"^requirepass (\S+)$", config.read_text(), re.M).group(1)
        assert password not in log_path.read_text()  # not logged by any process of the mesh


def test_tls_dir_says_what_is_missing(tmp_path):
    (tmp_path / "ca.crt").write_text("")
    with pytest.raises(SystemExit, match="missing tls.crt, tls.key"):
        tls.MeshTls.load(tmp_path)


def test_redis_kwargs_leave_a_url_that_names_its_own_ca_alone(tmp_path):
    own = tls.init(tmp_path)
    assert own.redis_kwargs("redis://127.0.0.1:6379/0") == {}
    given = own.redis_kwargs("rediss://h:6380/0?ssl_ca_certs=/etc/redis-ca.pem")
    assert "ssl_ca_certs" not in given and given["ssl_certfile"] == str(own.directory / "tls.crt")


def test_redis_urls_are_logged_without_their_password():
    from services.routing.registry import redacted

    assert redacted("rediss://:s3cret@127.0.0.1:6380/0?x=1") == "rediss://:***@127.0.0.1:6380/0?x=1"
    assert redacted("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


def test_tls_keeps_pages_on_the_encrypted_grpc_stream_unless_nixl_is_named(tmp_path, monkeypatch):
    from common.transfer import nixl_backend
    from common.transfer.channels import ChannelPool
    from common.transfer.factory import make_transfer

    started = []

    class Nixl:  # stands in for UCX: records that it was asked to start
        def __init__(self, worker_id, engine, channels):
            started.append(worker_id)
            self.metadata, self.serving, self.tensors = b"", None, {}

    monkeypatch.setattr(nixl_backend, "NixlTransfer", Nixl)
    own = tls.init(tmp_path)
    assert make_transfer("auto", None, ChannelPool(own), "tls-auto").offer == "grpc"
    assert make_transfer("auto", None, ChannelPool(), "plain-auto").offer == "nixl"
    assert make_transfer("nixl", None, ChannelPool(own), "tls-nixl").offer == "nixl"
    assert started == ["plain-auto", "tls-nixl"]


def test_certificates_carry_key_identifiers_and_a_throwaway_ca_keeps_no_key(tmp_path):
    from cryptography import x509

    made = tls.init(tmp_path / "a", keep_ca_key=False)
    assert not (tmp_path / "a" / "ca.key").exists()
    ca, leaf = x509.load_pem_x509_certificate(made.ca), x509.load_pem_x509_certificate(made.cert)
    ski = ca.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value.digest
    assert leaf.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value.key_identifier == ski
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "tls.key").write_text("old")
    (tmp_path / "b" / "tls.key").chmod(0o644)
    tls.init(tmp_path / "b")
    assert (tmp_path / "b" / "tls.key").stat().st_mode & 0o077 == 0  # a key written over an old file is private
