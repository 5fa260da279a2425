"""Certificates for the TLS tests, made with the ``cryptography`` package: a CA, and
server certificates it signs for the IP addresses a test names. EC P-256 keys,
so that making them takes milliseconds."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass(frozen=True)
class ServerCert:
    cert: Path
    key: Path


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return path


def _builder(
    subject: str, issuer: str, public_key: ec.EllipticCurvePublicKey
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )


class CA:
    """A certificate authority in ``directory``: ``ca.pem`` is what clients trust."""

    def __init__(self, directory: Path, name: str = "phalanx test CA"):
        directory.mkdir(parents=True, exist_ok=True)
        self.directory, self.name = directory, name
        self.key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            _builder(name, name, self.key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=False,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self.key, hashes.SHA256())
        )
        self.pem = directory / "ca.pem"
        self.pem.write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    def server(self, name: str, *ips: str, client_too: bool = False) -> ServerCert:
        """A server certificate (and its key) naming exactly ``ips`` (SAN IP entries).
        ``client_too``: usable as a client certificate as well (etcd's JSON gateway
        dials its own gRPC server with it, which asks for one under client-cert-auth)."""
        usages = [x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]
        if client_too:
            usages.append(x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH)
        return self._leaf(name, ips, usages)

    def client(self, name: str) -> ServerCert:
        """A client certificate (and its key), for a server that asks for one."""
        return self._leaf(name, (), [x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH])

    def _leaf(
        self, name: str, ips: tuple[str, ...], usages: list[x509.ObjectIdentifier]
    ) -> ServerCert:
        key = ec.generate_private_key(ec.SECP256R1())
        sans = [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
        builder = _builder(name, self.name, key.public_key())
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = (
            builder.add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        out = self.directory / f"{name}.pem"
        out.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return ServerCert(out, _write_key(key, self.directory / f"{name}.key"))
