"""Mutual TLS between the mesh's services (`--tls-dir`), and a throwaway CA for one host (`--internal-tls auto`).

A TLS directory holds `ca.crt` (the CA every peer's certificate must chain to), `tls.crt` and `tls.key` (this
process's certificate and key) — the layout of a Kubernetes TLS secret with its CA (cert-manager writes it so).
Every gRPC server asks for a client certificate from that CA, and every channel presents its own and checks the
server's. A peer is dialled by address (a worker registers the address others reach it at, a pod IP on
Kubernetes), so the server's certificate is checked against one name every certificate of the mesh carries,
`MESH_NAME`, not against the address: what proves a peer is a member of the mesh is the CA's signature. Redis over
TLS (`rediss://`) is given the same CA and certificate unless the URL names its own (`?ssl_ca_certs=…`).
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import os
import urllib.parse
from pathlib import Path

import grpc

MESH_NAME = "epdmesh.mesh"  # a DNS name in every certificate of a mesh: what a server's certificate is checked for
FILES = ("ca.crt", "tls.crt", "tls.key")


@dataclasses.dataclass(frozen=True)
class MeshTls:
    directory: Path
    ca: bytes
    cert: bytes
    key: bytes = dataclasses.field(repr=False)

    @classmethod
    def load(cls, directory: str | os.PathLike) -> MeshTls:
        """The CA, certificate and key in `directory`; a clear error naming what is missing."""
        path = Path(directory).expanduser()
        missing = [name for name in FILES if not (path / name).is_file()]
        if missing:
            raise SystemExit(
                f"--tls-dir {path}: missing {', '.join(missing)} (a TLS directory holds ca.crt, tls.crt and "
                "tls.key; `epdmesh tls init DIR` writes a CA and a certificate for a mesh)"
            )
        return cls(path.resolve(), *((path / name).read_bytes() for name in FILES))

    def server_credentials(self) -> grpc.ServerCredentials:
        """A server that refuses clients without a certificate from the mesh's CA."""
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )

    def redis_kwargs(self, url: str) -> dict:
        """The client certificate and CA for a `rediss://` URL that does not name its own; nothing for `redis://`."""
        split = urllib.parse.urlsplit(url)
        if split.scheme != "rediss":
            return {}
        given = urllib.parse.parse_qs(split.query)
        defaults = {
            "ssl_ca_certs": str(self.directory / "ca.crt"),
            "ssl_certfile": str(self.directory / "tls.crt"),
            "ssl_keyfile": str(self.directory / "tls.key"),
        }
        return {k: v for k, v in defaults.items() if k not in given}


def load(directory: str | os.PathLike | None) -> MeshTls | None:
    return None if not directory else MeshTls.load(directory)


def bind(server: grpc.aio.Server, address: str, tls: MeshTls | None) -> int:
    """Bind `server` to `address` (port 0: any free one), over mTLS when `tls` is given; the port bound."""
    if tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, tls.server_credentials())


def channel(address: str, tls: MeshTls | None, options: list | tuple = (), aio: bool = True):
    """A channel to `address`: plaintext, or mTLS checking the server's certificate for `MESH_NAME`."""
    module = grpc.aio if aio else grpc
    if tls is None:
        return module.insecure_channel(address, options=list(options))
    options = [*options, ("grpc.ssl_target_name_override", MESH_NAME)]
    return module.secure_channel(address, tls.channel_credentials(), options=options)


def init(
    directory: str | os.PathLike, names: tuple[str, ...] = (), days: int = 365, keep_ca_key: bool = True
) -> MeshTls:
    """Write a new CA (`ca.crt`, and `ca.key` beside it unless `keep_ca_key` is False: a throwaway CA signs once)
    and one certificate for every service of a mesh (`tls.crt`, `tls.key`: server and client auth; names
    `MESH_NAME`, localhost, 127.0.0.1, ::1 and `names`, each a DNS name or an IP address). Keys are written
    readable by their owner only."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    path = Path(directory).expanduser()
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "epdmesh CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .add_extension(
            x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
        )  # digital signature, certificate and CRL signing
        .sign(ca_key, hashes.SHA256())
    )
    sans: list[x509.GeneralName] = []
    for name in dict.fromkeys((MESH_NAME, "localhost", "127.0.0.1", "::1", *names)):
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            sans.append(x509.DNSName(name))
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, MESH_NAME)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        # key identifiers: strict X.509 verification (Python 3.13's default TLS context) asks for them
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )

    def pem_key(k) -> bytes:
        return k.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    pem = serialization.Encoding.PEM
    if not keep_ca_key:
        (path / "ca.key").unlink(missing_ok=True)
    for name, data, private in (
        *((("ca.key", pem_key(ca_key), True),) if keep_ca_key else ()),
        ("ca.crt", ca_cert.public_bytes(pem), False),
        ("tls.key", pem_key(key), True),
        ("tls.crt", cert.public_bytes(pem), False),
    ):
        fd = os.open(path / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
        os.fchmod(fd, 0o600 if private else 0o644)  # a file written before keeps its mode otherwise
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    return MeshTls.load(path)
