"""A throwaway PKI for ``phalanx cluster up --tls``: a CA, a server certificate for the local services (127.0.0.1,
localhost and the host name) and a client certificate shared by the cluster's own processes and its user."""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LocalPKI", "generate_local_pki"]


@dataclass(frozen=True)
class LocalPKI:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _write(path: Path, data: bytes, private: bool = False) -> None:
    path.write_bytes(data)
    if private:
        os.chmod(path, 0o600)


def generate_local_pki(
    directory: str | Path,
    hosts: tuple[str, ...] = ("127.0.0.1", "localhost"),
    days: int = 30,
    nodes: tuple[str, ...] = (),
) -> LocalPKI:
    """Write ca.pem, server.pem/server.key and client.pem/client.key under `directory` (made if needed), and for
    each of `nodes` a client certificate whose CN is the node's name (node-<name>.pem/.key: it acts only as that
    node; node_cert gives the paths)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=5)
    until = now + datetime.timedelta(days=days)

    def name(cn: str) -> x509.Name:
        return x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Phalanx local cluster"),
                x509.NameAttribute(NameOID.COMMON_NAME, cn),
            ]
        )

    def pem_key(key) -> bytes:
        return key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    ca_key = _key()
    ca_name = name("Phalanx local CA")
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(until)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )

    def leaf(cn: str, usage, sans):
        key = _key()
        builder = (
            x509.CertificateBuilder()
            .subject_name(name(cn))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now)
            .not_valid_after(until)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return builder.sign(ca_key, hashes.SHA256()), key

    names = list(dict.fromkeys([*hosts, socket.gethostname()]))
    sans: list[x509.GeneralName] = []
    for host in names:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            sans.append(x509.DNSName(host))
    server, server_key = leaf("phalanx-services", ExtendedKeyUsageOID.SERVER_AUTH, sans)
    client, client_key = leaf("phalanx-client", ExtendedKeyUsageOID.CLIENT_AUTH, [x509.DNSName("phalanx-client")])
    pki = LocalPKI(out / "ca.pem", out / "server.pem", out / "server.key", out / "client.pem", out / "client.key")
    _write(pki.ca, ca.public_bytes(serialization.Encoding.PEM))
    _write(pki.server_cert, server.public_bytes(serialization.Encoding.PEM))
    _write(pki.server_key, pem_key(server_key), private=True)
    _write(pki.client_cert, client.public_bytes(serialization.Encoding.PEM))
    _write(pki.client_key, pem_key(client_key), private=True)
    for node in nodes:
        cert, key = leaf(node, ExtendedKeyUsageOID.CLIENT_AUTH, [x509.DNSName(node)])
        cert_path, key_path = node_cert(out, node)
        _write(cert_path, cert.public_bytes(serialization.Encoding.PEM))
        _write(key_path, pem_key(key), private=True)
    return pki


def node_cert(directory: str | Path, node: str) -> tuple[Path, Path]:
    """The (certificate, key) paths of a node's client certificate made by generate_local_pki."""
    return Path(directory) / f"node-{node}.pem", Path(directory) / f"node-{node}.key"
